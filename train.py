"""Train a model with exact gradient accumulation, on one process or under torchrun.

    python train.py [--config FILE] [section.key=value ...]
    torchrun --standalone --nproc_per_node=N train.py [--config FILE] [section.key=value ...]

Units: m = batch.micro_batch_size examples per forward/backward per rank, A = accumulation steps (derived),
D = data-parallel replicas, global batch G = m·A·D examples per optimizer step. A "step" is one optimizer step
attempt (one accumulation group); an "update" is a step whose update was applied.

Read top to bottom: `main`; the config, the data and everything else a user can get wrong (`prepare`); the training
section in `train`, after the one build of everything a step needs (accumulation/run/build.py's `build_training`),
whose one call to accumulation/step.py's optimizer_step is the maths of a step; then validation and the logs
(accumulation/run/logs.py writes them), and checkpoints. A fork adds a model, a loss or a data source in its own
file, registered by name (accumulation/config/registry.py), and names it in the config; no file here is edited.
docs/forking.md walks through it.
"""

# ruff: noqa: E402 (the imports after the first block wait for the Ctrl-C handler below, on purpose)

import signal
import sys
import time
from pathlib import Path

from accumulation.run.signals import interrupted_while_starting  # imports no torch

if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted_while_starting)  # Ctrl-C while torch is imported: one line, exit 130

import torch

from accumulation.batching import MicroBatch, describe_batch
from accumulation.config.config import (
    Config,
    load_config,
)
from accumulation.counters import Counters
from accumulation.data.rows import row_hooks
from accumulation.data.sources import build_data, steps_per_epoch
from accumulation.data.splits import Data
from accumulation.models.factory import (
    build_model_on_meta,
    decided_model_config,
    resolved_vocab_size,
)
from accumulation.parallel.distributed import DistributedContext, run_and_exit
from accumulation.probe import probe_loss_and_model
from accumulation.run.batches import StepBatches
from accumulation.run.build import (
    Training,
    build_training,
    check_config_for_world,
    check_fits_in_memory,
    parameters_held,
)
from accumulation.run.checkpoint import checkpoint_payload, save_checkpoint
from accumulation.run.entry import Job, Prepared, run_job
from accumulation.run.logs import RunLogs, finite_or_none
from accumulation.run.restore import find_resume_point, restore_training_state
from accumulation.run.run_dir import check_run_directory, run_directory
from accumulation.run.signals import StopRequest
from accumulation.run.stops import nonfinite_stop_reason, stopped_at_a_bad_step, stopped_by_a_signal
from accumulation.run.validation import validation_loss

# ================================================================== 1. The config, the data, and what can go wrong


def main(argv: list[str]) -> int:
    """The program: read the config, the data and the run directory (`prepare`), then build and train (`train`).
    run_job (accumulation/run/entry.py) runs the two under the failure policy: bad input is one line on stderr and
    exit status 2 with nothing left behind, a run that fails ends at once with status 1, Ctrl-C exits 130."""
    if "--help" in argv or "-h" in argv:
        from accumulation.config.help import print_help  # only --help lists every piece's keys

        return print_help(argv)
    return run_job(argv, prepare, train)


def prepare(argv: list[str], job: Job) -> Prepared:
    """Everything a user can get wrong, checked before anything is written: the config, the data, the model's
    shapes and size, the run directory and the checkpoint to continue from."""
    config = load_config(argv)
    check_config_for_world(config, job.world_size)
    # Before the data is read: an absurd seq_len or width would otherwise fill the memory there first.
    # The data's vocabulary and the loss are not known yet: one token and no logits are lower bounds.
    one_token_model = build_model_on_meta(config.model, max(config.model.vocab_size, 1), config.data.seq_len)
    check_fits_in_memory(config, parameters_held(config, one_token_model), vocab_size=1, chunked_loss=True)
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
    # parameters_held checks the model's pipeline_split (P <= layers) under pipeline stages: a rank holds one stage
    check_fits_in_memory(config, parameters_held(config, model_on_meta), vocab_size, chunked_loss)
    job.hold(run_dir)  # rank 0 locks it before a resume reads it
    # On several ranks each checksums its share of a sharded checkpoint's shard files once they have joined (entry.py)
    together = job.world_size > 1
    resume = find_resume_point(config, data.summary, model_on_meta, run_dir, job.warn, job.say, together)

    def find_older(step: int) -> dict | None:
        return find_resume_point(config, data.summary, model_on_meta, run_dir, job.warn, job.say, together, step)

    return Prepared(config, data, vocab_size, run_dir, resume, find_older)


# ================================================================== 2. The training section


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
    hooks = row_hooks(data.train)  # the rows' optional part: RL's rollouts (accumulation/data/rows.py's RowHooks)
    training = build_training(config, vocab_size, resume, context, hooks=hooks)  # the rows may hand it their loss
    hooks.bind_policy(training.model, context, resume)  # rows sampled from the model being trained
    if resume is None:
        counters, skips_in_a_row = Counters(), 0  # a fresh run
    else:  # the optimizer, scheduler, scaler and random states of the checkpoint
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
            training.setup.module.train()
            result = training.step(  # optimizer_step (accumulation/step.py), or its out-of-memory retry
                training.setup,
                micro_batches,
                training.optimizer,
                global_counts=global_counts,
                stop_requested=lambda: stop.requested,  # read at the step's boundary
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
            stop_reason = nonfinite_stop_reason(config, result, training, skips_in_a_row)
            checkpointer.maybe_save(counters, skips_in_a_row, now=stop_reason is not None or result.stop_requested)
            if stop_reason is not None:
                return stopped_at_a_bad_step(counters, stop_reason, run_dir, context, say)
            if result.stop_requested and counters.steps < config.run.max_steps:
                return stopped_by_a_signal(counters, stop, say)
        # ---------------------------------------------------------------- TRAINING SECTION END
        if logs.session_steps:  # the last step is validated (should_validate): its record holds the final loss
            logs.summary(counters, record.get("val_loss"), session_start, training.model)
    finally:
        # After an error the process ends at once (fail fast); closing a writer that failed would raise a
        # second error and hide the first.
        if sys.exc_info()[0] is None:
            logs.close()
    return 0


def probe_step_zero(
    config: Config, training: Training, context: DistributedContext, micro_batch: MicroBatch, say
) -> None:
    """accumulation/probe.py on this rank's first micro-batch of step 0: a mean loss is an InexactStep (exit 2);
    BatchNorm in train mode or a loss that couples examples is one warning line (an error with
    batch.on_inexact = "error")."""
    # Training's model.loss, uncompiled (as validation runs it): the probe compares losses, not kernels.
    forward_module, loss_sum_fn = training.evaluation
    for line in probe_loss_and_model(
        forward_module, training.model, loss_sum_fn, micro_batch, context.device, config.batch.on_inexact
    ):
        say(f"warning: not exact: {line}", file=sys.stderr)


# ================================================================== 3. Validation


class Validator:
    """The validation loss on its own cadence of steps (run.eval_every) and at the run's last step, never depending
    on where a session happens to end, so that an interrupted and resumed run writes the same lines as an
    uninterrupted one."""

    def __init__(self, config: Config, data: Data, context: DistributedContext, training: Training) -> None:
        self.config, self.data, self.context, self.training = config, data, context, training

    def should_validate(self, steps: int) -> bool:
        every = self.config.run.eval_every
        last = steps == self.config.run.max_steps  # the final loss, logged like the others
        return self.data.val is not None and (last or every > 0 and steps % every == 0)

    def loss(self, micro_batch_size: int) -> float:
        return validation_loss(self.training, self.data, self.config, self.context, micro_batch_size)


# ================================================================== 4. Checkpoints, and the ways a run stops


class Checkpointer:
    """Checkpoints every run.checkpoint_every steps, at the run's last step, and when the run must stop."""

    def __init__(self, config, data: Data, run_dir: Path, context: DistributedContext, training, logs: RunLogs):
        self.config, self.data, self.run_dir, self.context = config, data, run_dir, context
        self.training, self.logs = training, logs
        self.sharded = None  # fsdp2 and pipeline stages: each rank writes its own shards, in the background
        if config.dist.strategy == "fsdp2" or training.pipeline is not None:
            from accumulation.run.sharded_checkpoint import ShardedCheckpointWriter

            self.sharded = ShardedCheckpointWriter(run_dir / "checkpoints", config.run.keep_checkpoints, context)

    def maybe_save(self, counters: Counters, skips_in_a_row: int, now: bool) -> None:
        finished = counters.steps == self.config.run.max_steps
        if counters.steps % self.config.run.checkpoint_every == 0 or finished or now:
            self.save(counters, skips_in_a_row, at_once=finished or now)  # the last: on the disk before exit

    def save(self, counters: Counters, skips_in_a_row: int, at_once: bool = False) -> None:
        training, context = self.training, self.context
        states = training.model, training.optimizer, training.scheduler, training.setup.scaler
        payload = checkpoint_payload(self.config, self.data.summary, *states, counters, skips_in_a_row, context)
        rows_state = row_hooks(self.data.train).state_dict()  # what a resume cannot redraw (RL: the round's rollout)
        if rows_state:
            payload["data"]["rollouts"] = rows_state
        if context.is_main:
            # The logs of every step up to this one reach the disk before the checkpoint that covers them: a
            # resume keeps them and runs only the later steps again.
            self.logs.flush()
        if self.sharded is not None:  # as run.sharded_save says, while training goes on unless `at_once`
            how = "at_once" if at_once else self.config.run.sharded_save
            self.sharded.save(payload, training.optimizer, counters.steps, how, training.pipeline)
        elif context.is_main:
            save_checkpoint(payload, self.run_dir / "checkpoints", counters.steps, self.config.run.keep_checkpoints)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
