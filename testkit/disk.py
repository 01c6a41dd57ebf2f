"""Small real file systems for tests: a tmpfs of a chosen size (a full disk), and a read-only view of a folder,
each mounted for the duration of a `with` block. Mounting needs root (or CAP_SYS_ADMIN); where it is not
allowed the test is skipped, because an injected OSError would test the handling but not what a real full
disk does to torch.save, nor what a read-only mount does to numpy.memmap."""

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


@contextlib.contextmanager
def read_only_view(folder: Path, mount_point: Path):
    """`folder` seen read-only at `mount_point` (a read-only bind mount), as token files on a read-only
    network share or container volume are: any open for writing fails with EROFS, for root too (root passes
    every permission bit, so chmod alone would test nothing here). Skipped where mounting is not allowed."""
    mount_point.mkdir(parents=True, exist_ok=True)
    bound = subprocess.run(["mount", "--bind", str(folder), str(mount_point)], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({bound.stderr.strip() or 'mount failed'})")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount_point)], check=True, capture_output=True)
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)
