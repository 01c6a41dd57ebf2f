"""How a training job starts and ends: train.py's main hands its two halves to run_job, which holds the failure
policy (docs/faults.md). Bad input is one line on stderr and exit status 2 with nothing left behind; a run that
fails once its run directory is its own ends at once with one line (or a bug's traceback) and status 1 or 2; a stop
signal finishes the step, checkpoints and exits 130, 129 or 143 (accumulation/run/signals.py)."""

import errno
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from accumulation.config.config import Config, ConfigError
from accumulation.data.rows import DataError
from accumulation.data.splits import Data
from accumulation.parallel.distributed import LaunchError, launch_environment, setup_distributed, teardown_distributed
from accumulation.probe import InexactStep
from accumulation.run.checkpoint import CheckpointError
from accumulation.run.restore import check_ranks_agree_on_resume, resume_checked_together
from accumulation.run.run_dir import RunDirectoryError, RunLock, WriteError
from accumulation.run.signals import StopRequest, detach_from_closed_terminal
from accumulation.run.stops import all_steps_done

# Bad input: a launch environment, config, data, checkpoint or run directory a user can fix.
BAD_INPUT_STATUS = 2
# A fault of the machine, not bad input (2): torchrun --max-restarts retries it, and each retry resumes from
# the newest complete checkpoint, so freeing space while it retries loses nothing.
WRITE_ERROR_STATUS = 1


class Job:
    """This process's place in the launch (rank, world_size), what it prints, and rank 0's hold on the run directory
    (accumulation/run/run_dir.py's RunLock), kept for the job's whole life."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.lock: RunLock | None = None

    def say(self, *args, **kwargs) -> None:
        if self.rank != 0:  # only rank 0 prints progress and warnings
            return
        try:
            print(*args, **kwargs)
        except OSError as error:
            # A terminal that hung up fails writes (EIO) from the moment it closes, and its SIGHUP may reach the
            # handler (which detaches from it) only after this write: detach here; the line is lost with the
            # terminal, and the SIGHUP stops the run at the step's end as usual.
            if error.errno != errno.EIO:
                raise
            detach_from_closed_terminal()

    def warn(self, *args) -> None:
        self.say(*args, file=sys.stderr)

    def hold(self, run_dir: Path) -> None:
        """Rank 0 locks the run directory, before reading it: what a resume finds there stays this job's alone."""
        if self.rank == 0:
            self.lock = RunLock(run_dir)
            self.lock.acquire()

    def release(self, undo: bool) -> None:
        """Unlock; with `undo` (a refused run) the folder and lock file the lock created go too."""
        if self.lock is not None:
            self.lock.release(undo=undo)


class Prepared(NamedTuple):
    """What train.py's prepare read and checked before anything is written."""

    config: Config
    data: Data
    vocab_size: int
    run_dir: Path
    resume: dict | None  # the checkpoint to continue from, or None for a fresh run
    # The newest checkpoint at most a given step, its shard files left for the ranks to check together (as resume's)
    find_older: Callable[[int], dict | None]


def run_job(argv: list[str], prepare: Callable[[list[str], Job], Prepared], train: Callable[..., int]) -> int:
    """prepare(argv, job), then train(config, data, vocab_size, run_dir, resume, context, say, stop) once the ranks
    have joined; the exit status of the two, each way they can fail turned into its line and status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C from here on raises KeyboardInterrupt: 130
    # Everything a user can get wrong is checked before anything is written. Every rank finds the same error and
    # every rank prints it: under torchrun the first rank to exit gets the others stopped, and a line left to
    # rank 0 alone could die with it.
    job = None
    try:
        job = Job(*launch_environment())
        prepared = prepare(argv, job)
    except (LaunchError, ConfigError, DataError, CheckpointError, RunDirectoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        if job is not None:
            job.release(undo=True)  # a refused run leaves no folder or lock file it created
        return BAD_INPUT_STATUS
    status = 1  # if training raises
    try:
        status = train_in_run_directory(prepared, train, job)
        return status
    finally:
        job.release(undo=status == BAD_INPUT_STATUS)  # bad input (ranks that disagree): the lock file it created goes


def train_in_run_directory(prepared: Prepared, train: Callable[..., int], job: Job) -> int:
    """run_job's second half, once the run directory is this job's: join the ranks, train, and turn each way a run
    can fail into its line and exit status."""
    # Fail fast: a rank that raises says why and returns its status WITHOUT tearing down the process group.
    # run_and_exit then ends the process at once; the other ranks' next collective fails (gloo) or torchrun's
    # agent, which sees a worker gone, stops them (NCCL: they would otherwise wait for its watchdog, and a
    # rank tearing down while the others wait in a collective can hang itself). Only a clean return, which
    # every rank reaches together, destroys the process group.
    config, run_dir, resume = prepared.config, prepared.run_dir, prepared.resume
    if all_steps_done(config, resume, job.say):  # a finished run started again: one line, exit 0, nothing built
        return 0
    stop = StopRequest()
    try:
        with stop.installed():  # SIGTERM, SIGUSR1, Ctrl-C, SIGHUP: finish the step, checkpoint, exit
            context = setup_distributed(config.device, config.dist.timeout_s, config.dist.pipeline_stages)
            if context.world_size > 1:  # each rank read its config and data, and looked for the checkpoint, itself
                from accumulation.parallel.torchrun import check_ranks_agree

                check_ranks_agree(config, prepared.data.summary.fingerprint)
                check_ranks_agree_on_resume(context, resume, run_dir)
                resume = resume_checked_together(resume, prepared.find_older, job.warn)  # each rank its share
            status = train(config, prepared.data, prepared.vocab_size, run_dir, resume, context, job.say, stop)
    except (ConfigError, CheckpointError, InexactStep, DataError, WriteError, RuntimeError) as error:
        # Bad input found now (exit 2), a full disk (1), out of memory (2), a lost rank (1) or a bug (its traceback)
        return exit_status_after(error, config, job.rank, job.world_size)
    teardown_distributed()
    return status


def exit_status_after(error: Exception, config: Config, rank: int, world_size: int) -> int:
    """Print the line for `error` (or a bug's traceback) on stderr and return the exit status. Called inside the
    `except` that caught it: a WriteError, bad input found mid-run (a ValueError), or a RuntimeError."""
    if isinstance(error, WriteError):  # a full disk: the rank that wrote says so (the others lose it just after)
        print(f"error: {error}", file=sys.stderr)
        return WRITE_ERROR_STATUS
    if not isinstance(error, RuntimeError):
        # Bad input found now: ranks that disagree or state dicts that do not load (every rank says so), the step-0
        # probe (a mean loss, or coupled rows with batch.on_inexact=error), a row read mid-run holding an id beyond
        # the vocabulary or not the promised N (the rank that read it says so; the others lose it).
        print(f"error: {error}", file=sys.stderr)
        return BAD_INPUT_STATUS
    # Out of memory: torch.OutOfMemoryError on CUDA, a plain RuntimeError from the CPU allocator.
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
        print(
            f"error: out of memory at batch.micro_batch_size={config.batch.micro_batch_size} "
            f"({str(error).strip().splitlines()[0]}); lower batch.micro_batch_size (A grows, the global batch "
            f'and its update stay the same), or on CUDA set batch.on_oom="shrink"',
            file=sys.stderr,
        )
        return BAD_INPUT_STATUS
    message = None  # torch.distributed's errors are RuntimeErrors too
    if world_size > 1:  # a launch under torchrun: was a rank lost?
        from accumulation.parallel.torchrun import lost_rank_message

        message = lost_rank_message(error, rank, config.dist.timeout_s)
    if message is None:
        traceback.print_exc()  # not a lost rank but a bug: its traceback is the useful message
        return 1
    print(message, file=sys.stderr)  # every rank: each one's view helps to find the rank that failed first
    return 1
