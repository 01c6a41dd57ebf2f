"""Train a model with exact gradient accumulation, on one process or under torchrun.

    python train.py [--config FILE] [section.key=value ...]
    torchrun --standalone --nproc_per_node=N train.py [--config FILE] [section.key=value ...]

Units: m = batch.micro_batch_size examples per forward/backward per rank, A = accumulation steps (derived),
D = ranks, global batch G = m·A·D examples per optimizer step. A "step" is one optimizer step attempt (one
accumulation group); an "update" is a step whose update was applied. `accumulation/step.py` holds the
maths of one step; this file is the loop around it: set-up, the training section, and diagnostics.

Read top-down: `main` checks everything a user can get wrong; `train` reads as the run's story (build_training,
resume_training, the fenced training section, then Session: checkpoints, logs and the checks after each step);
the helpers follow. The logs themselves (metrics.jsonl, TensorBoard, the printed lines) are accumulation/run/logs.py.
A fork adds a model, a loss or a data source in its own file, registered by name (accumulation/config/registry.py),
and names it in the config; no file here is edited. docs/forking.md walks through it.
"""

# ruff: noqa: E402 (the imports after the first block wait for the Ctrl-C handler below, on purpose)

import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


def interrupted_while_starting(signum: int, frame) -> None:
    """Ctrl-C while torch is imported (seconds, the first thing the program does): one line and exit 130,
    instead of a KeyboardInterrupt traceback from deep inside torch. Nothing has been read or written yet."""
    os.write(2, b"interrupted (Ctrl-C) while starting, before anything was written\n")
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted_while_starting)

import torch
import torch.distributed as dist

from accumulation.batching import MicroBatch, describe_batch
from accumulation.config.config import (
    Config,
    ConfigError,
    ModelConfig,
    config_to_toml,
    load_config,
    resolved_compile,
    resolved_grad_scaler,
)
from accumulation.counters import Counters
from accumulation.data.rows import DataError
from accumulation.data.sources import (
    build_data,
    check_supervised_counts,
    eval_micro_batches,
    step_batch,
    steps_per_epoch,
)
from accumulation.data.splits import Data
from accumulation.models.factory import (
    build_model,
    build_model_on_meta,
    count_parameters,
    decided_model_config,
    loss_sum_fn_for,
    resolved_vocab_size,
    training_forward_and_loss,
    uses_chunked_loss,
)
from accumulation.parallel.distributed import (
    DistributedContext,
    LaunchError,
    launch_environment,
    lost_rank_message,
    run_and_exit,
    setup_distributed,
    teardown_distributed,
)
from accumulation.parallel.pipeline import (
    Pipeline,
    build_pipeline,
    check_model_splits,
    gathered_model_state,
    gathered_optimizer_state,
    optimizer_order,
    pipelined_loss_sum,
    pipelined_step,
    stage_optimizer_state,
)
from accumulation.probe import InexactStep, probe_loss_and_model
from accumulation.run.build import (
    autocast_dtype_for,
    build_optimizer,
    check_config_for_world,
    check_micro_batch_fits_in_memory,
    check_model_fits_in_memory,
    load_optimizer_state,
    set_tf32,
    wrap_for_training,
)
from accumulation.run.checkpoint import (
    WRITE_ERROR_STATUS,
    CheckpointError,
    WriteError,
    save_checkpoint,
    why_not_written,
)
from accumulation.run.logs import (
    close_logs,
    finite_or_none,
    flush_logs,
    keep_metrics_up_to,
    open_logs,
    peak_memory_bytes,
    print_run_header,
    print_summary,
    progress_line,
    write_metrics,
)
from accumulation.run.resume import (
    STOPPED_FILE,
    ExpectedShapes,
    check_ranks_agree_on_resume,
    checkpoint_payload,
    find_resume_point,
    restore_rng_states,
    seed_dropout,
)
from accumulation.run.run_dir import (
    RunDirectoryError,
    RunLock,
    check_run_directory,
    run_directory,
    write_text_atomically,
)
from accumulation.run.signals import StopRequest
from accumulation.schedule import build_scheduler, set_learning_rates
from accumulation.step import (
    GlobalCounts,
    StepResult,
    all_reduce_ints,
    count_supervised_tokens,
    optimizer_step,
    to_device,
)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        from accumulation.config.help import help_text  # only --help lists every piece's keys

        try:
            print(help_text(argv))
        except ConfigError as error:  # a fork's module named in argv that cannot be imported: its keys are unknown
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    # Everything a user can get wrong is checked before anything is written: a bad launch environment,
    # config, data or checkpoint ends here with one line on stderr and exit status 2. Every rank finds the
    # same error and every rank prints it: under torchrun the first rank to exit gets the others stopped,
    # and a line left to rank 0 alone could die with it.
    lock = None  # rank 0's hold on the run directory (accumulation/run/run_dir.py), for this job's whole life
    try:
        rank, world_size = launch_environment()
        say = print if rank == 0 else (lambda *args, **kwargs: None)  # only rank 0 prints
        config = load_config(argv)
        check_config_for_world(config, world_size)
        # Before the data is read: an absurd seq_len or width would otherwise fill the memory there first.
        # The data's vocabulary is not known yet; one token is a lower bound on what the model needs.
        one_token_model = build_model_on_meta(config.model, max(config.model.vocab_size, 1), config.data.seq_len)
        check_model_fits_in_memory(config, count_parameters(one_token_model))
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        # a DataError when the rows cannot fill one global batch
        steps_per_epoch(data.train.num_rows, config.batch.global_batch_size, config.batch.tail)
        vocab_size = resolved_vocab_size(config.model, data.vocab_size)
        run_dir = run_directory(config)  # inside run.out_dir, links resolved
        check_run_directory(run_dir)  # this program's own files only (a fresh run: in a folder of no other run)
        model_on_meta = build_model_on_meta(config.model, vocab_size, config.data.seq_len)  # shapes, no memory
        shapes = ExpectedShapes.of(config, model_on_meta)
        # model.loss = "chunked" for a model without an output head: refused here, before anything is written
        chunked_loss = uses_chunked_loss(config.model, config.dist, model_on_meta)
        check_model_splits(model_on_meta, config)  # dist.pipeline_stages > 1: the model's pipeline_split, P <= layers
        check_micro_batch_fits_in_memory(config, count_parameters(model_on_meta), vocab_size, chunked_loss)
        if rank == 0:  # before the run directory is read: what a resume finds there stays this job's alone
            lock = RunLock(run_dir)
            lock.acquire()
        warn = print_to_stderr if rank == 0 else say
        resume = find_resume_point(config, data.summary, shapes, run_dir, warn, say)
    except (LaunchError, ConfigError, DataError, CheckpointError, RunDirectoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        if lock is not None:
            lock.release(undo=True)  # a refused run leaves no folder or lock file it created
        return 2
    status = 1  # if train_in_run_directory raises
    try:
        status = train_in_run_directory(config, data, vocab_size, run_dir, resume, rank, world_size, say)
        return status
    finally:
        if lock is not None:
            lock.release(undo=status == 2)  # bad input (ranks that disagree): the lock file it created goes


def print_to_stderr(*args, **kwargs) -> None:
    print(*args, **kwargs, file=sys.stderr)


def probe_step_zero(
    config: Config, training: "Training", context: DistributedContext, micro_batch: MicroBatch, say
) -> None:
    """accumulation/probe.py on this rank's first micro-batch of step 0: a mean loss is an InexactStep (exit 2);
    BatchNorm in train mode or a loss that couples examples is one warning line (an error with
    batch.on_inexact = "error")."""
    # Training's model.loss, uncompiled (as validation runs it): the probe compares losses, not kernels.
    model = training.model
    forward_module, loss_sum_fn = training_forward_and_loss(training.model_config, model)
    for line in probe_loss_and_model(
        forward_module, model, loss_sum_fn, micro_batch, context.device, config.batch.on_inexact
    ):
        say(f"warning: not exact: {line}", file=sys.stderr)


def train_in_run_directory(
    config: Config, data: Data, vocab_size: int, run_dir: Path, resume: dict | None, rank: int, world_size: int, say
) -> int:
    """main's second half, once the run directory is this job's: set up the ranks, train, and turn each way a
    run can fail into its line and exit status."""

    # Fail fast: a rank that raises says why and returns its status WITHOUT tearing down the process group.
    # run_and_exit then ends the process at once; the other ranks' next collective fails (gloo) or torchrun's
    # agent, which sees a worker gone, stops them (NCCL: they would otherwise wait for its watchdog, and a
    # rank tearing down while the others wait in a collective can hang itself). Only a clean return, which
    # every rank reaches together, destroys the process group.
    # SIGTERM, SIGUSR1, Ctrl-C, SIGHUP: finish the step, checkpoint, exit (accumulation/run/signals.py)
    stop = StopRequest()
    try:
        with stop.installed():
            context = setup_distributed(config.device, config.dist.timeout_s, config.dist.pipeline_stages)
            check_ranks_agree_on_resume(context, resume, run_dir)
            status = train(config, data, vocab_size, run_dir, resume, context, say, stop)
    except CheckpointError as error:  # ranks that disagree, or state dicts that do not load: nothing written yet
        print(f"error: {error}", file=sys.stderr)  # every rank, as above
        return 2
    except InexactStep as error:  # the step-0 probe: a mean loss, or (batch.on_inexact=error) coupled rows
        print(f"error: {error}", file=sys.stderr)  # every rank finds it on its own rows
        return 2
    except DataError as error:  # a row read mid-run holds an id beyond the vocabulary, or not the promised N
        print(f"error: {error}", file=sys.stderr)  # the rank that read the row says so; the others lose it
        return 2
    except WriteError as error:  # a full disk: the rank that wrote says so (the others lose it just after)
        print(f"error: {error}", file=sys.stderr)
        return WRITE_ERROR_STATUS
    except RuntimeError as error:  # torch.distributed's errors are RuntimeErrors too
        message = lost_rank_message(error, rank, config.dist.timeout_s) if world_size > 1 else None
        if message is None:
            traceback.print_exc()  # not a lost rank but a bug: its traceback is the useful message
            return 1
        print(message, file=sys.stderr)  # every rank: each one's view helps to find the rank that failed first
        return 1
    teardown_distributed()
    return status


def train(
    config: Config,
    data: Data,
    vocab_size: int,
    run_dir: Path,
    resume: dict | None,
    context: DistributedContext,
    say,
    stop: StopRequest,
) -> int:
    """One session of the run: build, resume, the training section, finish. Returns the exit status."""
    session_start = time.perf_counter()
    device = context.device
    training = build_training(config, vocab_size, resume, context)
    counters, consecutive_skips = resume_training(training, resume, config, context)
    step_batches = StepBatches(config, data, context)  # each step's micro-batches, built one step ahead
    if counters.steps == 0:  # a fresh run, before anything is written: what would make the step inexact
        [first_micro_batch, *_], _ = step_batches.peek(0, config.batch.micro_batch_size)
        probe_step_zero(config, training, context, first_micro_batch, say)
    session = Session(config, data, run_dir, context, training, consecutive_skips, say)
    session.begin(counters, resumed=resume is not None)
    print_run_header(config, data, run_dir, context, training, counters, say)
    autocast_dtype = autocast_dtype_for(config.precision)
    try:
        # ---------------------------------------------------------------- TRAINING SECTION BEGIN
        micro_batch_size = config.batch.micro_batch_size  # m; batch.on_oom = "shrink" may lower it below
        while counters.steps < config.run.max_steps:
            step_start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # The step's rows are a pure function of (seed, step, row ids); the step's micro-batches were built,
            # checked and pinned while the device ran the step before (see StepBatches).
            micro_batches, global_counts = step_batches.take(counters.steps, micro_batch_size)
            # Train mode (dropout on) for every step: a model may arrive in eval mode (Hugging Face's
            # from_pretrained returns one so), and a resumed run has no step-0 probe to leave it in train mode.
            if training.pipeline is not None:  # dist.pipeline_stages > 1: the schedule runs the micro-batches
                training.pipeline.stage_module.train()
                result = pipelined_step(
                    training.pipeline,
                    micro_batches,
                    training.optimizer,
                    global_counts=global_counts,
                    grad_clip=config.optim.grad_clip,
                    autocast_dtype=autocast_dtype,
                    scaler=training.scaler,
                    stop_requested=lambda: stop.requested,
                )
            else:
                training.wrapped.train()
                result = optimizer_step(
                    training.wrapped,
                    micro_batches,
                    training.optimizer,
                    device=device,
                    scaler=training.scaler,
                    loss_sum_fn=training.loss_sum_fn,
                    grad_clip=config.optim.grad_clip,
                    autocast_dtype=autocast_dtype,
                    global_counts=global_counts,
                    shrink_on_oom=config.batch.on_oom == "shrink",
                    stop_requested=lambda: stop.requested,  # read at the step's boundary
                    # while the device runs this step, the host builds the next one's micro-batches
                    before_read_back=lambda step=counters.steps + 1, m=micro_batch_size: step_batches.build(step, m),
                )
            if result.applied:
                training.scheduler.step()  # the schedule's unit is applied updates: a skipped step does not advance
            counters.add(result)
            if result.micro_batch_size != micro_batch_size:  # out of memory: the step was redone with smaller m
                micro_batch_size = result.micro_batch_size
                say(
                    f"step {counters.steps}: out of memory; redone and continuing with "
                    f"{describe_batch(config.batch.global_batch_size, micro_batch_size, context.replicas)}"
                )
            step_seconds = time.perf_counter() - step_start
            # ------------------------------------------------------------ TRAINING SECTION END
            # Everything below is diagnostics and bookkeeping.
            exit_status = session.after_step(counters, result, step_seconds, micro_batch_size, stop)
            if exit_status is not None:
                return exit_status
        session.finish(counters, micro_batch_size, session_start)
    finally:
        # After an error the process ends at once (fail fast); closing a writer that failed would raise a
        # second error and hide the first.
        if sys.exc_info()[0] is None:
            session.close()
    return 0


class StepBatches:
    """Each step's micro-batches, built one step ahead: optimizer_step calls build(next step) after it has queued
    the current step's work and before it reads the results back, so on a GPU the host builds, checks and pins
    them while the device computes. Which rows a step holds is a pure function of (seed, step, G), so building
    early changes neither the data order nor a resume. A batch built for an m that an out-of-memory retry has
    since lowered is built again; so is one whose check failed, which raises its DataError in its own step."""

    def __init__(self, config: Config, data: Data, context: DistributedContext) -> None:
        self.config, self.data, self.context = config, data, context
        self.built = {}  # (step, m) -> (micro-batches, global counts)

    def take(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        ready = self.built.pop((step, micro_batch_size), None)
        self.built.clear()
        return ready if ready is not None else self.micro_batches(step, micro_batch_size)

    def peek(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        """A step's micro-batches without taking them: built now (a DataError raises here) and kept for take()."""
        if (step, micro_batch_size) not in self.built:
            self.built[(step, micro_batch_size)] = self.micro_batches(step, micro_batch_size)
        return self.built[(step, micro_batch_size)]

    def build(self, step: int, micro_batch_size: int) -> None:
        if step >= self.config.run.max_steps:
            return
        try:
            self.built[(step, micro_batch_size)] = self.micro_batches(step, micro_batch_size)
        except DataError:
            pass  # raised again when that step takes its batch, after this step is logged and checkpointed

    def micro_batches(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        config, context = self.config, self.context
        # What each row holds at this step (a fresh mask) comes from the data. Every rank holds the whole step's
        # row ids and counts N on the host by itself: no collective, and nothing waits, before the forward.
        batch = step_batch(
            self.data.train,
            step,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=micro_batch_size,
            world_size=context.replicas,  # D: the stages of one replica run the same rows
            rank=context.replica,
        )
        # N comes from supervised_counts: this rank's labels must hold exactly the targets it promised, or
        # every update is scaled wrong. Host tensors only; a mismatch is a DataError (one line, exit 2).
        check_supervised_counts(batch)
        micro_batches = batch.micro_batches
        if context.device.type == "cuda":  # page-locked host memory lets the copies run asynchronously
            micro_batches = [micro_batch.pinned() for micro_batch in micro_batches]
        return micro_batches, batch.global_counts


class Training(NamedTuple):
    """What the training section runs: the model (checkpoints hold it), the module the step runs (`wrapped`),
    the loss, and the optimizer with its schedule and GradScaler."""

    model: torch.nn.Module
    model_config: ModelConfig  # config.model with model.loss decided ("plain" or "chunked")
    forward_module: torch.nn.Module  # the model, or with the chunked loss the module returning its hidden states
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    compiled: bool
    pipeline: Pipeline | None = None  # dist.pipeline_stages > 1: this rank's stage and the schedule; else None


def build_training(config: Config, vocab_size: int, resume: dict | None, context: DistributedContext) -> Training:
    """The model (with a resume's weights), its wrapper, the loss, the optimizer, the schedule and the scaler."""
    device = context.device
    # the same initial weights on every rank
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).to(device)
    # Dropout: a different stream on each rank, seeded after the build, so that a build that seeds the global
    # generator itself (Hugging Face's set_seed) cannot leave every rank on one stream.
    seed_dropout(config.run.seed, context.rank)
    if resume is not None:  # the whole weights on every rank, before any sharding (find_resume_point checked them)
        model.load_state_dict(resume["model"])
    # DistributedDataParallel over more than one rank, or (dist.strategy = "fsdp2") the model sharded in place,
    # its parameters then DTensor shards: the optimizer is built after this line, over what the step updates.
    # model.loss: the model's logits and the plain loss, or its hidden states and the chunked loss (the same SUM).
    compiled = resolved_compile(config, device.type)
    pipeline = None
    # model.loss = "auto" decided once, by the memory the plain loss's logits would take at the configured m
    # (accumulation/models/factory.py); the probe and validation use the same loss.
    model_config = decided_model_config(config, model, device)
    if context.pipelined:  # this rank's stage (in DDP over its replicas) and the schedule; the plain loss
        forward_module, loss_sum_fn = model, loss_sum_fn_for(config.model)
        accum = config.batch.global_batch_size // (config.batch.micro_batch_size * context.replicas)
        pipeline = build_pipeline(model, context.layout, device, loss_sum_fn, accum, config.dist.pipeline_schedule)
        # The optimizer over the stage's parameters alone; checkpoints number them as one over the whole model.
        optimizer = build_optimizer(config.optim, pipeline.stage_module, device)
        pipeline.whole_order = optimizer_order(build_optimizer(config.optim, model, device), pipeline.names)
        wrapped = pipeline.wrapped
    else:
        forward_module, loss_sum_fn = training_forward_and_loss(model_config, model, compile=compiled)
        param_dtype = autocast_dtype_for(config.precision)  # under fsdp2, the shards' compute dtype
        wrapped = wrap_for_training(forward_module, config.dist, context, compile=compiled, param_dtype=param_dtype)
        optimizer = build_optimizer(config.optim, model, device)
    decay_updates = config.schedule.decay_updates or config.run.max_steps
    scheduler = build_scheduler(
        optimizer, config.schedule.name, config.schedule.warmup_updates, decay_updates, config.schedule.min_lr_ratio
    )
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    set_tf32(config.precision.tf32)  # CUDA fp32 matrix products on tensor cores; nothing changes on the CPU
    return Training(
        model, model_config, forward_module, loss_sum_fn, wrapped, optimizer, scheduler, scaler, compiled, pipeline
    )


def resume_training(
    training: Training, resume: dict | None, config: Config, context: DistributedContext
) -> tuple[Counters, int]:
    """A resume's optimizer, scheduler, scaler and random states loaded; returns the counters and the skipped
    steps in a row (up to optim.max_consecutive_skips; checkpointed with the counters). A fresh run: zeros."""
    if resume is None:
        return Counters(), 0
    # find_resume_point checked the config, the model's shapes and the plain values; PyTorch's own
    # state dicts are checked by their loaders, still before anything is written.
    try:
        # this run's fused/foreach and device; whole tensors cut into this rank's shards under fsdp2
        saved_optimizer = resume["optimizer"]
        if training.pipeline is not None:  # the whole model's state, numbered as one optimizer: this stage's part
            saved_optimizer = stage_optimizer_state(training.pipeline, training.optimizer, saved_optimizer)
        load_optimizer_state(training.optimizer, saved_optimizer)
        training.scheduler.load_state_dict(resume["scheduler"])
        if resume["scaler"]:  # empty when the checkpoint's run had no GradScaler: this one starts afresh
            training.scaler.load_state_dict(resume["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"the checkpoint's optimizer, scheduler or scaler state does not fit this run ({error}); resume "
            f"from an older checkpoint (delete the newer step files and latest.pt), or start a new run.name"
        ) from None
    set_learning_rates(training.scheduler)  # the new config's schedule governs the very next step
    counters = Counters(**resume["counters"])
    consecutive_skips = resume["skips_in_a_row"]
    restore_rng_states(resume["rng"], context, config, counters.steps)
    resume.clear()  # the loaded state lives in the model and optimizer now: the payload's copy is freed
    return counters, consecutive_skips


class Session:
    """Everything around the training section, on every rank: checkpoints, the logs (rank 0), the lines on the
    terminal, and the checks after each step that may end the run. The steps' (supervised tokens, seconds) are
    kept for this session (the summary's speed) and since the last progress line (its tokens/s)."""

    def __init__(
        self,
        config: Config,
        data: Data,
        run_dir: Path,
        context: DistributedContext,
        training: Training,
        consecutive_skips: int,
        say,
    ) -> None:
        self.config, self.data, self.run_dir, self.context, self.training = config, data, run_dir, context, training
        self.say = say
        self.consecutive_skips = consecutive_skips
        self.metrics_file, self.writers = None, []  # rank 0 opens them in begin(), after the step-0 checkpoint
        self.session_steps, self.window = [], []
        self.first_loss = self.last_loss = None
        self.record = {}  # the last step's metrics line

    def save(self, counters: Counters) -> None:
        training, context = self.training, self.context
        payload = checkpoint_payload(
            self.config,
            self.data.summary,
            training.model,
            training.optimizer,
            training.scheduler,
            training.scaler,
            counters,
            self.consecutive_skips,
            context,
        )
        if training.pipeline is not None:  # the same whole-model file: the stages' parts gathered to rank 0
            payload["model"] = gathered_model_state(training.pipeline)
            payload["optimizer"] = gathered_optimizer_state(training.pipeline, training.optimizer)
        if context.is_main:
            # The logs of every step up to this one reach the disk before the checkpoint that covers them: a
            # resume keeps them and runs only the later steps again (TensorBoard buffers for up to 2 minutes).
            flush_logs(self.metrics_file, self.writers)
            save_checkpoint(payload, self.run_dir / "checkpoints", counters.steps, self.config.run.keep_checkpoints)

    def begin(self, counters: Counters, resumed: bool) -> None:
        """config.toml, the metrics of steps after the checkpoint dropped, the step-0 checkpoint, the logs opened."""
        run_dir = self.run_dir
        metrics_path = run_dir / "metrics.jsonl"
        if self.context.is_main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                write_text_atomically(run_dir / "config.toml", config_to_toml(self.config))
            except OSError as error:
                raise WriteError(
                    f"{run_dir / 'config.toml'} could not be written: {why_not_written(error, run_dir)}"
                ) from None
            keep_metrics_up_to(metrics_path, counters.steps)
        if not resumed:
            self.save(counters)  # step 0: a run killed before its first checkpoint still resumes from the start
        self.metrics_file, self.writers = open_logs(self.context, run_dir, metrics_path, resumed, counters)

    def after_step(
        self, counters: Counters, result: StepResult, step_seconds: float, micro_batch_size: int, stop: StopRequest
    ) -> int | None:
        """The step's metrics line, validation, progress line and checkpoint; the exit status when the run
        must stop here (a non-finite step, a stop signal), else None."""
        config, context, say = self.config, self.context, self.say
        self.session_steps.append((result.tokens, step_seconds))
        self.window.append((result.tokens, step_seconds))
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss
        record = self.record = {
            **vars(counters),
            "loss": finite_or_none(result.loss),
            "lr": result.lr,
            "grad_norm": finite_or_none(result.grad_norm),
            "scale": result.loss_scale,  # the scale of this step's losses: no extra read of the device
            "tokens_per_s": result.tokens / step_seconds,
            "peak_mem_bytes": peak_memory_bytes(context.device),
            "time_s": step_seconds,
        }
        if not result.applied:
            record["skip_reason"] = result.skip_reason
            say(f"step {counters.steps}: update skipped: {result.skip_reason}")
        finished = counters.steps == config.run.max_steps
        # Validation on its own cadence of steps, never depending on where a session happens to end,
        # so an interrupted and resumed run writes the same lines as an uninterrupted one.
        if self.data.val is not None and config.run.eval_every and counters.steps % config.run.eval_every == 0:
            training = self.training
            val_loss = validation_loss(
                training.model, self.data, config, context, micro_batch_size, training.model_config, training.pipeline
            )
            record["val_loss"] = finite_or_none(val_loss)
        write_metrics(context, self.metrics_file, self.writers, record)
        if counters.steps % config.run.log_every == 0 or finished:
            say(progress_line(counters, config, record, self.window, self.data.summary.targets))
            self.window = []

        self.consecutive_skips = 0 if result.applied else self.consecutive_skips + 1
        stop_reason = nonfinite_stop_reason(config, result, self.training.scaler, self.consecutive_skips)
        if stop_reason:
            self.save(counters)  # a skipped update left the weights at the last good state
            if context.is_main:
                # A restart (torchrun --max-restarts, a requeued job) must not quietly resume past the
                # step that stopped the run; this file makes it refuse until a person removes it.
                (self.run_dir / STOPPED_FILE).write_text(f"stopped at step {counters.steps}: {stop_reason}\n")
            say(f"error: stopping at step {counters.steps}: {stop_reason}; checkpoint written", file=sys.stderr)
            return 1
        # A stop signal on any rank (the step's all-reduce told every rank at the same step): checkpoint
        # here and exit, so that a restart loses nothing. Signal to exit: the rest of the step in progress
        # (or the whole next one, when the signal came after this step's boundary), its validation, one save.
        if counters.steps % config.run.checkpoint_every == 0 or finished or result.stop_requested:
            self.save(counters)
        if result.stop_requested and not finished:
            received = f"{stop.signal_name} received" if stop.requested else "another rank got a stop signal"
            say(
                f"stopped at step {counters.steps}: {received}; checkpoint written; exit status "
                f"{stop.exit_status}; starting again (a requeued job, torchrun --max-restarts) resumes it",
                file=sys.stderr,
            )
            return stop.exit_status
        return None

    def finish(self, counters: Counters, micro_batch_size: int, session_start: float) -> None:
        """The final validation loss and rank 0's summary, when this session ran any step."""
        if not self.session_steps:
            return
        final_val_loss = None
        if self.data.val is not None:
            # The last step's validation when it had one, else one more pass (every rank takes part).
            final_val_loss = (
                self.record["val_loss"]
                if "val_loss" in self.record
                else finite_or_none(
                    validation_loss(
                        self.training.model,
                        self.data,
                        self.config,
                        self.context,
                        micro_batch_size,
                        self.training.model_config,
                        self.training.pipeline,
                    )
                )
            )
        if self.context.is_main:
            wall_seconds = time.perf_counter() - session_start
            print_summary(
                self.config,
                counters,
                self.first_loss,
                self.last_loss,
                final_val_loss,
                self.session_steps,
                wall_seconds,
                self.training.model,
                self.data.train,
                self.data.summary.targets,
            )

    def close(self) -> None:
        close_logs(self.metrics_file, self.writers)


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    data: Data,
    config: Config,
    context: DistributedContext,
    micro_batch_size: int,
    model_config: ModelConfig | None = None,
    pipeline: Pipeline | None = None,
) -> float:
    """Token-weighted mean loss over the validation rows: sums of token losses and token counts are added over
    every micro-batch and replica, then divided once (the same weighting as training). `model_config`:
    config.model with model.loss as training decided it (Training.model_config; default config.model).
    `micro_batch_size` is the training loop's current m (batch.on_oom = "shrink" may have lowered it); the value
    does not depend on it when the model treats each row alone in eval mode and the loss is a sum over targets (a
    loss with in-batch negatives, which step 0's probe warns of, changes with m: docs/forking.md, "What no loop
    can make exact"). With pipeline stages (`pipeline`, Training.pipeline) the rows go forward through the
    stages; only last stages add loss sums, and the first stage of each replica counts its targets (so each
    replica's count is added once)."""
    autocast_dtype = autocast_dtype_for(config.precision)
    own_rows = eval_micro_batches(data.val, micro_batch_size, context.replicas, context.replica)
    if pipeline is not None:
        loss_sum, tokens = pipelined_loss_sum(pipeline, own_rows, autocast_dtype)
        tokens = tokens if context.layout.is_first_stage else 0
        dist.all_reduce(loss_sum)
        [tokens_global] = all_reduce_ints([tokens], context.device)
        return loss_sum.item() / max(tokens_global, 1)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=context.device)
    tokens = 0
    # Training's model.loss, uncompiled: the chunked loss keeps a whole micro-batch's logits out of memory here too.
    model_config = decided_model_config(config, model, context.device) if model_config is None else model_config
    forward_module, loss_sum_fn = training_forward_and_loss(model_config, model)
    for micro_batch in own_rows:
        with torch.autocast(context.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            inputs, labels = to_device(micro_batch, context.device)
            loss_sum += loss_sum_fn(forward_module(inputs), labels)
        tokens += count_supervised_tokens(micro_batch.labels)
    model.train()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    [tokens_global] = all_reduce_ints([tokens], context.device)
    return loss_sum.item() / max(tokens_global, 1)


def nonfinite_stop_reason(config: Config, result: StepResult, scaler, consecutive_skips: int) -> str | None:
    """Why the run must stop after this step, or None.

    optim.on_nonfinite = "stop" ends the run at a non-finite loss, and at a non-finite gradient when no
    GradScaler is on. With a GradScaler, a non-finite gradient after a finite loss is how the scaler finds
    its scale (it skips the update and halves the scale), so that alone never stops a run. Any run stops
    after optim.max_consecutive_skips skipped steps in a row."""
    if consecutive_skips >= config.optim.max_consecutive_skips:
        limit = config.optim.max_consecutive_skips
        return f"{consecutive_skips} skipped updates in a row (optim.max_consecutive_skips={limit})"
    if config.optim.on_nonfinite == "stop" and result.tokens > 0:
        if not math.isfinite(result.loss):
            return f"non-finite loss {result.loss} (optim.on_nonfinite=stop)"
        if not result.applied and not scaler.is_enabled():
            return f"{result.skip_reason} (optim.on_nonfinite=stop)"
    return None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on Ctrl-C raises KeyboardInterrupt
    run_and_exit(main, sys.argv[1:])
