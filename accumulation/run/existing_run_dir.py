"""The checks of a run directory that already exists, before anything is written: imported by train.py only when
the folder is there."""

import re
from pathlib import Path

from accumulation.run.checkpoint import SHARDED_STEP, STEP_FILE
from accumulation.run.failures import few
from accumulation.run.run_dir import (
    LOCK_FILE,
    METRICS_FILE,
    STOPPED_FILE,
    RunDirectoryError,
    check_not_inside_a_run,
    written_by_this_program,
)

# What this program writes into a run directory, each name a file or a folder, and what the name holds.
RUN_ENTRIES = {
    METRICS_FILE: ("file", "the metrics of each step"),
    "config.toml": ("file", "the resolved config"),
    LOCK_FILE: ("file", "the lock of the job that holds the run"),
    STOPPED_FILE: ("file", "why a run was stopped"),
    "checkpoints": ("folder", "the checkpoints"),
    "tensorboard": ("folder", "the TensorBoard event files"),
}
# Left by a write that was killed before its rename (metrics.jsonl and config.toml are rewritten atomically).
TEMPORARY_FILES = (".metrics.jsonl.tmp", ".config.toml.tmp")
CHECKPOINT_TEMPORARY = re.compile(r"\.(step_\d{6,}|latest)\.pt\.tmp|\.step_\d{6,}\.dcp\.tmp")


def check_existing_run_directory(run_dir: Path) -> None:
    """Refuse (RunDirectoryError, one line) one of this program's names of the wrong kind (a file `tensorboard`, a
    folder `run.lock`, a folder `checkpoints/latest.pt`); and for a fresh run (no checkpoint file yet) a folder that
    holds anything this program did not write, or that lies inside another run's directory: a fresh run writes
    config.toml, metrics.jsonl and its folders, which would replace a user's files of those names or mix into
    them. What a start-up killed before its first checkpoint leaves (the lock file, config.toml, a checkpoints
    folder with a temporary file) is this program's own, and a fresh run starts over it."""
    if not run_dir.is_dir():
        raise RunDirectoryError(
            f"run.name: {run_dir} is a file, not a folder; choose another run.name, or move the file away"
        )
    checkpoint_dir = run_dir / "checkpoints"
    for path, (kind, role) in [
        *[(run_dir / name, entry) for name, entry in RUN_ENTRIES.items()],
        (checkpoint_dir / "latest.pt", ("file", "the newest checkpoint")),
    ]:
        if path.exists() and path.is_dir() != (kind == "folder"):
            raise RunDirectoryError(
                f"{path} is a {'folder' if path.is_dir() else 'file'}, where this program keeps {role} "
                f"(a {kind}); move it away (or choose another run.name), then start again"
            )
    holds_checkpoint = (checkpoint_dir / "latest.pt").exists() or any(
        STEP_FILE.fullmatch(path.name) or SHARDED_STEP.fullmatch(path.name)
        for path in (checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else ())
    )
    if holds_checkpoint:
        return  # a run to continue (or one a fresh run refuses, in find_resume_point): its own files only matter
    foreign = sorted(entry.name for entry in run_dir.iterdir() if not ours(entry))
    if checkpoint_dir.is_dir():
        foreign += [
            f"checkpoints/{entry.name}"
            for entry in sorted(checkpoint_dir.iterdir())
            if not CHECKPOINT_TEMPORARY.fullmatch(entry.name)
        ]
    if foreign:
        raise RunDirectoryError(
            f"run.name: {run_dir} is not empty and holds no run: it holds {few(foreign)}, which this program did "
            f"not write and a fresh run would write over or mix with; choose another run.name (a new folder), "
            f"or move those files away"
        )
    check_not_inside_a_run(run_dir)


def ours(entry: Path) -> bool:
    """Whether a name in a fresh run's directory is one this program writes (config.toml: with its first line)."""
    if entry.name in TEMPORARY_FILES:
        return True
    return entry.name in RUN_ENTRIES and (entry.name != "config.toml" or written_by_this_program(entry))
