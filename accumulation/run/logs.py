"""The run's logs, written by rank 0: each step's record to the sinks log.sinks names (metrics.jsonl and TensorBoard
by default: accumulation/run/sinks.py; metrics.jsonl read back and cut to the checkpoint's step on resume), and the
terminal's lines (progress, the session's summary, its speed)."""

import json
import math
import resource
import time
from pathlib import Path

import torch

from accumulation.batching import describe_batch
from accumulation.config.config import Config, config_to_toml
from accumulation.config.registry import lookup
from accumulation.counters import Counters
from accumulation.data.rows import row_hooks
from accumulation.data.sources import rows_dropped_per_epoch
from accumulation.data.splits import Data
from accumulation.models.factory import model_description
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.run_dir import (
    RunDirectoryError,
    WriteError,
    not_written,
    why_not_written,
    write_text_atomically,
)
from accumulation.run.sample import print_sample
from accumulation.run.sinks import SinkSession

# The summary reports these first steps' speed apart: the first compiles and allocates, the second rebuilds DDP's
# gradient buckets and may compile again for new shapes.
WARMUP_STEPS = 2


# metrics.jsonl as a resume finds it: read and checked line by line (restore.py), then cut back to the
# checkpoint's step (RunLogs.begin, when the run directory already holds a metrics file).


def metrics_lines(metrics_path: Path) -> list[tuple[int, str]]:
    """(step, line) for each complete line of an existing metrics.jsonl, read before a resume rewrites it.
    A last line without its newline was cut short by a process killed while writing it: not a record, left
    out. Any other line that is not a JSON object with an integer "steps" is damage a person must look at:
    RunDirectoryError naming the line."""
    if not metrics_path.exists():
        return []
    try:
        text = metrics_path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise RunDirectoryError(f"{metrics_path} cannot be read ({error}); fix or delete the file") from None
    found, previous_number = [], None  # previous_number: the line of found[-1]
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if not line.endswith("\n") or not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            record = error
        if not isinstance(record, dict) or type(record.get("steps")) is not int:
            problem = f"not JSON ({record})" if isinstance(record, ValueError) else 'not an object with "steps"'
            raise RunDirectoryError(
                f"{metrics_path} line {number} is {problem}; the resume keeps the lines up to the checkpoint and "
                f"cannot tell which step this one is: repair or delete that line (or move the file away to start "
                f"the metrics afresh), then start again"
            )
        if found and record["steps"] <= found[-1][0]:  # one line per step, in order: a repeat would survive
            raise RunDirectoryError(
                f"{metrics_path} line {number} is of step {record['steps']}, after line {previous_number} of step "
                f"{found[-1][0]}; the file holds one line per step, in order: repair or delete that line (or move the "
                f"file away to start the metrics afresh), then start again"
            )
        found.append((record["steps"], line))
        previous_number = number
    return found


def keep_metrics_up_to(metrics_path: Path, steps: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint (they will be run again), so the file
    holds exactly one line per step. Rewritten atomically: the old file stays whole until the rename."""
    kept = [line for step, line in metrics_lines(metrics_path) if step <= steps]
    try:
        write_text_atomically(metrics_path, "".join(kept))
    except OSError as error:
        raise WriteError(
            f"{metrics_path} could not be rewritten for the resume: {why_not_written(error, metrics_path.parent)}; "
            f"the file is unchanged"
        ) from None


def drop_last_step_validation(metrics_path: Path, steps: int, eval_every: int) -> dict | None:
    """A run extended past its old run.max_steps, resumed from the checkpoint of its old last step: that step's line
    holds a val_loss only because it was the last (train.py validates the last step). Off the run.eval_every cadence
    it goes, so that the extended run's lines are an uninterrupted run's. Returns the revised record (the sinks
    write it again), or None when the line is left as it was."""
    lines = metrics_lines(metrics_path)
    if not lines or lines[-1][0] != steps or (eval_every > 0 and steps % eval_every == 0):
        return None
    record = json.loads(lines[-1][1])
    if "val_loss" not in record:
        return None
    del record["val_loss"]
    try:
        write_text_atomically(metrics_path, "".join(line for _, line in lines[:-1]) + json.dumps(record) + "\n")
    except OSError as error:
        raise WriteError(
            f"{metrics_path} could not be rewritten for the resume: {why_not_written(error, metrics_path.parent)}; "
            f"the file is unchanged"
        ) from None
    return record


def rate_text(count: float, seconds: float, targets: str) -> str:
    """A rate in thousands ("12.3k"); other targets than tokens (images) plainly below a thousand ("87.5")."""
    rate = count / seconds
    return f"{rate:.1f}" if targets != "tokens" and rate < 1e3 else f"{rate / 1e3:.1f}k"


def speed_line(session_steps: list[tuple[int, float]], wall_seconds: float, targets: str = "tokens") -> str:
    """Supervised tokens per second (all ranks) after the session's first WARMUP_STEPS, whose time is reported
    apart; `session_steps` holds (supervised tokens, seconds) per step."""
    total_seconds = sum(seconds for _, seconds in session_steps)
    tail = f"{total_seconds:.1f} s in optimizer steps of {wall_seconds:.1f} s wall time (this session, after start-up)"
    if len(session_steps) <= WARMUP_STEPS:
        tokens = sum(tokens for tokens, _ in session_steps)
        return (
            f"speed: {rate_text(tokens, total_seconds, targets)} supervised {targets}/s over all "
            f"{len(session_steps)} steps, warm-up included (too few steps for a steady state); {tail}"
        )
    warmup, steady = session_steps[:WARMUP_STEPS], session_steps[WARMUP_STEPS:]
    steady_tokens = sum(tokens for tokens, _ in steady)
    steady_seconds = sum(seconds for _, seconds in steady)
    warmup_seconds = sum(seconds for _, seconds in warmup)
    return (
        f"speed: {rate_text(steady_tokens, steady_seconds, targets)} supervised {targets}/s in steady state "
        f"({len(steady)} steps, {steady_seconds / len(steady):.3f} s per step); the first {WARMUP_STEPS} steps "
        f"(compiling, warm-up) took {warmup_seconds:.1f} s; {tail}"
    )


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak during the step. CPU: the process's peak resident set size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or inf: a non-finite value is written as null."""
    return value if math.isfinite(value) else None


class RunLogs:
    """The run's logs for one session, on every rank (rank 0 writes). The steps' (supervised tokens, seconds) are
    kept for this session (the summary's speed) and since the last progress line (its tokens/s)."""

    def __init__(self, config: Config, data: Data, run_dir: Path, context: DistributedContext, say) -> None:
        self.config, self.data, self.run_dir, self.context, self.say = config, data, run_dir, context, say
        self.metrics_path = run_dir / "metrics.jsonl"
        self.sinks = []  # opened by open(), after the step-0 checkpoint
        self.revised = None  # the checkpoint's step's record when a resume revised it (begin), for the sinks
        self.session_steps, self.window = [], []
        self.first_loss = self.last_loss = None
        self.flops_per_position = self.peak_tflops = None  # MFU's, set by header() when there is a peak

    def begin(self, counters: Counters) -> None:
        """config.toml written, and the metrics of steps after the checkpoint dropped (a resume runs them again)."""
        if not self.context.is_main:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.run_dir / "config.toml", config_to_toml(self.config))
        except OSError as error:
            raise WriteError(not_written(error, self.run_dir / "config.toml")) from None
        if self.metrics_path.exists():  # left by an earlier session
            keep_metrics_up_to(self.metrics_path, counters.steps)
            if counters.steps < self.config.run.max_steps:  # the run goes on past the step where it ended
                self.revised = drop_last_step_validation(self.metrics_path, counters.steps, self.config.run.eval_every)

    def open(self, counters: Counters, resumed: bool) -> None:
        """The sinks log.sinks names, in its order, rank 0 only (metrics.jsonl and TensorBoard by default)."""
        if not self.context.is_main:
            return
        # a data source's own fields (GRPO's rewards) are grouped under the group it declares
        source_group = row_hooks(self.data.train).log_group if self.data is not None else "data"
        session = SinkSession(self.config, self.run_dir, counters, resumed, source_group, self.revised)
        for name in self.config.log.sinks.split(","):
            self.sinks.append(lookup("sink", name.strip()).build(session))

    def header(self, training, counters: Counters) -> None:
        """The session's first lines: the batch, the model and its precision, the data, the run directory.
        `training` is train.py's Training (the model, model.loss as decided, the scaler, whether compiled)."""
        config, data, context, say = self.config, self.data, self.context, self.say
        stages = config.dist.pipeline_stages
        batch = describe_batch(config.batch.global_batch_size, config.batch.micro_batch_size, context.replicas, stages)
        batch += " examples per update"
        if stages > 1:
            batch += f"; {stages} pipeline stages ({config.dist.pipeline_schedule}), {context.world_size} ranks"
        position = "tokens" if data.summary.targets == "tokens" else "positions"
        per_row = f"{data.train.seq_len} {position} per row; " if data.train.seq_len is not None else ""  # not images
        say(f"accumulation: {batch}; {per_row}device {context.device} ({context.backend or 'single process'})")
        trainable = sum(p.numel() for p in training.model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in training.model.parameters()) - trainable  # requires_grad off: never updated
        say(
            f"model: {model_description(training.model, config.model.name)}; parameters {trainable:,} train, "
            f"{frozen:,} frozen; precision {config.precision.dtype}, "
            f"grad scaler {'on' if training.setup.scaler.is_enabled() else 'off'}; "
            f"loss {training.model_config.loss}; compile {'on' if training.compiled else 'off'}"
        )
        if config.dist.strategy == "fsdp2":
            from accumulation.parallel.fsdp import describe_sharding

            say(describe_sharding(training.model))
        say(data.summary.describe())
        dropped = rows_dropped_per_epoch(data.train.num_rows, config.batch.global_batch_size, config.batch.tail)
        used = f"{dropped} training rows per epoch are not used" if dropped else "every row is used each epoch"
        say(f"batch.tail={config.batch.tail}: {used}")
        say(f"run directory {self.run_dir}; training steps {counters.steps}..{config.run.max_steps}")
        declares_flops = hasattr(training.model, "flops_per_token") and data.train.seq_len is not None
        if declares_flops and (config.log.peak_tflops > 0 or context.device.type == "cuda"):
            from accumulation.run.mfu import run_peak  # MFU: a peak to measure against

            self.peak_tflops, source = run_peak(config, context.device)
            if self.peak_tflops is None:
                say(f"mfu: not computed, {source}")
            else:
                self.flops_per_position = training.model.flops_per_token()
                say(f"mfu: against {self.peak_tflops:g} TFLOPS per device ({source}) x {context.world_size}")

    def step_record(self, counters: Counters, result, step_seconds: float) -> dict:
        """The step's metrics line (CONTRACT's keys), and the step kept for the speeds."""
        self.session_steps.append((result.tokens, step_seconds))
        self.window.append((result.tokens, step_seconds))
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss
        record = {
            **vars(counters),
            "loss": finite_or_none(result.loss),
            "lr": result.lr,
            "grad_norm": finite_or_none(result.grad_norm),
            "scale": result.loss_scale,  # the scale of this step's losses: no extra read of the device
            "tokens_per_s": result.tokens / step_seconds,
            "peak_mem_bytes": peak_memory_bytes(self.context.device),
            "time_s": step_seconds,
        }
        if self.flops_per_position is not None:  # every position of the step's rows runs through the model
            from accumulation.run.mfu import model_flops_utilisation

            positions = result.examples * self.data.train.seq_len
            record["mfu"] = model_flops_utilisation(
                self.flops_per_position, positions, step_seconds, self.peak_tflops, self.context.world_size
            )
        if not result.applied:
            record["skip_reason"] = result.skip_reason
            self.say(f"step {counters.steps}: update skipped: {result.skip_reason}")
        return record

    def write(self, counters: Counters, record: dict) -> None:
        """The metrics line, and the progress line every run.log_every steps and at the last step."""
        if self.context.is_main:
            self.write_metrics(record)
        max_steps = self.config.run.max_steps
        if counters.steps % self.config.run.log_every == 0 or counters.steps == max_steps:
            window_tokens = sum(tokens for tokens, _ in self.window)
            window_seconds = sum(seconds for _, seconds in self.window)
            eta_s = (max_steps - counters.steps) * window_seconds / len(self.window)
            loss = "n/a" if record["loss"] is None else f"{record['loss']:.4f}"
            validation = f" | val {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""
            targets = self.data.summary.targets  # "tokens", or what a custom source's summary names ("images")
            unit = "tok/s" if targets == "tokens" else f"{targets}/s"
            self.say(
                f"step {counters.steps}/{max_steps} | loss {loss}{validation} | lr {record['lr']:.2e} | "
                f"{rate_text(window_tokens, window_seconds, targets)} {unit} | eta {eta_s / 60:.1f} min"
            )
            self.window = []

    def write_metrics(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        """Every record written so far on the disk, in every sink (before each checkpoint)."""
        for sink in self.sinks:
            sink.flush()

    def summary(self, counters: Counters, final_val_loss: float | None, session_start: float, model) -> None:
        """The session's last lines: losses, counters, a sample when the model predicts the next token, the speed."""
        if not self.context.is_main:
            return
        wall_seconds = time.perf_counter() - session_start
        validation = "" if final_val_loss is None else f"; validation loss {final_val_loss:.4f}"
        print(f"done: train loss {self.first_loss:.4f} -> {self.last_loss:.4f} this session{validation}")
        print("counters: " + ", ".join(f"{name} {value:,}" for name, value in vars(counters).items()))
        if self.config.run.sample_bytes > 0:
            print_sample(self.config, model, self.data.train)  # prompted by the first training example
        print(speed_line(self.session_steps, wall_seconds, self.data.summary.targets))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
