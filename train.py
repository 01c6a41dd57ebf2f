"""Train a model with exact gradient accumulation, on one process or under torchrun.

    python train.py [--config FILE] [section.key=value ...]
    torchrun --standalone --nproc_per_node=N train.py [--config FILE] [section.key=value ...]

Units: m = batch.micro_batch_size examples per forward/backward per rank, A = accumulation steps (derived),
D = data-parallel replicas, global batch G = m·A·D examples per optimizer step. A "step" is one optimizer step
attempt (one accumulation group); an "update" is a step whose update was applied.

Read top to bottom: the config, the data and everything else a user can get wrong (`main`); the build
(`build_training`); the training section in `train`, whose one call to accumulation/step.py's optimizer_step is the
maths of a step; then validation and the logs (accumulation/run/logs.py writes them), and checkpoints. A fork adds a
model, a loss or a data source in its own file, registered by name (accumulation/config/registry.py), and names it
in the config; no file here is edited. docs/forking.md walks through it.
"""

# ruff: noqa: E402 (the imports after the first block wait for the Ctrl-C handler below, on purpose)

import functools
import os
import signal
import sys
import time
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

from accumulation.batching import MicroBatch, describe_batch
from accumulation.config.config import (
    Config,
    ConfigError,
    ModelConfig,
    load_config,
    resolved_compile,
    resolved_grad_scaler,
)
from accumulation.counters import Counters
from accumulation.data.rows import DataError, row_hooks
from accumulation.data.sources import build_data, steps_per_epoch
from accumulation.data.splits import Data
from accumulation.models.factory import (
    build_model,
    build_model_on_meta,
    count_parameters,
    decided_model_config,
    loss_sum_fn_for,
    resolved_vocab_size,
    training_forward_and_loss,
)
from accumulation.parallel.distributed import (
    DistributedContext,
    LaunchError,
    launch_environment,
    run_and_exit,
    setup_distributed,
    teardown_distributed,
)
from accumulation.probe import InexactStep, probe_loss_and_model
from accumulation.run.batches import StepBatches
from accumulation.run.build import (
    autocast_dtype_for,
    build_optimizer,
    check_config_for_world,
    check_fits_in_memory,
    set_tf32,
    step_strategy,
    wrap_for_training,
)
from accumulation.run.checkpoint import (
    CheckpointError,
    WriteError,
    checkpoint_payload,
    save_checkpoint,
    seed_dropout,
)
from accumulation.run.logs import RunLogs, finite_or_none
from accumulation.run.resume import check_run_directory, find_resume_point
from accumulation.run.run_dir import RunDirectoryError, RunLock, run_directory
from accumulation.run.signals import StopRequest
from accumulation.run.stops import nonfinite_stop_reason, stopped_at_a_bad_step, stopped_by_a_signal
from accumulation.run.validation import validation_loss
from accumulation.schedule import run_scheduler
from accumulation.step import optimizer_step

# ================================================================== 1. The config, the data, and what can go wrong


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
        # The data's vocabulary and the loss are not known yet: one token and no logits are lower bounds.
        one_token_model = build_model_on_meta(config.model, max(config.model.vocab_size, 1), config.data.seq_len)
        check_fits_in_memory(config, count_parameters(one_token_model), vocab_size=1, chunked_loss=True)
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        # a DataError when the rows cannot fill one global batch
        steps_per_epoch(data.train.num_rows, config.batch.global_batch_size, config.batch.tail)
        vocab_size = resolved_vocab_size(config.model, data.vocab_size)
        run_dir = run_directory(config)  # inside run.out_dir, links resolved
        check_run_directory(run_dir)  # this program's own files only; a fresh run in a folder of no other run
        model_on_meta = build_model_on_meta(config.model, vocab_size, config.data.seq_len)  # shapes, no memory
        # model.loss = "chunked" for a model without an output head: refused here, before anything is written
        # (on the meta device "auto" is plain; build_training decides it on the run's device)
        chunked_loss = decided_model_config(config, model_on_meta, torch.device("meta")).loss == "chunked"
        if config.dist.pipeline_stages > 1:  # the model's pipeline_split, P <= layers
            from accumulation.parallel.pipeline import check_model_splits

            check_model_splits(model_on_meta, config)
        check_fits_in_memory(config, count_parameters(model_on_meta), vocab_size, chunked_loss)
        if rank == 0:  # before the run directory is read: what a resume finds there stays this job's alone
            lock = RunLock(run_dir)
            lock.acquire()
        warn = functools.partial(say, file=sys.stderr)  # rank 0's warnings, on stderr
        resume = find_resume_point(config, data.summary, model_on_meta, run_dir, warn, say)
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
            if context.world_size > 1:  # each rank looked for the checkpoint itself
                from accumulation.run.restore import check_ranks_agree_on_resume

                check_ranks_agree_on_resume(context, resume, run_dir)
            status = train(config, data, vocab_size, run_dir, resume, context, say, stop)
    except (CheckpointError, InexactStep, DataError, WriteError, RuntimeError) as error:
        # Bad input found now (exit 2), a full disk (1), out of memory (2), a lost rank (1) or a bug (its traceback)
        from accumulation.run.failures import exit_status_after  # only a run that fails imports it

        return exit_status_after(error, config, rank, world_size)
    teardown_distributed()
    return status


# ================================================================== 2. The build


class Training(NamedTuple):
    """What the training section runs. Two names for the model: `model` is the whole unwrapped model (checkpoints
    hold its state dict); `module` is what optimizer_step runs, the model as training wraps it (compiled, in DDP,
    sharded by FSDP2, its loss inside it when compiled, or this rank's pipeline stage)."""

    model: torch.nn.Module
    model_config: ModelConfig  # config.model with model.loss decided ("plain" or "chunked")
    module: torch.nn.Module
    loss_sum_fn: Callable | None  # the loss of module's outputs; None: module computes it (compiled with it)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    compiled: bool
    strategy: object = None  # how the step runs the micro-batches: FSDP2's, the pipeline, or None (one process, DDP)
    pipeline: object = None  # dist.pipeline_stages > 1: this rank's stage and the schedule (parallel/pipeline.py)


def build_training(config: Config, vocab_size: int, resume: dict | None, context: DistributedContext) -> Training:
    """The model (with a resume's weights), the module the step runs, the loss, the optimizer, the schedule and
    the scaler."""
    device = context.device
    # the same initial weights on every rank
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).to(device)
    # Dropout: a different stream on each rank, seeded after the build, so that a build that seeds the global
    # generator itself (Hugging Face's set_seed) cannot leave every rank on one stream.
    seed_dropout(config.run.seed, context.rank)
    if resume is not None:  # the whole weights on every rank, before any sharding (find_resume_point checked them)
        model.load_state_dict(resume["model"])
    compiled = resolved_compile(config, device.type)
    pipeline = None
    # model.loss = "auto" decided on the run's device: plain on the CPU, by the GPU's free memory on CUDA
    # (accumulation/models/factory.py); the probe and validation use the same loss.
    model_config = decided_model_config(config, model, device)
    if context.pipelined:  # this rank's stage (in DDP over its replicas) and the schedule; the plain loss
        from accumulation.parallel.pipeline import build_pipeline, optimizer_order

        loss_sum_fn = loss_sum_fn_for(config.model)
        accum = config.batch.global_batch_size // (config.batch.micro_batch_size * context.replicas)
        pipeline = build_pipeline(model, context.layout, device, loss_sum_fn, accum, config.dist.pipeline_schedule)
        # The optimizer over the stage's parameters alone; checkpoints number them as one over the whole model.
        optimizer = build_optimizer(config.optim, pipeline.stage_module, device)
        pipeline.whole_order = optimizer_order(build_optimizer(config.optim, model, device), pipeline.names)
        module, strategy = pipeline.wrapped, pipeline
    else:
        forward_module, loss_sum_fn = training_forward_and_loss(model_config, model, compile=compiled)
        # DistributedDataParallel over more than one rank, or (dist.strategy = "fsdp2") the model sharded in place,
        # its parameters then DTensor shards: the optimizer is built after this line, over what the step updates.
        param_dtype = autocast_dtype_for(config.precision)  # under fsdp2, the shards' compute dtype
        module = wrap_for_training(forward_module, config.dist, context, compile=compiled, param_dtype=param_dtype)
        strategy = step_strategy(config.dist, module)
        optimizer = build_optimizer(config.optim, model, device)
    scheduler = run_scheduler(optimizer, config.schedule, config.run.max_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    set_tf32(config.precision.tf32)  # CUDA fp32 matrix products on tensor cores; nothing changes on the CPU
    return Training(
        model, model_config, module, loss_sum_fn, optimizer, scheduler, scaler, compiled, strategy, pipeline
    )


# ================================================================== 3. The training section


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
    hooks = row_hooks(data.train)  # the rows' optional part: RL's rollouts (accumulation/data/rows.py's RowHooks)
    hooks.bind_policy(training.model, context, resume)  # rows sampled from the model being trained
    if resume is None:
        counters, skips_in_a_row = Counters(), 0  # a fresh run
    else:  # the optimizer, scheduler, scaler and random states of the checkpoint
        from accumulation.run.restore import restore_training_state

        counters, skips_in_a_row = restore_training_state(training, resume, config, context)
    batches = StepBatches(config, data, context)  # each step's micro-batches, built one step ahead
    if counters.steps == 0:  # a fresh run, before anything is written: what would make the step inexact
        [first_micro_batch, *_], _ = batches.peek(0, config.batch.micro_batch_size)
        probe_step_zero(config, training, context, first_micro_batch, say)
    logs = RunLogs(config, data, run_dir, context, say)
    validator = Validator(config, data, context, training)
    checkpointer = Checkpointer(config, data, run_dir, context, training, logs)
    logs.begin(counters)
    if resume is None:
        checkpointer.save(counters, skips_in_a_row)  # step 0: a run killed before its first checkpoint resumes
    logs.open(counters, resumed=resume is not None)
    logs.header(training, counters)
    step_function = optimizer_step
    if config.batch.on_oom == "shrink":  # a step that runs out of memory is redone with fewer rows per micro-batch
        from accumulation.shrink_on_oom import optimizer_step_shrinking_on_oom as step_function
    autocast_dtype = autocast_dtype_for(config.precision)
    micro_batch_size = config.batch.micro_batch_size  # m; batch.on_oom = "shrink" may lower it
    record = {}
    try:
        # ---------------------------------------------------------------- TRAINING SECTION BEGIN
        while counters.steps < config.run.max_steps:
            step_start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # The step's rows are a pure function of (seed, step, row ids); its micro-batches were built, checked
            # and pinned while the device ran the step before.
            micro_batches, global_counts = batches.take(counters.steps, micro_batch_size)
            # Dropout on: a model may arrive in eval mode (from_pretrained), and a resume has no step-0 probe.
            training.module.train()
            result = step_function(
                training.module,
                micro_batches,
                training.optimizer,
                device=device,
                scaler=training.scaler,
                loss_sum_fn=training.loss_sum_fn,
                grad_clip=config.optim.grad_clip,
                autocast_dtype=autocast_dtype,
                global_counts=global_counts,
                stop_requested=lambda: stop.requested,  # read at the step's boundary
                strategy=training.strategy,
                # while the device runs this step, the host builds the next one's micro-batches
                before_read_back=lambda step=counters.steps + 1, m=micro_batch_size: batches.build(step, m),
            )
            if result.applied:
                training.scheduler.step()  # the schedule's unit is applied updates: a skipped step does not advance
            counters.add(result)
            skips_in_a_row = 0 if result.applied else skips_in_a_row + 1
            if result.micro_batch_size != micro_batch_size:  # out of memory: the step was redone with smaller m
                micro_batch_size = result.micro_batch_size
                batch = describe_batch(config.batch.global_batch_size, micro_batch_size, context.replicas)
                say(f"step {counters.steps}: out of memory; redone and continuing with {batch}")
            step_seconds = time.perf_counter() - step_start
            # Everything below is diagnostics and bookkeeping, each behind one call that knows its own cadence.
            record = logs.step_record(counters, result, step_seconds)
            record |= hooks.step_fields(counters.steps, config.run.eval_every)  # RL: rounds, rewards, clip fraction
            if validator.should_validate(counters.steps):
                record["val_loss"] = finite_or_none(validator.loss(micro_batch_size))
            logs.write(counters, record)
            stop_reason = nonfinite_stop_reason(config, result, training.scaler, skips_in_a_row)
            checkpointer.maybe_save(counters, skips_in_a_row, now=stop_reason is not None or result.stop_requested)
            if stop_reason is not None:
                return stopped_at_a_bad_step(counters, stop_reason, run_dir, context, say)
            if result.stop_requested and counters.steps < config.run.max_steps:
                return stopped_by_a_signal(counters, stop, say)
        # ---------------------------------------------------------------- TRAINING SECTION END
        if logs.session_steps:  # the last step's validation loss when it had one, else one more pass
            final_val_loss = record["val_loss"] if "val_loss" in record else validator.final_loss(micro_batch_size)
            logs.summary(counters, final_val_loss, session_start, training.model)
    finally:
        # After an error the process ends at once (fail fast); closing a writer that failed would raise a
        # second error and hide the first.
        if sys.exc_info()[0] is None:
            logs.close()
    return 0


def probe_step_zero(
    config: Config, training: "Training", context: DistributedContext, micro_batch: MicroBatch, say
) -> None:
    """accumulation/probe.py on this rank's first micro-batch of step 0: a mean loss is an InexactStep (exit 2);
    BatchNorm in train mode or a loss that couples examples is one warning line (an error with
    batch.on_inexact = "error")."""
    # Training's model.loss, uncompiled (as validation runs it): the probe compares losses, not kernels.
    forward_module, loss_sum_fn = training_forward_and_loss(training.model_config, training.model)
    for line in probe_loss_and_model(
        forward_module, training.model, loss_sum_fn, micro_batch, context.device, config.batch.on_inexact
    ):
        say(f"warning: not exact: {line}", file=sys.stderr)


# ================================================================== 4. Validation


class Validator:
    """The validation loss on its own cadence of steps (run.eval_every), never depending on where a session
    happens to end, so that an interrupted and resumed run writes the same lines as an uninterrupted one."""

    def __init__(self, config: Config, data: Data, context: DistributedContext, training: Training) -> None:
        self.config, self.data, self.context, self.training = config, data, context, training

    def should_validate(self, steps: int) -> bool:
        every = self.config.run.eval_every
        return self.data.val is not None and every > 0 and steps % every == 0

    def loss(self, micro_batch_size: int) -> float:
        model, model_config, pipeline = self.training.model, self.training.model_config, self.training.pipeline
        return validation_loss(model, self.data, self.config, self.context, micro_batch_size, model_config, pipeline)

    def final_loss(self, micro_batch_size: int) -> float | None:
        return finite_or_none(self.loss(micro_batch_size)) if self.data.val is not None else None


# ================================================================== 5. Checkpoints, and the ways a run stops


class Checkpointer:
    """Checkpoints every run.checkpoint_every steps, at the run's last step, and when the run must stop."""

    def __init__(self, config, data: Data, run_dir: Path, context: DistributedContext, training, logs: RunLogs):
        self.config, self.data, self.run_dir, self.context = config, data, run_dir, context
        self.training, self.logs = training, logs

    def maybe_save(self, counters: Counters, skips_in_a_row: int, now: bool) -> None:
        finished = counters.steps == self.config.run.max_steps
        if counters.steps % self.config.run.checkpoint_every == 0 or finished or now:
            self.save(counters, skips_in_a_row)

    def save(self, counters: Counters, skips_in_a_row: int) -> None:
        training, context = self.training, self.context
        states = training.model, training.optimizer, training.scheduler, training.scaler
        payload = checkpoint_payload(self.config, self.data.summary, *states, counters, skips_in_a_row, context)
        rows_state = row_hooks(self.data.train).state_dict()  # what a resume cannot redraw (RL: the round's rollout)
        if rows_state:
            payload["data"]["rollouts"] = rows_state
        if training.pipeline is not None:  # the same whole-model file: the stages' parts gathered to rank 0
            from accumulation.parallel.pipeline import gathered_model_state, gathered_optimizer_state

            payload["model"] = gathered_model_state(training.pipeline)
            payload["optimizer"] = gathered_optimizer_state(training.pipeline, training.optimizer)
        if context.is_main:
            # The logs of every step up to this one reach the disk before the checkpoint that covers them: a
            # resume keeps them and runs only the later steps again.
            self.logs.flush()
            save_checkpoint(payload, self.run_dir / "checkpoints", counters.steps, self.config.run.keep_checkpoints)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on Ctrl-C raises KeyboardInterrupt
    run_and_exit(main, sys.argv[1:])
