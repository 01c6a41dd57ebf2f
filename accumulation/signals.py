"""Preemption and Ctrl-C: SIGTERM, SIGUSR1 or SIGINT asks the run to stop at a step boundary, with a checkpoint.

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
the agent only, which passes one SIGINT to each worker.) A second SIGTERM or SIGUSR1 while the checkpoint is
written changes nothing (the flag is already up); the write is atomic anyway, so even a SIGKILL in the middle
leaves the previous checkpoints whole.
"""

import contextlib
import signal

# 128 + 15: the status a shell reports for a process ended by SIGTERM. Not 0, because the run is not
# finished: torchrun with --max-restarts counts a non-zero worker as failed and restarts the workers, which
# resume from the checkpoint just written; a script that runs `train.py && next-step` does not go on; and
# SLURM keeps the job's state honest (a requeue resumes it). Not 1 or 2, which mean a fault or bad input.
STOPPED_BY_SIGNAL_STATUS = 143
# 128 + 2: what a shell reports for a program ended by Ctrl-C, and what it expects of one that stops on it.
INTERRUPTED_STATUS = 130

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """The flag a stop signal raises. Inside `with stop.installed():` SIGTERM, SIGUSR1 and SIGINT set it instead
    of ending the process; `signal_name` says which signal came first, and `exit_status` what to exit with."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    @contextlib.contextmanager
    def installed(self):
        """SIGTERM, SIGUSR1 and SIGINT raise the flag inside the block; their previous handlers come back after it."""
        previous = {stop_signal: signal.signal(stop_signal, self._handle) for stop_signal in STOP_SIGNALS}
        try:
            yield self
        finally:
            for stop_signal, handler in previous.items():
                signal.signal(stop_signal, handler)

    def _handle(self, signum: int, frame) -> None:
        # A signal handler runs between two bytecodes of the main thread, wherever it is: no I/O, no
        # collective, nothing that could interleave with the code it interrupts. A flag only.
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process at once

    @property
    def exit_status(self) -> int:
        """130 when Ctrl-C came first, else 143 (SIGTERM, SIGUSR1, or a stop another rank asked for)."""
        return INTERRUPTED_STATUS if self.signal_name == "SIGINT" else STOPPED_BY_SIGNAL_STATUS
