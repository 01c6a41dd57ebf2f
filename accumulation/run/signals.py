"""Preemption, Ctrl-C and a closed terminal: SIGTERM, SIGUSR1, SIGINT or SIGHUP asks the run to stop at a step
boundary, with a checkpoint.

Schedulers announce the end of a job with a signal and kill it some time later: SLURM sends SIGTERM (or,
with `--signal`, SIGUSR1 a chosen number of seconds ahead), Kubernetes and spot instances SIGTERM; under
torchrun the agent passes its own SIGTERM on to every worker and SIGKILLs them `--shutdown-timeout`
seconds later (30 by default; when the agent stops workers because one of them failed, torch 2.13 waits 30 s
whatever that option says). The signal reaches the ranks at different moments, so a rank never acts on
it alone: the handler only raises a flag, the step reads it at its boundary and the answer travels with the
step's loss all-reduce (`optimizer_step(stop_requested=...)`), and every rank reads the same answer
(`StepResult.stop_requested`) at the same step. Then every rank takes part in one checkpoint and the program exits with
STOPPED_BY_SIGNAL_STATUS.

Ctrl-C in a terminal (SIGINT) is the same request from a person: finish the step, checkpoint, exit 130. A
person who presses it again does not want to wait for the checkpoint, so the first SIGINT hands SIGINT back
to the kernel's default action: a second one ends the process at once, even inside a collective that has not
returned to Python. (Under torchrun the workers run in sessions of their own, so the terminal's Ctrl-C reaches
the agent only, which passes one SIGINT to each worker.)

SIGHUP is what a run started from an ssh session gets when the session closes (the terminal hangs up): the
same request, exit 129. Its terminal is gone, so a write to it would fail (EIO) and end the run before its
checkpoint with a traceback nobody reads; the handler points the process's standard output and error that
were that terminal at /dev/null first (a redirected output, `> train.log`, is left alone and keeps the
"stopped at step" line). A second SIGTERM or SIGUSR1 while the checkpoint is
written changes nothing (the flag is already up); the write is atomic anyway, so even a SIGKILL in the middle
leaves the previous checkpoints whole.
"""

import contextlib
import os
import signal
import stat

# 128 + 15: the status a shell reports for a process ended by SIGTERM. Not 0, because the run is not
# finished: torchrun with --max-restarts counts a non-zero worker as failed and restarts the workers, which
# resume from the checkpoint just written; a script that runs `train.py && next-step` does not go on; and
# SLURM keeps the job's state honest (a requeue resumes it). Not 1 or 2, which mean a fault or bad input.
STOPPED_BY_SIGNAL_STATUS = 143
# 128 + 2: what a shell reports for a program ended by Ctrl-C, and what it expects of one that stops on it.
INTERRUPTED_STATUS = 130
# 128 + 1: what a shell reports for a process ended by SIGHUP (its terminal closed).
HUNG_UP_STATUS = 129

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    """The flag a stop signal raises. Inside `with stop.installed():` SIGTERM, SIGUSR1, SIGINT and SIGHUP set it instead
    of ending the process; `signal_name` says which signal came first, and `exit_status` what to exit with."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    @contextlib.contextmanager
    def installed(self):
        """The stop signals raise the flag inside the block; their previous handlers come back after it."""
        previous = {stop_signal: signal.signal(stop_signal, self._handle) for stop_signal in STOP_SIGNALS}
        try:
            yield self
        finally:
            for stop_signal, handler in previous.items():
                signal.signal(stop_signal, handler)

    def _handle(self, signum: int, frame) -> None:
        # A signal handler runs between two bytecodes of the main thread, wherever it is: no I/O, no
        # collective, nothing that could interleave with the code it interrupts. A flag only (and, for
        # SIGHUP, two dup2 system calls, which write nothing).
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process at once
        if signum == signal.SIGHUP:
            detach_from_closed_terminal()

    @property
    def exit_status(self) -> int:
        """130 when Ctrl-C came first, 129 for SIGHUP, else 143 (SIGTERM, SIGUSR1, or a stop another rank asked for)."""
        return {"SIGINT": INTERRUPTED_STATUS, "SIGHUP": HUNG_UP_STATUS}.get(self.signal_name, STOPPED_BY_SIGNAL_STATUS)


def detach_from_closed_terminal() -> None:
    """Point standard output and error at /dev/null where they are a terminal (the one that hung up). A hung-up
    terminal no longer answers isatty (its ioctl fails), so the test is the kind of file: a character device,
    where a redirected output is a regular file or a pipe."""
    null = os.open(os.devnull, os.O_WRONLY)
    for descriptor in (1, 2):
        if stat.S_ISCHR(os.fstat(descriptor).st_mode):
            os.dup2(null, descriptor)
    os.close(null)
