"""Checkpoints: written atomically, read without unpickling arbitrary objects, and checked before use.

Layout inside the run directory:
    checkpoints/step_000200.pt   one per checkpoint, the newest `keep` of them kept
    checkpoints/latest.pt        the newest, the file `run.resume = "auto"` continues from

A checkpoint is a dict of tensors and plain Python values, loadable with torch.load(weights_only=True):
    model, optimizer, scheduler, scaler, counters, config, rng, data
"""

import os
import re
import shutil
from pathlib import Path

import torch

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "counters", "config", "rng", "data")
STEP_FILE = re.compile(r"step_(\d{6,})\.pt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def step_path(checkpoint_dir: Path, steps: int) -> Path:
    return checkpoint_dir / f"step_{steps:06d}.pt"


def write_atomically(payload: dict, path: Path) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename over `path`. A reader
    sees either the old file or the complete new one, never a partial write, even if this process dies."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as file:
        torch.save(payload, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def save_checkpoint(payload: dict, checkpoint_dir: Path, steps: int, keep: int) -> Path:
    """Write step_XXXXXX.pt and point latest.pt at it, then delete all but the newest `keep` step files."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = step_path(checkpoint_dir, steps)
    write_atomically(payload, path)
    # latest.pt is a second name for the same bytes: a hard link where the filesystem allows one (no
    # second write), a copy otherwise; either way it appears atomically through a rename.
    temporary = checkpoint_dir / ".latest.pt.tmp"
    temporary.unlink(missing_ok=True)
    try:
        os.link(path, temporary)
    except OSError:
        shutil.copyfile(path, temporary)
    os.replace(temporary, checkpoint_dir / "latest.pt")
    for old in step_checkpoints(checkpoint_dir)[:-keep]:
        old.unlink()
    return path


def step_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """The step_XXXXXX.pt files, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if STEP_FILE.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_FILE.fullmatch(p.name).group(1)))


def read_checkpoint(path: Path) -> dict:
    """Load a checkpoint safely: weights_only=True refuses any pickled object that is not a tensor or a
    plain container, so a malicious file cannot run code. Raises CheckpointError for anything unusable."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, corrupted, not a torch file, or a refused pickle
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {path} cannot be read ({first_line})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(payload).__name__}, not a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the keys {missing}; it was not written by this program")
    return payload


def newest_readable_checkpoint(checkpoint_dir: Path, warn) -> tuple[Path, dict] | None:
    """latest.pt if it reads, else the newest step file that does (each bad one reported through `warn`).
    None when the folder holds no checkpoint at all; CheckpointError when it holds only unreadable ones."""
    candidates = [checkpoint_dir / "latest.pt"] + list(reversed(step_checkpoints(checkpoint_dir)))
    candidates = [path for path in candidates if path.exists()]
    if not candidates:
        return None
    for path in candidates:
        try:
            return path, read_checkpoint(path)
        except CheckpointError as error:
            warn(f"warning: {error}; trying an older checkpoint")
    raise CheckpointError(
        f"no readable checkpoint in {checkpoint_dir}; delete the folder to start afresh or restore a good file"
    )
