"""Where each step's record goes: every sink `log.sinks` names gets it, on rank 0. Built in: "jsonl" (metrics.jsonl,
one JSON line per step) and "tensorboard" (every numeric field, under tags grouped by unit); "wandb" and "mlflow" in
accumulation/run/external_sinks.py, imported only when named. A fork adds its own with register_sink(name, build)
(accumulation/config/registry.py) and names it "module:name" (docs/training.md, "Logger sinks").

A full disk becomes one WriteError line here, never a traceback."""

import json
import os
import threading
from pathlib import Path
from typing import NamedTuple, Protocol

from accumulation.config.config import Config
from accumulation.config.registry import register_sink
from accumulation.counters import Counters
from accumulation.run.run_dir import METRICS_FILE, WriteError, not_written, os_error_in, why_not_written


class SinkSession(NamedTuple):
    """What a sink is opened with, once per session, on rank 0."""

    config: Config
    run_dir: Path
    counters: Counters  # where this session starts: a resume's checkpoint, or zeros
    resumed: bool  # a resume rewrites the steps after `counters` (a sink that can drop its later points should)
    source_group: str  # the group of the data source's own fields ("rl" for GRPO's rewards; "data" by default)
    # The record of the checkpoint's step as a resume revised it (its last-step validation dropped when the run is
    # extended, logs.py), or None: a sink that can drop points replaces that step's with it.
    revised: dict | None = None


class Sink(Protocol):
    def write(self, record: dict) -> None: ...  # one step's record: the metrics.jsonl line, as a dict

    def flush(self) -> None: ...  # everything written so far on the disk (before each checkpoint)

    def close(self) -> None: ...


# The tag of each field of the step record, grouped by unit: TensorBoard (and W&B, MLflow) show one section per
# group. The six counters go under counters/, a data source's own fields under its group, e.g. rl/mean_reward.
TAGS = {
    "loss": "loss/train",  # nats per supervised target: the step's global mean (the objective's unit, when it has one)
    "val_loss": "loss/validation",  # the validation loss at run.eval_every and at the last step
    "lr": "lr/learning_rate",
    "grad_norm": "gradient/norm_before_clipping",  # L2 norm of the unscaled gradient
    "scale": "gradient/loss_scale",  # the GradScaler's factor (1 when off)
    "tokens_per_s": "throughput/tokens_per_s",  # supervised tokens per second, all ranks
    "mfu": "throughput/mfu",  # model FLOPs utilisation: a fraction of the devices' peak (accumulation/run/mfu.py)
    "time_s": "time/step_seconds",
    "peak_mem_bytes": "memory/peak_bytes",
}
COUNTERS = tuple(vars(Counters()))
# Against supervised tokens: the losses, the curves to compare between runs of different batch sizes.
TOKEN_AXIS_TAGS = {"loss": "loss_by_tokens/train", "val_loss": "loss_by_tokens/validation"}


def is_number(value) -> bool:
    return type(value) in (int, float)  # not bool, not None (a non-finite loss is null), not text


def tagged(record: dict, source_group: str) -> dict[str, float]:
    """Every numeric field of a step record under its tag (TAGS; counters/NAME; SOURCE_GROUP/NAME for the rest)."""
    tags = {}
    for name, value in record.items():
        if is_number(value):
            group_and_name = TAGS.get(name) or (f"counters/{name}" if name in COUNTERS else f"{source_group}/{name}")
            tags[group_and_name] = value
    return tags


# ---------------------------------------------------------------------------------------------------------------
# jsonl: metrics.jsonl
# ---------------------------------------------------------------------------------------------------------------


class MetricsFile:
    """metrics.jsonl opened for appending whole lines: a line is on disk whole or not at all, so the file
    never holds a half line that a resume would keep, even when the disk fills in the middle of one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        size_before = os.fstat(self.descriptor).st_size
        remaining = memoryview((json.dumps(record) + "\n").encode())
        try:
            while remaining:  # a full disk takes part of a write, then refuses the rest
                remaining = remaining[os.write(self.descriptor, remaining) :]
        except OSError as error:
            os.ftruncate(self.descriptor, size_before)  # shrinking needs no space: the partial line goes
            raise WriteError(
                f"{not_written(error, self.path)}; its last line was not written and the lines before are untouched"
            ) from None

    def flush(self) -> None:
        os.fsync(self.descriptor)  # each line is in the operating system's hands already; this survives power loss

    def close(self) -> None:
        os.close(self.descriptor)


def open_metrics_file(session: SinkSession) -> MetricsFile:
    return MetricsFile(session.run_dir / METRICS_FILE)  # a resume trimmed it to the checkpoint first (logs.py)


# ---------------------------------------------------------------------------------------------------------------
# tensorboard: two writers, x axis steps (by_steps/) and x axis supervised tokens (by_tokens/)
# ---------------------------------------------------------------------------------------------------------------


def quiet_tensorboard_thread_errors() -> None:
    """Keep the traceback of TensorBoard's writer thread, ended by a failed write, off the terminal: the error is
    raised again at the next add_scalar or flush, where it becomes one line (tensorboard_write_error)."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    print_traceback = threading.excepthook

    def hook(arguments) -> None:
        if not (isinstance(arguments.thread, _AsyncWriterThread) and isinstance(arguments.exc_value, OSError)):
            print_traceback(arguments)

    threading.excepthook = hook


def tensorboard_write_error(error: Exception, writer) -> Exception:
    """A failed event write, raised at TensorBoard's next call, as one WriteError line; anything else is a bug."""
    cause = os_error_in(error)
    if cause is None:
        return error
    # An event file is a sequence of records, each with its length and checksum: a reader stops at a
    # record cut short, and the resume's purge_step drops the points after the checkpoint.
    folder = Path(writer.get_logdir()).parent  # the run's tensorboard/
    metrics_path = folder.parent / METRICS_FILE
    # The run directory deleted under the run takes metrics.jsonl with it (its lines go to a file no name reaches).
    kept = (
        "metrics.jsonl holds every step up to here"
        if metrics_path.exists()
        else f"{metrics_path} is gone too (was the run directory deleted?): this run's metrics are no longer on disk"
    )
    return WriteError(f"TensorBoard events in {folder} could not be written: {why_not_written(cause, folder)}; {kept}")


class TensorBoardEvents:
    """Every numeric field against steps (tensorboard/by_steps/, tags as `tagged` names them), and the losses against
    supervised tokens (tensorboard/by_tokens/, tags loss_by_tokens/...). On resume each writer purges the events
    beyond the checkpoint's position on its own axis: the steps run again write them anew."""

    def __init__(self, session: SinkSession) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: only rank 0 writes TensorBoard files

        quiet_tensorboard_thread_errors()
        folder, counters, resumed = session.run_dir / "tensorboard", session.counters, session.resumed
        self.source_group = session.source_group
        after = 1 if session.revised is None else 0  # a revised record: its own step's points go too, then come back
        self.by_steps = SummaryWriter(folder / "by_steps", purge_step=counters.steps + after if resumed else None)
        self.by_tokens = SummaryWriter(folder / "by_tokens", purge_step=counters.tokens + after if resumed else None)
        if session.revised is not None:
            self.write(session.revised)

    def write(self, record: dict) -> None:
        try:
            for tag, value in tagged(record, self.source_group).items():
                self.by_steps.add_scalar(tag, value, record["steps"])
            for name, tag in TOKEN_AXIS_TAGS.items():
                if is_number(record.get(name)):
                    self.by_tokens.add_scalar(tag, record[name], record["tokens"])
        except Exception as error:
            raise tensorboard_write_error(error, self.by_steps) from None

    def flush(self) -> None:
        """TensorBoard buffers for up to 2 minutes: flushed before each checkpoint."""
        try:
            self.by_steps.flush()
            self.by_tokens.flush()
        except Exception as error:
            raise tensorboard_write_error(error, self.by_steps) from None

    def close(self) -> None:
        self.flush()
        self.by_steps.close()
        self.by_tokens.close()


register_sink("jsonl", open_metrics_file)
register_sink("tensorboard", TensorBoardEvents)
