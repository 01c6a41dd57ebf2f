"""The run directory: run.name is one folder inside run.out_dir, links cannot lead a run out of it, and one
training job at a time holds it (accumulation/run/run_dir.py). Also: a start-up error is printed by every rank,
so torchrun cannot swallow it. A resume refused after taking the lock leaves the folder as it was, and a
run directory deleted mid-run is said to be gone."""

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import accumulation.run.restore as restore
import accumulation.run.run_dir as run_dir_module
import train
from accumulation.config.config import ConfigError, load_config
from accumulation.run.run_dir import LOCK_FILE, RunDirectoryBusy, RunLock, write_text_atomically
from testkit.disk import fill_disk, small_disk
from testkit.ranks import pretend_launched
from tests.test_checkpoints import run_in_process, snapshot
from tests.test_disrupted_runs import REPO, finish, start_torchrun
from tests.test_train import run_train, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.mark.parametrize(
    "name, named",
    [
        ("..", "choose a name such as my-run"),  # was: config.toml one level up overwritten, exit 0
        (".", "choose a name such as my-run"),  # was: the run written into out_dir itself
        ("", "expected a non-empty string"),
        ("../escaped", "holds a path separator"),
        ("/tmp/absolute-run-name", "holds a path separator"),  # Path(out_dir) / "/tmp/..." drops out_dir
        ("two\nlines", "holds a control character"),
        ("tab\there", "holds a control character"),
        ("x" * 256, "256 bytes, more than the 255"),  # was: an OSError traceback
        ("é" * 128, "256 bytes, more than the 255"),  # bytes, not characters: 128 characters of 2 bytes
    ],
    ids=["dot-dot", "dot", "empty", "parent-path", "absolute", "newline", "tab", "256-bytes", "256-bytes-utf8"],
)
def test_a_run_name_that_is_not_one_folder_is_one_line_and_nothing_written(tmp_path, corpus, capsys, name, named):
    out_dir = tmp_path / "out" / "runs"
    out_dir.mkdir(parents=True)
    (tmp_path / "out" / "config.toml").write_text("# a file one level above out_dir\n")
    before = snapshot(tmp_path / "out")
    arguments = tiny_settings(tmp_path, corpus, **{"run.out_dir": out_dir, "run.max_steps": 0}) + [f"run.name={name}"]
    status, _, error = run_in_process(arguments, capsys)
    assert status == 2
    assert error.startswith("error: run.name: ") and error.count("\n") == 1 and named in error, error
    assert snapshot(tmp_path / "out") == before and not any(out_dir.iterdir())
    assert not Path("/tmp/absolute-run-name").exists()


def test_a_name_of_255_bytes_is_a_run_name():
    assert load_config(["run.name=" + "x" * 255]).run.name == "x" * 255
    with pytest.raises(ConfigError, match="run.name"):
        load_config(["run.name=" + "x" * 256])


def test_a_link_that_leads_out_of_out_dir_is_refused(tmp_path, corpus, capsys):
    """<out_dir>/<name> may exist as a symbolic link: checked after resolving it, it lies elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    (out_dir / "default").symlink_to(elsewhere)
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"run.max_steps": 0}), capsys)
    assert status == 2
    assert error.count("\n") == 1 and "outside run.out_dir" in error and str(elsewhere) in error, error
    assert not any(elsewhere.iterdir())


def test_an_out_dir_that_is_a_loop_of_links_is_one_line(tmp_path, corpus, capsys):
    looping = tmp_path / "loop"
    looping.symlink_to(looping)
    arguments = tiny_settings(tmp_path, corpus, **{"run.out_dir": looping, "run.max_steps": 0})
    status, _, error = run_in_process(arguments, capsys)
    assert status == 2
    assert error.startswith("error: run.out_dir: ") and error.count("\n") == 1 and "looping link" in error, error


def test_a_linked_out_dir_is_fine(tmp_path, corpus, capsys):
    """out_dir itself may be a link (a scratch folder linked into the home directory): the run stays inside it."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "scratch")
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"run.max_steps": 0}), capsys)
    assert status == 0, error
    assert (tmp_path / "scratch" / "default" / "checkpoints" / "latest.pt").exists()


def test_a_fresh_run_refuses_a_folder_of_the_users_files_and_writes_nothing(tmp_path, corpus, capsys):
    """The user's folder with their own config.toml and notes.txt, given as run.out_dir=<parent>
    run.name=<folder>: before, exit 0, their config.toml replaced and checkpoints/, metrics.jsonl,
    tensorboard/ and run.lock added among their files. Now one line naming the folder and what is in it,
    exit 2, and the folder exactly as it was (no run.lock either). A config.toml alone is refused too:
    this program's own starts with its header line, the user's does not."""
    folder = tmp_path / "work" / "my-project"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text("[optim]\nlr = 0.01  # my own settings\n")
    (folder / "notes.txt").write_text("what I tried\n")
    arguments = tiny_settings(tmp_path, corpus, **{"run.out_dir": folder.parent, "run.max_steps": 0})
    for files in (["config.toml", "notes.txt"], ["config.toml"]):
        for path in folder.iterdir():
            if path.name not in files:
                path.unlink()
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        status, _, error = run_in_process(arguments + ["run.name=my-project"], capsys)
        assert status == 2 and error.count("\n") == 1, error
        assert error.startswith(f"error: run.name: {folder} is not empty and holds no run: it holds {files[0]}")
        assert all(name in error for name in files), error
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_a_fresh_run_refuses_to_start_inside_another_runs_folders(tmp_path, corpus, capsys):
    """run.out_dir pointing into an existing run (its tensorboard/ folder, or the run directory itself):
    before, the new run was written there, and TensorBoard on the old run showed the new one's curves."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    before = snapshot(run_dir)
    for out_dir, name in [(run_dir / "tensorboard", "nested"), (run_dir, "nested"), (run_dir, "tensorboard")]:
        status, _, error = run_in_process(arguments + [f"run.out_dir={out_dir}", f"run.name={name}"], capsys)
        assert status == 2 and error.count("\n") == 1, (out_dir, name, error)
        assert "is not empty and holds no run" in error or f"lies inside the run directory {run_dir};" in error
        assert snapshot(run_dir) == before and not (out_dir / "nested").exists()


def test_another_tools_files_above_the_run_are_no_run(tmp_path, corpus, capsys):
    """A project folder with another tool's run.lock, checkpoints/latest.pt and a config.toml copied out of a
    run (the header kept) is no run directory: a fresh run under it starts."""
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "latest.pt").write_bytes(b"another tool's")
    (project / LOCK_FILE).write_text("")
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0, "run.out_dir": project / "runs"})
    assert run_in_process(arguments, capsys)[0] == 0
    shutil.copyfile(project / "runs" / "default" / "config.toml", project / "config.toml")
    shutil.rmtree(project / "checkpoints")
    status, _, error = run_in_process(arguments + ["run.name=second"], capsys)
    assert status == 0, error


def test_a_fresh_run_starts_over_what_a_killed_start_up_left(tmp_path, corpus, capsys):
    """An empty folder, and what a first attempt killed before its step-0 checkpoint leaves (the lock file,
    this program's config.toml, the checkpoint's temporary file), are a fresh run's to use."""
    run_dir = tmp_path / "runs" / "default"
    (run_dir / "checkpoints").mkdir(parents=True)
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0  # an empty folder
    config_text = (run_dir / "config.toml").read_text()
    for path in [*(run_dir / "checkpoints").iterdir(), run_dir / "metrics.jsonl"]:
        path.unlink()
    shutil.rmtree(run_dir / "tensorboard")
    (run_dir / "checkpoints" / ".step_000000.pt.tmp").write_bytes(b"half a checkpoint")
    (run_dir / "config.toml").write_text(config_text.replace("max_steps = 0", "max_steps = 5"))
    status, output, error = run_in_process(arguments, capsys)
    assert status == 0, error
    assert "resuming" not in output and (run_dir / "checkpoints" / "latest.pt").is_file()


@pytest.mark.parametrize(
    "name, kind",
    [("tensorboard", "file"), ("checkpoints", "file"), ("run.lock", "folder"), ("checkpoints/latest.pt", "folder")],
)
def test_a_name_of_the_run_directory_of_the_wrong_kind_is_one_line(tmp_path, corpus, capsys, name, kind):
    """Before: a file `tensorboard` was a 36-line traceback, a folder `run.lock` a line about free space, a file
    `checkpoints` "File exists" at the first save, a folder `latest.pt` a run that trained and then failed at
    its final save. Now one line naming the path, exit 2, before anything is written."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    path = run_dir / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.mkdir() if kind == "folder" else path.write_text("")
    before = sorted(str(each) for each in run_dir.rglob("*")), snapshot(run_dir)
    status, output, error = run_in_process(arguments + ["run.max_steps=1"], capsys)
    assert status == 2 and error.count("\n") == 1, error
    assert error.startswith(f"error: {path} is a {kind}, where this program keeps "), error
    assert (sorted(str(each) for each in run_dir.rglob("*")), snapshot(run_dir)) == before
    assert "resuming" not in output


def test_a_home_directory_out_dir_is_expanded(tmp_path, corpus, capsys, monkeypatch):
    """out_dir = "~/runs" in a TOML file (no shell expands it there): before, a folder named "~" in the
    current directory, while the header printed ~/runs. Now the home directory, as the header says."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    config_file = tmp_path / "run.toml"
    config_file.write_text('[run]\nout_dir = "~/runs"\n')
    arguments = ["--config", str(config_file)] + [
        setting for setting in tiny_settings(tmp_path, corpus, **{"run.max_steps": 0}) if "out_dir" not in setting
    ]
    status, output, error = run_in_process(arguments, capsys)
    assert status == 0, error
    assert (tmp_path / "home" / "runs" / "default" / "checkpoints" / "latest.pt").is_file()
    assert not (tmp_path / "~").exists()
    assert f"run directory {tmp_path / 'home' / 'runs' / 'default'};" in output


def test_config_toml_is_written_whole_or_not_at_all(tmp_path):
    """A write that fails half-way (here: text that cannot be encoded) leaves the previous file as it was
    and no temporary file; before, config.toml was left empty."""
    path = tmp_path / "config.toml"
    write_text_atomically(path, "max_steps = 1\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(path, "name = " + os.fsdecode(b"\xff") + "\n")
    assert path.read_text() == "max_steps = 1\n" and sorted(os.listdir(tmp_path)) == ["config.toml"]


def test_the_lock_refuses_a_second_holder_naming_the_first_and_is_free_once_released(tmp_path):
    """flock locks belong to an open file: two RunLocks in one process exclude each other like two jobs."""
    first, second = RunLock(tmp_path / "run"), RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunDirectoryBusy, match=f"host {socket.gethostname()}, pid {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()  # free again: the lock file stays, nobody holds it
    second.release()


def test_a_run_refused_after_taking_the_lock_leaves_no_folder_behind(tmp_path, corpus, capsys):
    """The lock is taken before the checkpoint is read; a checkpoint refused then leaves the disk as it was:
    here a fresh directory whose only content would be the lock file."""
    lock = RunLock(tmp_path / "runs" / "default")
    lock.acquire()
    lock.release(undo=True)
    assert not (tmp_path / "runs").exists()


def test_a_file_system_without_flock_warns_and_the_run_goes_on_unlocked(tmp_path, capsys, monkeypatch):
    """Lustre without its flock mount option refuses the call (ENOLCK here): one warning, the run keeps its
    lock file open without a lock, and a refusal still removes what it created; any other error is raised."""

    def no_flock(descriptor, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_dir_module.fcntl, "flock", no_flock)
    lock = RunLock(tmp_path / "runs" / "default")
    lock.acquire()
    assert "does not support flock" in capsys.readouterr().err and lock.descriptor is not None
    lock.release(undo=True)
    assert not (tmp_path / "runs").exists()
    monkeypatch.setattr(run_dir_module.fcntl, "flock", lambda descriptor, operation: os.close(-1))  # EBADF
    with pytest.raises(OSError) as raised:
        RunLock(tmp_path / "runs" / "default").acquire()
    assert raised.value.errno == errno.EBADF


def test_a_refused_jobs_clean_up_never_removes_the_lock_another_job_holds(tmp_path, corpus, capsys, monkeypatch):
    """The race, made certain: job B creates run.lock, takes the lock, and is refused (the folder already
    holds a run's metrics.jsonl); job C opened run.lock while B held it and locks it just after B's clean-up
    removed it. Before, C then held a lock on a file nobody could find, and a third job D created a fresh
    run.lock, locked it and went on beside C. Now B removes the file while still holding the lock, C finds
    the path no longer names its file and locks the new one, and D is refused naming C."""
    run_dir = tmp_path / "runs" / "default"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")  # B and D are refused on this, after taking the lock
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    opened, b_done = threading.Event(), threading.Event()
    real_flock, real_find_resume_point = run_dir_module.fcntl.flock, train.find_resume_point
    job_c = RunLock(run_dir)

    def flock_once_b_is_done(descriptor, operation):  # C's flock waits until B has cleaned up
        if threading.current_thread() is c_thread:
            opened.set()
            b_done.wait(30)
        return real_flock(descriptor, operation)

    def c_opens_while_b_holds_the_lock(*args, **kwargs):
        c_thread.start()
        assert opened.wait(30)
        return real_find_resume_point(*args, **kwargs)

    c_thread = threading.Thread(target=job_c.acquire)
    monkeypatch.setattr(run_dir_module.fcntl, "flock", flock_once_b_is_done)
    monkeypatch.setattr(train, "find_resume_point", c_opens_while_b_holds_the_lock)
    status, _, error = run_in_process(arguments, capsys)  # job B
    b_done.set()
    c_thread.join(30)
    assert status == 2 and "already holds a run" in error, error
    monkeypatch.setattr(train, "find_resume_point", real_find_resume_point)
    try:
        assert job_c.descriptor is not None  # C holds the lock...
        status, _, error = run_in_process(arguments, capsys)  # job D
        assert status == 2 and "is in use by another training job" in error, error  # ...on the file D finds
    finally:
        job_c.release()


def test_a_run_refused_after_taking_the_lock_removes_the_lock_file_it_created(tmp_path, corpus, capsys, monkeypatch):
    """A run directory without run.lock (copied from another machine, or of an older version), whose
    optimizer state then fails to load (train.py's refusal after the rank set-up, exit 2): the lock file this
    job created went only on the refusals before it; now on every exit 2, and what was there stays."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    (run_dir / LOCK_FILE).unlink()
    before = snapshot(run_dir)

    def does_not_fit(optimizer, state_dict, sharded=False):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )

    monkeypatch.setattr(restore, "load_optimizer_state", does_not_fit)
    status, _, error = run_in_process(arguments + ["run.max_steps=1"], capsys)
    assert status == 2 and error.count("\n") == 1 and "resume from an older checkpoint" in error, error
    assert not (run_dir / LOCK_FILE).exists() and snapshot(run_dir) == before


def start_train(arguments: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )


@pytest.mark.integration
def test_two_jobs_started_together_one_is_refused_and_a_killed_holder_blocks_nobody(tmp_path, corpus, capsys):
    """Both start at once on one run directory. Before the lock, one resumed the other's step-0 checkpoint,
    rewrote metrics.jsonl under it and lost 500 of its lines. Now one trains, the other exits 2 at once with
    one line naming the holder's host and pid. Then the holder is killed with SIGKILL (no clean-up at all):
    the kernel has released its lock, and the next start resumes."""
    settings = tiny_settings(tmp_path, corpus, **{"run.max_steps": 100_000, "run.sample_bytes": 0})
    jobs = [start_train(settings), start_train(settings)]
    try:
        # A bound for a hang only (a passing run is refused within seconds), wide enough for a test running on
        # the other pytest-xdist worker beside these two jobs on a loaded 2-core machine.
        deadline = time.monotonic() + 240
        while all(job.poll() is None for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.1)
        [refused] = [job for job in jobs if job.poll() is not None]  # one ended; the other trains on
        [holder] = [job for job in jobs if job is not refused]
        _, error = refused.communicate(timeout=10)
        assert refused.returncode == 2, error
        assert error.count("\n") == 1 and "is in use by another training job" in error, error
        assert f"host {socket.gethostname()}, pid {holder.pid}" in error
        run_dir = tmp_path / "runs" / "default"
        metrics = run_dir / "metrics.jsonl"  # opened after the step-0 checkpoint; the first line ends step 1
        while (
            holder.poll() is None and not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert holder.poll() is None, holder.communicate()
    finally:
        for job in jobs:
            if job.poll() is None:
                job.send_signal(signal.SIGKILL)
            job.communicate()
    assert holder.returncode == -signal.SIGKILL
    assert f"pid {holder.pid}" in (run_dir / LOCK_FILE).read_text()  # its line stays; its lock does not
    steps = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)["counters"]["steps"]
    status, output, error = run_in_process(settings + [f"run.max_steps={steps + 1}"], capsys)  # no second start-up
    assert status == 0, error
    assert f"at step {steps}" in output


def test_every_rank_prints_a_start_up_error(tmp_path, corpus, capsys, monkeypatch):
    """Rank 1 finds the same bad setting as rank 0 and prints it too: under torchrun the first rank to exit
    gets the others stopped, and a line left to rank 0 alone was lost in 2 of 9 launches."""
    pretend_launched(monkeypatch, world_size=2, rank=1)  # the config is refused before any connection
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"optim.lr": -1}), capsys)
    assert status == 2 and error.startswith("error: optim.lr: ") and error.count("\n") == 1, error


@pytest.mark.integration
def test_the_error_line_survives_torchrun_when_rank_0_starts_last(tmp_path, corpus):
    """The race made certain: rank 0 sleeps 30 s before it starts, so rank 1 finds the bad setting first and
    exits 2, and torchrun's agent stops rank 0 before it has read its config. The line is still there,
    printed by rank 1 (when rank 0 alone printed it, this launch never showed it)."""
    arguments = tiny_settings(tmp_path, corpus, **{"optim.lr": -1})
    faults = [{"attempt": 0, "rank": 0, "sleep_before_start": 30}]
    fault_log = tmp_path / "faults.jsonl"
    launched = start_torchrun(
        ["--standalone", "--nproc_per_node=2"], ["-m", "tests.faulty_train"], arguments, faults, fault_log
    )
    status, output = finish(launched, time.monotonic() + 180)
    assert status != 0  # rank 0 was stopped asleep, or even before it got there
    assert "error: optim.lr: expected" in output, output[-3000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.race
def test_the_error_line_survives_torchrun_in_20_launches_of_20(tmp_path, corpus):
    """The race as it happens: 20 torchrun launches of 2 ranks with optim.lr = -1, each failing at once;
    stderr must hold the error line every time (before, 2 of 9 launches had only torchrun's
    ChildFailedError). About 11 s a launch here, so not in the default run: python -m pytest -m race."""
    arguments = tiny_settings(tmp_path, corpus, **{"optim.lr": -1})
    with_line = 0
    for _ in range(20):
        completed = run_train(arguments, ranks=2, timeout_s=60)
        assert completed.returncode != 0
        with_line += "error: optim.lr: expected" in completed.stderr
    assert with_line == 20
    assert not (tmp_path / "runs").exists()


def test_a_full_disk_at_the_start_is_one_line(tmp_path, corpus, capsys):
    """The run directory, its lock file and config.toml on a disk with no space left: one line, no traceback
    (writing the lock's holder line raised an OSError traceback before config.toml could say it)."""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        fill_disk(disk, leave_free_bytes=0)
        status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"run.out_dir": disk / "runs"}), capsys)
    # tmpfs creates the folder and the empty lock file without a data page; the lock's holder line and then
    # config.toml need one: the first is skipped, the second is the run's one line (exit 1, a machine fault).
    assert status == 1 and error.count("\n") == 1, error
    assert "config.toml could not be written: the disk is full" in error


def processes_naming(text: str) -> list[int]:
    """The pids whose command line holds `text` (here: a run's unique out_dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            pass  # ended while we looked
    return pids


@pytest.mark.integration
def test_workers_orphaned_by_killing_the_agents_group_keep_the_run_directory_locked(tmp_path, corpus):
    """torchrun starts its workers in sessions of their own, so SIGKILL to the agent's process group (what a
    terminal's job control or a naive `kill -9 -PGID` does) leaves both ranks training. While they live, rank 0
    still holds run.lock, so a second launch on the same run directory is refused, naming rank 0's pid: it
    cannot write beside them. docs/faults.md says how to stop a job without orphaning its workers."""
    out_dir = tmp_path / "orphans"
    arguments = tiny_settings(tmp_path, corpus, **{"run.out_dir": out_dir, "run.max_steps": 10_000})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [*launcher, *arguments], cwd=REPO, env=environment, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = out_dir / "default" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and agent.poll() is None, "the 2-rank run did not start training"
            time.sleep(0.5)
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        workers = [pid for pid in processes_naming(str(out_dir)) if pid != agent.pid]
        assert len(workers) == 2, workers  # both ranks outlived their agent
        lines_before = metrics.read_text().count("\n")
        second = run_train(arguments, timeout_s=120)
        assert second.returncode == 2
        assert "is in use by another training job" in second.stderr and "pid" in second.stderr, second.stderr
        assert metrics.read_text().count("\n") >= lines_before  # the second launch wrote nothing over them
    finally:
        for pid in processes_naming(str(out_dir)):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ A refusal after the run lock is taken


def every_path(folder) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None), run.lock included: what a refused run must leave as it was."""
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.is_file() else None
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("refusal", ["another run's setting", "a damaged metrics line"])
def test_a_resume_refused_after_taking_the_lock_leaves_the_run_directory_as_it_was(tmp_path, capsys, refusal):
    """A finished run's folder without run.lock (copied from another machine): the resume takes the lock (creating
    run.lock), then finds the checkpoint of another run, or metrics.jsonl damaged, and refuses. One line, exit 2,
    and the folder exactly as before: no run.lock left by the refused job."""
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 1, "run.sample_bytes": 0})
    assert train.main(arguments) == 0
    run_dir = tmp_path / "runs" / "default"
    (run_dir / LOCK_FILE).unlink()
    if refusal == "a damaged metrics line":
        (run_dir / "metrics.jsonl").write_text('{"steps": 1}\nnot json\n')
        named = "metrics.jsonl line 2 is not JSON"
    else:
        arguments.append("optim.lr=0.5")
        named = "belongs to a different run"
    before = every_path(run_dir)
    capsys.readouterr()
    assert train.main(arguments + ["run.max_steps=2"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and named in error, error
    assert every_path(run_dir) == before


# ------------------------------------------------------------------ The run directory deleted mid-run

# A loss that deletes the run directory on its 41st call (the step-0 probe's 6, then 4 micro-batches a step:
# during step 9), as a person cleaning up the wrong folder would.
DELETES_THE_RUN = """
import shutil

from accumulation.config.registry import register_loss
from accumulation.step import token_cross_entropy_sum

calls = []


def deleting_sum(outputs, labels):
    calls.append(1)
    if len(calls) == 41:
        shutil.rmtree({run_dir!r})
    return token_cross_entropy_sum(outputs, labels)


register_loss("deleting", deleting_sum)
"""


def test_a_run_directory_deleted_mid_run_is_not_said_to_hold_the_metrics(tmp_path, capsys, monkeypatch):
    """TensorBoard's next write fails (its files are gone); the line said "metrics.jsonl holds every step up to
    here" although metrics.jsonl was deleted with them. Now it says the file is gone."""
    run_dir = tmp_path / "runs" / "default"
    (tmp_path / "deleting_fork.py").write_text(DELETES_THE_RUN.format(run_dir=str(run_dir)))
    monkeypatch.syspath_prepend(str(tmp_path))
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"model.objective": "deleting_fork:deleting", "run.max_steps": 20, "run.checkpoint_every": 2}
    try:
        status = train.main(tiny_settings(tmp_path, corpus, **settings, **{"run.sample_bytes": 0}))
    finally:
        sys.modules.pop("deleting_fork", None)
    error = capsys.readouterr().err
    assert status != 0 and error.count("\n") == 1, error
    assert error.startswith(f"error: TensorBoard events in {run_dir / 'tensorboard'} could not be written"), error
    assert f"{run_dir / 'metrics.jsonl'} is gone too" in error and "holds every step" not in error, error
