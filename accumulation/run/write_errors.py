"""The one line for a file of the run that could not be written (a full disk above all): imported only when a
write fails (accumulation/run/checkpoint.py, logs.py, run_dir.py, resumed_logs.py), never by a run that goes well.
The callers raise it as a WriteError (checkpoint.py), which ends the program with one line; the run directory
that cannot be created at start-up, as the ConfigError of bad input (run_dir.py)."""

import errno
import shutil
from pathlib import Path

import torch


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if any. torch.save reports a failed write of its zip writer as the
    OSError itself, or as a RuntimeError raised while the writer cleans up, with the OSError as its context."""
    while error is not None:
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota used up


def why_not_written(error: OSError, folder: Path, needed_bytes: int | None = None) -> str:
    """The reason for a failed write in words: "the disk is full (... needs 2.6 MB, 0.4 MB free)", or the
    operating system's own reason."""
    if not disk_full(error):
        return error.strerror or str(error)
    details = [f"it needs about {needed_bytes / 1e6:.1f} MB"] if needed_bytes else []
    try:
        details.append(f"{shutil.disk_usage(folder).free / 1e6:.1f} MB free")
    except OSError:
        pass  # the folder is gone too: no figure to give
    return f"the disk is full ({', '.join(details + [error.strerror])})"


def not_written(error: OSError, path: Path) -> str:
    """ "<path> could not be written: <why>", the start of most of these lines."""
    return f"{path} could not be written: {why_not_written(error, path.parent)}"


def metrics_line_not_written(error: OSError, path: Path) -> str:
    return f"{not_written(error, path)}; its last line was not written and the lines before are untouched"


def run_directory_not_created(error: OSError, run_dir: Path) -> str:
    why = why_not_written(error, run_dir)
    fix = "free space" if disk_full(error) else "choose a writable run.out_dir (or another run.name)"
    return f"run.out_dir: cannot create the run directory {run_dir} and its lock file ({why}); {fix}"


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a nested payload: close to its size on disk (the rest is small metadata)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def checkpoint_not_written(
    cause: OSError, path: Path, temporaries: tuple[Path, ...], complete: list[Path], payload: dict
) -> str:
    """save_checkpoint's line for a write that failed with `cause`, once its temporary files are removed: the
    checkpoints written before (`complete`, oldest first) are untouched, and a restart resumes from the newest."""
    for leftover in temporaries:
        try:
            leftover.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself is unreachable: there is nothing to clean up
    kept = f"the newest complete checkpoint is {complete[-1].name}" if complete else "no checkpoint exists yet"
    return (
        f"checkpoint {path} could not be written: {why_not_written(cause, path.parent, tensor_bytes(payload))}; "
        f"its temporary file was removed and {kept}; {'free space' if disk_full(cause) else 'fix the cause'}, "
        f"and a restart resumes from the newest checkpoint"
    )


def tensorboard_not_written(cause: OSError, folder: Path) -> str:
    """The line for TensorBoard events in `folder` (the run's tensorboard/) that could not be written."""
    # An event file is a sequence of records, each with its length and checksum: a reader stops at a
    # record cut short, and the resume's purge_step drops the points after the checkpoint.
    metrics_path = folder.parent / "metrics.jsonl"
    # The run directory deleted under the run takes metrics.jsonl with it (its lines go to a file no name reaches).
    kept = (
        "metrics.jsonl holds every step up to here"
        if metrics_path.exists()
        else f"{metrics_path} is gone too (was the run directory deleted?): this run's metrics are no longer on disk"
    )
    return f"TensorBoard events in {folder} could not be written: {why_not_written(cause, folder)}; {kept}"
