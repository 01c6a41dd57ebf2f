"""The machinery of one run: building model and optimizer from the config (build.py), each step's micro-batches built
ahead (batches.py), validation (validation.py), checkpoints (checkpoint.py) and resuming from them (resume.py,
restore.py, checkpoint_checks.py), the run directory and its lock (run_dir.py), stop signals (signals.py) and the
ways a run stops early (stops.py), and the log lines and metrics (logs.py). It may import every folder above; only
checker/ and train.py import it."""
