"""Whether this run continues one from its checkpoint. A new run directory has nothing to continue and nothing
to refuse; any other is read and checked by accumulation/run/restore.py, imported only then."""

from pathlib import Path

import torch

from accumulation.config.config import Config
from accumulation.data.splits import DataSummary
from accumulation.run.run_dir import METRICS_FILE, STOPPED_FILE


def find_resume_point(
    config: Config, data: DataSummary, model_on_meta: torch.nn.Module, run_dir: Path, warn, say
) -> dict | None:
    """The checkpoint to continue from, checked against this run (restore.py's load_resume_point), or None
    for a fresh run: without a checkpoints folder, metrics, a STOPPED file or TensorBoard logs, the run
    directory (or its absence) is a new run's."""
    if not any((run_dir / name).exists() for name in ("checkpoints", METRICS_FILE, STOPPED_FILE, "tensorboard")):
        return None
    from accumulation.run.restore import load_resume_point

    return load_resume_point(config, data, model_on_meta, run_dir, warn, say)
