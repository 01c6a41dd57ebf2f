"""Why and how a run stops before its last step: a non-finite step (optim.on_nonfinite, optim.max_consecutive_skips),
or a stop signal (accumulation/run/signals.py). Either way train.py has written the step's checkpoint first."""

import math
import sys
from pathlib import Path

from accumulation.config.config import Config
from accumulation.counters import Counters
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.checkpoint import check_weights_finite
from accumulation.run.run_dir import STOPPED_FILE
from accumulation.run.signals import StopRequest
from accumulation.step import StepResult


def nonfinite_stop_reason(config: Config, result: StepResult, training, skips_in_a_row: int) -> str | None:
    """Why the run must stop after this step, or None: optim.max_consecutive_skips skips in a row, or, under
    optim.on_nonfinite = "stop", a non-finite loss, or a non-finite gradient unless a GradScaler skips it.
    Non-finite weights stop the run under either setting: found after the non-finite step they cause, or before a
    checkpoint (check_weights_finite), they are never written."""
    scaler = training.setup.scaler
    if not result.applied or not math.isfinite(result.loss):  # the same outcome on every rank: a collective is safe
        check_weights_finite(config, training.model, training.optimizer)
    if skips_in_a_row >= config.optim.max_consecutive_skips:
        limit = config.optim.max_consecutive_skips
        return f"{skips_in_a_row} skipped updates in a row (optim.max_consecutive_skips={limit})"
    if config.optim.on_nonfinite == "stop" and result.tokens > 0:
        if not math.isfinite(result.loss):
            return f"non-finite loss {result.loss} (optim.on_nonfinite=stop)"
        if not result.applied and not scaler.is_enabled():
            return f"{result.skip_reason} (optim.on_nonfinite=stop)"
    return None


def all_steps_done(config: Config, resume: dict | None, say) -> bool:
    """Whether the checkpoint found holds all run.max_steps steps (a finished run started again): then one line
    says so and the program exits 0 without building or training anything."""
    if resume is None or resume["counters"]["steps"] < config.run.max_steps:
        return False
    say(
        f"run.name={config.run.name!r} already finished: its checkpoint holds step {config.run.max_steps} of "
        f"run.max_steps={config.run.max_steps}, so there is nothing to train; raise run.max_steps to go on, or "
        f"choose another run.name for a new run"
    )
    return True


def stopped_at_a_bad_step(counters: Counters, reason: str, run_dir: Path, context: DistributedContext, say) -> int:
    """Exit status 1 after a non-finite step; the checkpoint holds the last good weights (a skipped update left
    them), and the STOPPED file makes a restart refuse to resume past this step until a person removes it."""
    if context.is_main:
        (run_dir / STOPPED_FILE).write_text(f"stopped at step {counters.steps}: {reason}\n")
    say(f"error: stopping at step {counters.steps}: {reason}; checkpoint written", file=sys.stderr)
    return 1


def stopped_by_a_signal(counters: Counters, stop: StopRequest, say) -> int:
    """A stop signal on any rank (the step's all-reduce told every rank at the same step): the checkpoint is
    written, and a restart loses nothing."""
    received = f"{stop.signal_name} received" if stop.requested else "another rank got a stop signal"
    say(
        f"stopped at step {counters.steps}: {received}; checkpoint written; exit status "
        f"{stop.exit_status}; starting again (a requeued job, torchrun --max-restarts) resumes it",
        file=sys.stderr,
    )
    return stop.exit_status
