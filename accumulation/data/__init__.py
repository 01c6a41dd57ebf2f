"""Where the rows come from: the Rows interface and its types (rows.py, splits.py), the factory with the data order
(sources.py), the default corpus (text_corpus.py), the sources a path names (path_sources.py: jsonl.py,
token_files.py, masked_lm.py), a fork's own (custom.py), and how much host memory the process may have (memory.py).
They may import the maths and config/, never models/, parallel/ or run/; a fork's own source imports rows.py."""
