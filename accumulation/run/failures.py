"""The line and exit status of a run that fails once its run directory is its own (train.py's
train_in_run_directory), and `few` for the messages that name files or weights. Imported only by a run that fails
and by the checks of an existing run directory or checkpoint, never by a run that goes well."""

import sys
import traceback

import torch

from accumulation.config.config import Config
from accumulation.run.checkpoint import WriteError

# A fault of the machine, not bad input (2): torchrun --max-restarts retries it, and each retry resumes from
# the newest complete checkpoint, so freeing space while it retries loses nothing.
WRITE_ERROR_STATUS = 1


def exit_status_after(error: Exception, config: Config, rank: int, world_size: int) -> int:
    """Print the line for `error` (or a bug's traceback) on stderr and return the exit status. Called inside the
    `except` that caught it: a WriteError, bad input found mid-run (a ValueError), or a RuntimeError."""
    if isinstance(error, WriteError):  # a full disk: the rank that wrote says so (the others lose it just after)
        print(f"error: {error}", file=sys.stderr)
        return WRITE_ERROR_STATUS
    if not isinstance(error, RuntimeError):
        # Bad input found now: ranks that disagree or state dicts that do not load (every rank says so), the step-0
        # probe (a mean loss, or coupled rows with batch.on_inexact=error), a row read mid-run holding an id beyond
        # the vocabulary or not the promised N (the rank that read it says so; the others lose it).
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Out of memory: torch.OutOfMemoryError on CUDA, a plain RuntimeError from the CPU allocator.
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
        print(
            f"error: out of memory at batch.micro_batch_size={config.batch.micro_batch_size} "
            f"({str(error).strip().splitlines()[0]}); lower batch.micro_batch_size (A grows, the global batch "
            f'and its update stay the same), or on CUDA set batch.on_oom="shrink"',
            file=sys.stderr,
        )
        return 2
    message = None  # torch.distributed's errors are RuntimeErrors too
    if world_size > 1:
        from accumulation.parallel.torchrun import lost_rank_message

        message = lost_rank_message(error, rank, config.dist.timeout_s)
    if message is None:
        traceback.print_exc()  # not a lost rank but a bug: its traceback is the useful message
        return 1
    print(message, file=sys.stderr)  # every rank: each one's view helps to find the rank that failed first
    return 1


def few(names: list[str]) -> str:
    """The first three names, and how many more: a message stays one readable line."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more
