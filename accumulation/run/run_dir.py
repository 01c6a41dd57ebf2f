"""The run directory `<run.out_dir>/<run.name>/`: where it may be, and one training job at a time in it.

Where: run.name is one path component (config.py refuses "/", "..", "." and control characters), and the
directory, once symbolic links are resolved, must sit directly inside run.out_dir. A run never writes
anywhere else.

One job at a time: two jobs on one directory would interleave their checkpoints and each rewrite
metrics.jsonl for its own resume, losing the other's lines without a word. So rank 0 holds an advisory lock
(flock) on `<run_dir>/run.lock` for the job's whole life. The kernel releases it when the process ends, however
it ends (kill -9, an out-of-memory kill, a node reboot), so a lock left by a dead job is never an obstacle:
the file stays, but nobody holds it. The other ranks of the same torchrun job never take it, and a torchrun
restart starts only after the previous attempt's processes are gone, so neither counts as another job.

flock needs the file system's cooperation: local disks and NFSv4 give it (NFS emulates it with a byte-range
lock the server sees, so it holds across nodes); Lustre without its `flock` mount option refuses the call,
and then the run goes on without a lock and says so on stderr.
"""

import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

from accumulation.config.config import CONFIG_FIRST_LINE, Config, ConfigError

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
STOPPED_FILE = "STOPPED"  # written when optim.on_nonfinite or max_consecutive_skips stops a run


class RunDirectoryBusy(ConfigError):
    """Another job holds the run directory; the message names its host and process id."""


def run_directory(config: Config) -> Path:
    """`<out_dir>/<name>`, refused with a ConfigError when links take it outside out_dir. (The name itself is
    one path component, checked with the config.) A leading `~` is the home directory, as in a shell: a
    TOML file's "~/runs" is no folder named "~"."""
    out_dir = Path(config.run.out_dir).expanduser()
    run_dir = out_dir / config.run.name
    try:
        resolved = run_dir.resolve()  # follows every link that exists; a part that does not exist stays as written
        out_dir_resolved = out_dir.resolve()
    except (RuntimeError, OSError) as error:  # a loop of links: RuntimeError before Python 3.13, OSError after
        raise ConfigError(
            f"run.out_dir: {run_dir} cannot be resolved ({error}); remove the looping link or choose another "
            f"run.out_dir"
        ) from None
    if resolved.parent != out_dir_resolved:
        raise ConfigError(
            f"run.name: {run_dir} is a link to {resolved}, outside run.out_dir {out_dir}; a run writes only "
            f"inside run.out_dir: remove the link or choose another run.name"
        )
    return run_dir


class RunDirectoryError(ValueError):
    """A run directory, or a file in it, that a run cannot use; the message names it and what to do."""


def check_not_inside_a_run(run_dir: Path) -> None:
    """Refuse (RunDirectoryError, one line), before anything is written, a fresh run's folder inside another run's
    directory, whose files it would mix with. A folder that exists already is checked first, by
    accumulation/run/existing_run_dir.py."""
    for folder in [run_dir.resolve().parent, *run_dir.resolve().parent.parents]:
        if is_a_run_directory(folder):
            raise RunDirectoryError(
                f"run.out_dir: {run_dir.parent} lies inside the run directory {folder}; a run's folder is never "
                f"another run's home: choose a run.out_dir outside every run directory"
            )


def is_a_run_directory(folder: Path) -> bool:
    """Whether `folder` is this program's run directory: its config.toml (with this program's first line) beside
    its checkpoints or metrics. Any one of them alone may be something else: a config copied out of a run,
    another tool's checkpoints/ or run.lock."""
    holds_run_files = (folder / "checkpoints").is_dir() or (folder / METRICS_FILE).is_file()
    return holds_run_files and (folder / "config.toml").is_file() and written_by_this_program(folder / "config.toml")


def written_by_this_program(config_file: Path) -> bool:
    """Whether a config.toml begins with the first line this program writes into it."""
    try:
        with open(config_file, encoding="utf-8", errors="replace") as file:
            return file.readline(len(CONFIG_FIRST_LINE) + 1).rstrip("\n") == CONFIG_FIRST_LINE  # never a whole big file
    except OSError:
        return False


class RunLock:
    """The advisory lock of one run directory, taken by rank 0 (`acquire`) and held until `release` or the
    end of the process. `created` lists what acquiring had to create (the directories, the lock file), so that
    a run refused at start-up can leave the disk as it found it (`release(undo=True)`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.descriptor: int | None = None
        self.created: list[Path] = []

    def acquire(self) -> None:
        missing = [folder for folder in [self.run_dir, *self.run_dir.parents] if not folder.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self.not_created(error) from None
        self.created = list(missing)  # innermost first: the order to remove them in
        # A lock is worth having only on the file the path names. A job refused at start-up removes the lock
        # file it created (release(undo=True)); a job that opened that file just before and locks it just after
        # would hold a lock on a file nobody else finds, and the next job would create and lock a new one. So
        # once locked, the path must still name the locked file; if not, start again with the file there now.
        while True:
            created_file = self.open_lock_file()
            if created_file is None:
                continue  # removed between our two attempts to open it
            try:
                fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self.descriptor, 200, 0).decode(errors="replace").strip() or "a job still starting"
                os.close(self.descriptor)
                self.descriptor = None
                self.created = []  # the holder's now, whoever made them: never removed by a job that was refused
                raise RunDirectoryBusy(
                    f"run.name: {self.run_dir} is in use by another training job ({holder}); wait for it to end, "
                    f"stop it, or choose another run.name"
                ) from None
            except OSError as error:
                if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                    raise
                print(
                    f"warning: {self.path}: this file system does not support flock ({error.strerror}); nothing "
                    f"stops a second job from using {self.run_dir} at the same time",
                    file=sys.stderr,
                )
                self.created += [self.path] if created_file else []
                return
            if self.names_the_locked_file():
                break
            os.close(self.descriptor)
            self.descriptor = None
        if created_file:
            self.created.insert(0, self.path)
        # Who holds it, for the message a second job prints. Written after the lock is ours, so it never
        # overwrites the holder's line. Only a courtesy: on a full disk the lock holds without it, and the
        # run's first real write (config.toml) reports the disk in its one line.
        try:
            os.ftruncate(self.descriptor, 0)
            os.pwrite(self.descriptor, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        except OSError:
            pass

    def open_lock_file(self) -> bool | None:
        """Open the lock file into self.descriptor, creating it if need be; whether this call created it, or
        None when it vanished between the two tries (exclusive creation, then opening the existing file)."""
        # O_CLOEXEC (Python's default): a program this process starts does not inherit, and keep, the lock.
        try:
            try:
                self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                return True
            except FileExistsError:
                self.descriptor = os.open(self.path, os.O_RDWR)
                return False
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self.not_created(error) from None

    def names_the_locked_file(self) -> bool:
        try:
            return os.path.samestat(os.fstat(self.descriptor), os.stat(self.path))
        except FileNotFoundError:
            return False

    def not_created(self, error: OSError) -> ConfigError:
        from accumulation.run.write_errors import run_directory_not_created

        return ConfigError(run_directory_not_created(error, self.run_dir))

    def release(self, undo: bool = False) -> None:
        """Unlock (closing the file releases the lock). With `undo`, remove what `acquire` created, when it is
        still empty: a run refused at start-up leaves nothing behind. The lock file goes while it is still
        locked: a job waiting to lock it then finds it gone and starts again (acquire)."""
        if undo and self.path in self.created:
            try:
                self.path.unlink()
            except OSError:
                pass  # the folder is unreachable: nothing to clean up
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None
        if not undo:
            return
        for folder in self.created:
            if folder == self.path:
                continue
            try:
                folder.rmdir()  # refuses a folder that is not empty
            except OSError:
                break
        self.created = []


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to a temporary file beside `path`, flush it to disk, and rename it over `path`:
    a failure (a full disk, a value that cannot be encoded) leaves the old file or none, never an empty one."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
