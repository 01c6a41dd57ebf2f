"""Preemption, Ctrl-C and a closed terminal: SIGTERM, SIGUSR1, SIGINT or SIGHUP asks the run to stop at a step
boundary, every rank at the same step, with a checkpoint (docs/faults.md, "Stop signals"). Ctrl-C while the program
starts ends it at once with one line. This module imports no torch: train.py installs that handler before torch."""

import contextlib
import os
import signal
import stat

# 128 + 15, what a shell reports for SIGTERM: not 0, the run is not finished (docs/faults.md, "Stop signals").
STOPPED_BY_SIGNAL_STATUS = 143
# 128 + 2: what a shell reports for a program ended by Ctrl-C, and what it expects of one that stops on it.
INTERRUPTED_STATUS = 130
# 128 + 1: what a shell reports for a process ended by SIGHUP (its terminal closed).
HUNG_UP_STATUS = 129

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def interrupted_while_starting(signum: int, frame) -> None:
    """Ctrl-C while torch is imported (seconds, the first thing the program does): one line and exit 130,
    instead of a KeyboardInterrupt traceback from deep inside torch. Nothing has been read or written yet."""
    os.write(2, b"interrupted (Ctrl-C) while starting, before anything was written\n")
    os._exit(INTERRUPTED_STATUS)


class StopRequest:
    """The flag a stop signal raises. Inside `with stop.installed():` SIGTERM, SIGUSR1, SIGINT and SIGHUP set it instead
    of ending the process; `signal_name` says which signal came first, and `exit_status` what to exit with."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    @contextlib.contextmanager
    def installed(self):
        previous = {stop_signal: signal.signal(stop_signal, self._handle) for stop_signal in STOP_SIGNALS}
        try:
            yield self
        finally:
            for stop_signal, handler in previous.items():
                signal.signal(stop_signal, handler)

    def _handle(self, signum: int, frame) -> None:
        # A handler runs between two bytecodes of the main thread, wherever it is: a flag only, no I/O and no
        # collective that could interleave with the code it interrupts (SIGHUP's two dup2 calls write nothing).
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
    """Point standard output and error at /dev/null where they are a terminal (the one that hung up): a character
    device, since a hung-up terminal fails isatty's ioctl, and a redirected output is a regular file or a pipe."""
    null = os.open(os.devnull, os.O_WRONLY)
    for descriptor in (1, 2):
        if stat.S_ISCHR(os.fstat(descriptor).st_mode):
            os.dup2(null, descriptor)
    os.close(null)
