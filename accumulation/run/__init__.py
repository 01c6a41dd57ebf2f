"""The machinery of one run: build, batches, validation, checkpoints, the run directory, signals, stops, logs
(README.md, "Layout"). It may import every folder above; only checker/ and train.py import it."""
