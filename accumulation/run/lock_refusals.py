"""The run lock's paths that a run which goes well never takes: another job holds the lock, the file system has no
flock, a refused run removes what it created (docs/faults.md, "The run lock")."""

import errno
import os
import sys

from accumulation.config.config import ConfigError


class RunDirectoryBusy(ConfigError):
    """Another job holds the run directory; the message names its host and process id."""


def lock_not_taken(lock, error: OSError, created_file: bool) -> None:
    """After `lock` (a RunLock) failed to flock its file: RunDirectoryBusy naming the holder, or, on a file
    system that cannot lock, a warning, and the run goes on unlocked."""
    if isinstance(error, BlockingIOError):
        holder = os.pread(lock.descriptor, 200, 0).decode(errors="replace").strip() or "a job still starting"
        os.close(lock.descriptor)
        lock.descriptor = None
        lock.created = []  # the holder's now, whoever made them: never removed by a job that was refused
        raise RunDirectoryBusy(
            f"run.name: {lock.run_dir} is in use by another training job ({holder}); wait for it to end, "
            f"stop it, or choose another run.name"
        ) from None
    if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
        raise error
    print(
        f"warning: {lock.path}: this file system does not support flock ({error.strerror}); nothing "
        f"stops a second job from using {lock.run_dir} at the same time",
        file=sys.stderr,
    )
    lock.created += [lock.path] if created_file else []


def undo_acquire(lock) -> None:
    """Remove what `lock.acquire` created, when still empty, and unlock: a refused run leaves nothing behind. The
    lock file goes while still locked: a job waiting to lock it then finds it gone and starts again."""
    if lock.path in lock.created:
        try:
            lock.path.unlink()
        except OSError:
            pass  # the folder is unreachable: nothing to clean up
    lock.release()
    for folder in lock.created:
        if folder == lock.path:
            continue
        try:
            folder.rmdir()  # refuses a folder that is not empty
        except OSError:
            break
    lock.created = []
