"""Resuming a run: whether this run continues one from its checkpoint (find_resume_point), and whether every
rank found the same one.

A run's position is its counters: the data order is a pure function of (seed, step, global batch), so the
step count says which examples come next. What else a resume restores is the model, the optimizer, the
scheduler, the GradScaler and every rank's random-number generator (dropout draws from it):
accumulation/run/restore.py, which reads and checks the checkpoint first, imported only when there is one.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from accumulation.config.config import Config
from accumulation.data.splits import DataSummary
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.checkpoint import CheckpointError
from accumulation.run.run_dir import METRICS_FILE, STOPPED_FILE


def find_resume_point(
    config: Config, data: DataSummary, model_on_meta: torch.nn.Module, run_dir: Path, warn, say
) -> dict | None:
    """The checkpoint to continue from, checked against this run (restore.py's load_resume_point), or None
    for a fresh run. A run directory holding none of the files a run leaves is a new run's: there is nothing
    to continue and nothing to refuse."""
    if not any((run_dir / name).exists() for name in ("checkpoints", METRICS_FILE, STOPPED_FILE, "tensorboard")):
        return None
    from accumulation.run.restore import load_resume_point

    return load_resume_point(config, data, model_on_meta, run_dir, warn, say)


def check_ranks_agree_on_resume(context: DistributedContext, resume: dict | None, run_dir: Path) -> None:
    """Every rank reads the checkpoint itself. Where nodes do not share the run directory, ranks on another
    node find no checkpoint and would start afresh beside a resuming rank 0: refused instead."""
    if context.world_size == 1:
        return
    steps_seen = [None] * context.world_size
    dist.all_gather_object(steps_seen, None if resume is None else resume["counters"]["steps"])
    if len(set(steps_seen)) > 1:
        seen = ", ".join(
            f"rank {rank} {'none' if steps is None else f'step {steps}'}" for rank, steps in enumerate(steps_seen)
        )
        raise CheckpointError(
            f"the ranks found different checkpoints in {run_dir / 'checkpoints'} ({seen}); "
            f"run.out_dir must be on storage that every node shares"
        )
