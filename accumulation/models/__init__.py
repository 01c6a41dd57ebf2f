"""The models train.py can build and the factory that builds one (README.md, "Layout"). They may import the maths
and config/, never data/, parallel/ or run/: a model knows nothing of where its rows come from or of the ranks."""
