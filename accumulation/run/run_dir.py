"""The run directory `<run.out_dir>/<run.name>/`: where it may be, what it may hold before a run starts in it, the
lock that keeps it to one training job at a time (docs/faults.md, "The run lock"), and writing its files: whole or
not at all, and a failed write (a full disk above all) said in one line."""

import errno
import fcntl
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from accumulation.config.config import CONFIG_FIRST_LINE, Config, ConfigError

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
STOPPED_FILE = "STOPPED"  # written when optim.on_nonfinite or max_consecutive_skips stops a run
STEP_FILE = re.compile(r"step_(\d{6,})\.pt")  # checkpoints/step_000200.pt
SHARDED_STEP = re.compile(r"step_(\d{6,})\.dcp")  # fsdp2's: a folder (accumulation/run/sharded_checkpoint.py)

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


class RunDirectoryBusy(ConfigError):
    """Another job holds the run directory; the message names its host and process id."""


class WriteError(Exception):
    """A file of the run could not be written (a full disk, a lost mount, no permission): one line naming the file,
    why, and what was kept; the program exits 1 (accumulation/run/entry.py)."""


def check_run_directory(run_dir: Path) -> None:
    """Refuse (RunDirectoryError, one line), before anything is written, a run directory that holds files this
    program did not write, or a fresh run's folder inside another run's directory."""
    if run_dir.exists():
        check_existing_run_directory(run_dir)
    else:
        check_not_inside_a_run(run_dir)


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


def few(names: list[str]) -> str:
    """The first three names, and how many more: a message stays one readable line."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def check_not_inside_a_run(run_dir: Path) -> None:
    """Refuse (RunDirectoryError, one line), before anything is written, a fresh run's folder inside another run's
    directory, whose files it would mix with."""
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
    the process; `created` lists what acquiring created, for a refused run to remove (`release(undo=True)`)."""

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
                self.not_taken(error, created_file)  # raises, or warns that the run goes on unlocked
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

    def not_taken(self, error: OSError, created_file: bool) -> None:
        """After flock failed: RunDirectoryBusy naming the holder, or, on a file system that cannot lock, a
        warning, and the run goes on unlocked."""
        if isinstance(error, BlockingIOError):
            holder = os.pread(self.descriptor, 200, 0).decode(errors="replace").strip() or "a job still starting"
            os.close(self.descriptor)
            self.descriptor = None
            self.created = []  # the holder's now, whoever made them: never removed by a job that was refused
            raise RunDirectoryBusy(
                f"run.name: {self.run_dir} is in use by another training job ({holder}); wait for it to end, "
                f"stop it, or choose another run.name"
            ) from None
        if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
            raise error
        print(
            f"warning: {self.path}: this file system does not support flock ({error.strerror}); nothing "
            f"stops a second job from using {self.run_dir} at the same time",
            file=sys.stderr,
        )
        self.created += [self.path] if created_file else []

    def not_created(self, error: OSError) -> ConfigError:
        fix = "free space" if disk_full(error) else "choose a writable run.out_dir (or another run.name)"
        return ConfigError(
            f"run.out_dir: cannot create the run directory {self.run_dir} and its lock file "
            f"({why_not_written(error, self.run_dir)}); {fix}"
        )

    def release(self, undo: bool = False) -> None:
        """Unlock (closing the file releases it); with `undo` (a refused run), also remove what `acquire` created,
        when still empty, so that a refused run leaves nothing behind. The lock file goes while still locked: a job
        waiting to lock it then finds it gone and starts again. The folders go after."""
        if undo and self.path in self.created:
            try:
                self.path.unlink()
            except OSError:
                pass  # the folder is unreachable: nothing to clean up
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None
        if undo:
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
