"""Where the rows come from: their types, the sources and the data order (README.md, "Layout"). They may import
the maths and config/, never models/, parallel/ or run/; a fork's own source imports rows.py."""
