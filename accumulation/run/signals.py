"""Preemption, Ctrl-C and a closed terminal: SIGTERM, SIGUSR1, SIGINT or SIGHUP asks the run to stop at a step
boundary, with a checkpoint (docs/faults.md, "Stop signals": what schedulers and torchrun send, and when).

The signal reaches the ranks at different moments, so a rank never acts on it alone: the handler only raises a
flag, the step reads it at its boundary and the answer travels with the step's loss all-reduce
(`optimizer_step(stop_requested=...)`), so that every rank reads the same answer (`StepResult.stop_requested`) at
the same step. Then every rank takes part in one checkpoint and the program exits with the signal's status.

A person who presses Ctrl-C again does not want to wait for the checkpoint: the first SIGINT hands SIGINT back to
the kernel's default action, so a second one ends the process at once, even inside a collective. SIGHUP comes
when the terminal is gone, and a write to it would fail (EIO) before the checkpoint: the handler first points
standard output and error that were that terminal at /dev/null. The checkpoint's write is atomic, so even a
SIGKILL in the middle of it leaves the previous checkpoints whole.
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
