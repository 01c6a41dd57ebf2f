"""What the run directory holds at start-up: files a run may write over (check_run_directory), and a run to continue
from its checkpoint (find_resume_point); a new run directory imports neither existing_run_dir.py nor restore.py."""

from pathlib import Path

import torch

from accumulation.config.config import Config
from accumulation.data.splits import DataSummary
from accumulation.run.run_dir import METRICS_FILE, STOPPED_FILE, check_not_inside_a_run


def check_run_directory(run_dir: Path) -> None:
    """Refuse (RunDirectoryError, one line), before anything is written, a run directory that holds files this
    program did not write, or a fresh run's folder inside another run's directory."""
    if run_dir.exists():
        from accumulation.run.existing_run_dir import check_existing_run_directory

        check_existing_run_directory(run_dir)
    else:
        check_not_inside_a_run(run_dir)


def find_resume_point(
    config: Config, data: DataSummary, model_on_meta: torch.nn.Module, run_dir: Path, warn, say
) -> dict | None:
    """The checkpoint to continue from, checked against this run (restore.py's load_resume_point), or None for a
    run directory (or its absence) without checkpoints, metrics, a STOPPED file or TensorBoard logs."""
    if not any((run_dir / name).exists() for name in ("checkpoints", METRICS_FILE, STOPPED_FILE, "tensorboard")):
        return None
    from accumulation.run.restore import load_resume_point

    return load_resume_point(config, data, model_on_meta, run_dir, warn, say)
