"""A small real file system for tests of a full disk: a tmpfs of a chosen size, mounted for the duration of
a `with` block. Mounting needs root (or CAP_SYS_ADMIN); where it is not allowed the test is skipped, because
an injected OSError would test the handling but not what a real full disk does to torch.save."""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(folder: Path, size_bytes: int):
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fill_disk(folder: Path, leave_free_bytes: int) -> Path:
    """A file that takes all of `folder`'s free space but `leave_free_bytes`; deleting it frees the space."""
    filler = folder / "filler"
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, "wb") as file:
        file.write(b"\0" * max(0, free - leave_free_bytes))
    return filler
