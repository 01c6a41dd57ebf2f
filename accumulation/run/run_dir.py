"""The run directory `<run.out_dir>/<run.name>/`: where it may be, and the lock that keeps it to one training job
at a time (docs/faults.md, "The run lock")."""

import fcntl
import os
import socket
from pathlib import Path

from accumulation.config.config import CONFIG_FIRST_LINE, Config, ConfigError

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
STOPPED_FILE = "STOPPED"  # written when optim.on_nonfinite or max_consecutive_skips stops a run


def run_directory(config: Config) -> Path:
    """`<out_dir>/<name>`, refused with a ConfigError when links take it outside out_dir; a leading `~` is the
    home directory, as in a shell."""
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
    directory, whose files it would mix with (an existing folder is checked first, by run/existing_run_dir.py)."""
    for folder in [run_dir.resolve().parent, *run_dir.resolve().parent.parents]:
        if is_a_run_directory(folder):
            raise RunDirectoryError(
                f"run.out_dir: {run_dir.parent} lies inside the run directory {folder}; a run's folder is never "
                f"another run's home: choose a run.out_dir outside every run directory"
            )


def is_a_run_directory(folder: Path) -> bool:
    """Whether `folder` is this program's run directory: its config.toml (this program's first line) beside its
    checkpoints or metrics, since any one of them alone may be another tool's or a copy."""
    holds_run_files = (folder / "checkpoints").is_dir() or (folder / METRICS_FILE).is_file()
    return holds_run_files and (folder / "config.toml").is_file() and written_by_this_program(folder / "config.toml")


def written_by_this_program(config_file: Path) -> bool:
    try:
        with open(config_file, encoding="utf-8", errors="replace") as file:
            return file.readline(len(CONFIG_FIRST_LINE) + 1).rstrip("\n") == CONFIG_FIRST_LINE  # never a whole big file
    except OSError:
        return False


class RunLock:
    """The advisory lock of one run directory, taken by rank 0 (`acquire`) and held until `release` or the end of
    the process; `created` lists what acquiring created, for a refused run to remove (`release(undo=True)`). Its
    paths a run that goes well never takes are functions of the lock in accumulation/run/lock_refusals.py."""

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
        # Once locked, the path must still name the locked file (a refused job may have removed it meanwhile,
        # docs/faults.md, "The run lock"); if not, start again with the file there now.
        while True:
            created_file = self.open_lock_file()
            if created_file is None:
                continue  # removed between our two attempts to open it
            try:
                fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:  # another job holds it, or the file system cannot lock
                from accumulation.run.lock_refusals import lock_not_taken

                lock_not_taken(self, error, created_file)  # raises, or warns that the run goes on unlocked
                return
            if self.names_the_locked_file():
                break
            os.close(self.descriptor)
            self.descriptor = None
        if created_file:
            self.created.insert(0, self.path)
        # Who holds it, for a second job's message: written once the lock is ours, so never over the holder's line.
        # A full disk loses only this courtesy; the run's first write (config.toml) reports the disk.
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
        """Unlock (closing the file releases it); with `undo` (a refused run), also remove what `acquire` created:
        the lock file before unlocking, the folders after."""
        if undo:
            from accumulation.run.lock_refusals import undo_acquire

            undo_acquire(self)
            return
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None


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
