"""Where the rows come from: the Rows interface and its types (rows.py), the sources (text_corpus.py, jsonl.py,
token_files.py, masked_lm.py), and the factory with the data order that builds one from `data.*` settings
(sources.py), and how much host memory the process may have (memory.py). They may import the maths and config/,
never models/, parallel/ or run/; a fork's own source imports rows.py."""
