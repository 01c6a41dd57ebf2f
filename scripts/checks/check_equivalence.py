"""Check that one optimizer step of the loop follows the gradient of the full-batch mean loss, and that the
fork keeps the promises the step relies on.

For anyone who changed the model, the loss, the data or the step: run it with the config you train with.

    python scripts/checks/check_equivalence.py [--config FILE] [section.key=value ...] [--inject-bug BUG]
    torchrun --standalone --nproc_per_node=N scripts/checks/check_equivalence.py [same arguments]

The loop side is one optimizer step exactly as train.py runs it: the model from `build_model` (the factory
train.py uses), the rows of step 0 as `step_batch` builds them for train.py (the step's row ids, the rows as
step 0 sees them, this rank's A micro-batches of m rows), and `optimizer_step` with the configured loss and
precision and with `global_counts`, N summed from the data's `supervised_counts`, as train.py passes it.
The gradient is read when the optimizer is handed it, i.e. after accumulation, DDP's all-reduce and
unscaling. Two settings are switched off, because no reference could reproduce them: gradient clipping
(it rescales the gradient by the step's own norm) and dropout (its random masks).

The reference is computed independently, on rank 0 only. Its rows are rebuilt from the raw examples (each
row's input tokens and its targets, position by position: accumulation/rows.py, RawExample) with the
simplest possible code, not with the loop's batching or masking. Then one float64 forward and backward over
all of the step's rows at once, of the configured loss's SUM divided by the number of supervised targets N:
the mean loss of the whole global batch, which is what every update must follow. No micro-batches, no ranks,
no weighting of ours.

The fork's promises, checked one by one and named when they fail (each independent of m, A and D):
    rows            every rank builds the step's rows twice: the same in both calls and on every rank (rows
                    are a pure function of (seed, step, row id))
    supervised_counts vs the raw examples' targets, and vs the labels of examples() on every rank (the check
                    train.py makes every step)
    loss_sum_fn     is a sum: its value over the step's rows equals the sum of its values over two halves (a
                    mean is not, and hides behind A·D = 1)

What a PASS proves: for this config's model, loss, data and batch split (m, A, D), the step's gradient and
logged loss equal the full-batch ones within the precision's tolerance, every rank starts from the same
weights, the step saw the same examples and supervised tokens as the reference, and the promises above
hold for step 0. What it does not: anything about clipping, dropout, later steps, the optimizer's update
rule, or the correctness of the loss function itself (the reference uses the same loss; it checks how the
loop weights and masks it).

--inject-bug puts a known bug in and must FAIL: in the loop (mean-of-means, mask) or in the fork's data or
loss (count, supervise-all, rank-mask on 2 ranks, mean-loss); see INJECTABLE_BUGS.

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).
"""

import argparse
import dataclasses
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, describe_batch, map_inputs
from accumulation.build import autocast_dtype_for, check_config_for_world, set_tf32, wrap_for_training
from accumulation.config import Config, ConfigError, load_config, resolved_compile, resolved_grad_scaler
from accumulation.data import (
    DataError,
    RawExample,
    Rows,
    RowSet,
    StepBatch,
    build_data,
    check_supervised_counts,
    rows_from_raw_examples,
    step_batch,
)
from accumulation.distributed import DistributedContext, run_and_exit, setup_distributed, teardown_distributed
from accumulation.models import (
    build_model,
    count_parameters,
    loss_sum_fn_for,
    resolved_vocab_size,
    training_forward_and_loss,
)
from accumulation.step import all_reduce_ints, count_supervised_tokens, optimizer_step
from testkit.reference import first_update_probe, max_relative_error, without_dropout

# Tolerance on max |loop - reference| / max |reference| over all gradient entries, by the loop's precision.
# fp32: float32 rounds each operation to 2^-24 ≈ 6e-8 relative. Through a few layers, sums of a few
# thousand terms and the softmax, the loop's gradient lands about 1e-7..1e-6 of the largest entry away
# from the float64 one on the small models this is meant for; 3e-5 leaves a wide margin while a wrong
# weighting of micro-batches or ranks (mean of means, a forgotten factor D) is off by 1e-2 or more.
# bf16 keeps 8 significant bits (2^-9 ≈ 2e-3 per rounding); a few dozen roundings add up to about 1e-2
# of the largest entry, so 5e-2 (the bound tests/test_step.py uses for bf16 against fp32).
# fp16 keeps 11 bits (2^-12 ≈ 2.4e-4 per rounding), eight times finer than bf16: 1e-2.
# A wrong normalization is wrong in every precision, and may be as small as a few 1e-2: check changes to
# the loss or the step in fp32, where the margin is a factor of 1000; bf16 and fp16 runs show that
# autocast did not break the model.
RELATIVE_TOLERANCE = {"fp32": 3e-5, "bf16": 5e-2, "fp16": 1e-2}

# Checks of the fork's own promises, each independent of m, A and D (a bug in them can hide behind a
# particular split: a mean returned as a "sum" is exact when A·D = 1).
# loss_sum_fn's additivity: the float64 sums over two halves of the step's rows and over all of them agree to
# rounding, about 1e-16 per addition over a few thousand targets; 1e-9 is far above that and far below the
# factor of about 2 a mean gives.
ADDITIVITY_TOLERANCE = 1e-9

# Bugs in the loop only (the reference stays right): the checker must see the loop go wrong.
LOOP_BUGS = {
    "mean-of-means": "the loop weights every micro-batch equally (each micro-batch's mean loss)",
    "mask": "the loop supervises the prompt positions too (the prompt mask is ignored)",
}
# Bugs a fork makes in its data or loss (loop and reference both get them): the checker's own tests of the
# fork's promises must catch them.
FORK_BUGS = {
    "count": "the data's supervised_counts promises one target more per row than its labels hold",
    "supervise-all": "the data's labels give every position a target (its own input token), not only the masked",
    "rank-mask": "the data's mask depends on the rank (each rank draws it as if at step + rank)",
    "mean-loss": "loss_sum_fn returns the mean over the micro-batch's targets, not their sum",
}
INJECTABLE_BUGS = {**LOOP_BUGS, **FORK_BUGS}


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's own flags, and the rest: `--config FILE` and `section.key=value`, as train.py takes them."""
    parser = argparse.ArgumentParser(
        description="Compare one optimizer step of the loop with a float64 full-batch reference.",
        epilog="Config keys and their defaults: python train.py --help",
    )
    parser.add_argument("--config", help="TOML config file, as for train.py")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for train.py")
    parser.add_argument(
        "--inject-bug",
        choices=list(INJECTABLE_BUGS),
        help="self-test of this checker: put a known bug into the loop only; the check must then FAIL. "
        + "; ".join(f"{name}: {effect}" for name, effect in INJECTABLE_BUGS.items()),
    )
    arguments = parser.parse_intermixed_args(argv)
    config_argv = (["--config", arguments.config] if arguments.config else []) + arguments.overrides
    return arguments, config_argv


def main(argv: list[str]) -> int:
    arguments, config_argv = parse_arguments(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    bug = arguments.inject_bug
    try:
        config = load_config(config_argv)
        check_config_for_world(config, world_size)
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        vocab_size = resolved_vocab_size(config.model, data.vocab_size)
        rows = BuggyRows(data.train, bug, rank) if bug in FORK_BUGS and bug != "mean-loss" else data.train
        batch = step_batch(
            rows,
            CHECKED_STEP,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=config.batch.micro_batch_size,
            world_size=world_size,
            rank=rank,
        )
        refuse_a_bug_this_data_cannot_show(bug, data.train, batch.row_ids)
    except (ConfigError, DataError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    context = setup_distributed(config.device, config.dist.timeout_s)
    try:
        return check(config, rows, vocab_size, batch, context, bug)
    finally:
        teardown_distributed()


# The step checked: step 0 of the data order, its rows as step 0 sees them.
CHECKED_STEP = 0


def refuse_a_bug_this_data_cannot_show(bug: str | None, rows: Rows, row_ids: torch.Tensor) -> None:
    """A DataError when the self-test's bug would change nothing on this data (so a PASS would mean nothing)."""
    if bug == "mask":
        if not isinstance(rows, RowSet):
            raise DataError("--inject-bug mask rewrites a RowSet's prompt mask; this data's rows are not a RowSet")
        if torch.equal(every_real_target(rows)[row_ids], rows.supervised[row_ids]):
            raise DataError(
                "--inject-bug mask needs rows with prompt positions, and step 0 of this data has none; "
                "run it on prompt/response data, e.g. --config configs/sft.toml"
            )
    if bug == "rank-mask":
        at_first, at_second = rows.examples(row_ids, CHECKED_STEP), rows.examples(row_ids, CHECKED_STEP + 1)
        if all(torch.equal(a, b) for a, b in zip(at_first, at_second, strict=True)):
            raise DataError(
                "--inject-bug rank-mask needs rows that change with the step, and this data's do not; "
                "run it on masked-LM data, e.g. --config configs/mlm.toml"
            )


def check(
    config: Config, rows: Rows, vocab_size: int, batch: StepBatch, context: DistributedContext, bug: str | None
) -> int:
    config = without_dropout(config)
    set_tf32(False)  # whatever precision.tf32 says: TF32 rounds fp32 products to ~1e-3, above the fp32 tolerance
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).to(context.device)
    reference_model = build_model(
        config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed
    ).double()  # a second build: it must equal the first
    same_initial_weights = weights_agree_across_builds_and_ranks(model, reference_model, context)
    loss_sum_fn = mean_loss(loss_sum_fn_for(config.model)) if bug == "mean-loss" else loss_sum_fn_for(config.model)
    same_rows, labels_as_promised = rows_agree_across_calls_and_ranks(rows, batch, context)

    loop_gradients, result = loop_step_gradients(config, rows, batch, model, loss_sum_fn, context, bug)
    if not context.is_main:
        return 0
    row_ids = batch.row_ids
    described = describe_batch(config.batch.global_batch_size, config.batch.micro_batch_size, context.world_size)
    print(
        f"check_equivalence: {described}; step {batch.step}: {len(row_ids)} examples; device {context.device}; "
        f"precision {config.precision.dtype}"
    )
    parameters = count_parameters(config.model, vocab_size, config.data.seq_len)
    print(
        f"model: {type(model).__name__} ({config.model.name}), {parameters:,} parameters "
        f"from accumulation.models.build_model; compared with gradient clipping and dropout off"
    )
    if bug:
        print(f"SELF-TEST: --inject-bug {bug}: {INJECTABLE_BUGS[bug]}; this must FAIL")
    if not same_initial_weights:
        print("initial weights: two builds from the same seed, or two ranks, differ: initialise from config.run.seed")
        print("FAIL")
        return 1

    # The fork's promises, one line each (docs/forking.md, "The promises each guarantee depends on").
    inputs, labels = reference_rows(rows, row_ids, batch.step, config.data.seq_len)
    reference_counts = (labels != IGNORE_INDEX).reshape(len(row_ids), -1).sum(dim=1)
    promises = {
        "rows": same_rows,
        "supervised_counts vs the raw examples' targets": counts_message(batch, reference_counts),
        "supervised_counts vs the labels of examples()": labels_as_promised,
        "loss_sum_fn is a sum": additivity_message(reference_model, loss_sum_fn, inputs, labels),
    }
    for name, failure in promises.items():
        print(f"{name}: {'ok' if failure is None else 'FAIL: ' + failure}")
    if loop_gradients is None:
        print(f"FAIL: the loop did not apply its update ({result.skip_reason}), so there is no gradient to compare")
        return 1

    reference_gradients, reference_loss = float64_full_batch(reference_model, inputs, labels, loss_sum_fn)
    reference_tokens = count_supervised_tokens(labels)
    relative_error = max_relative_error(loop_gradients, reference_gradients)
    loss_relative_error = abs(result.loss - reference_loss) / abs(reference_loss)
    tolerance = RELATIVE_TOLERANCE[config.precision.dtype]
    print(
        f"examples: loop {result.examples}, reference {len(row_ids)}; "
        f"supervised targets: loop {result.tokens:,}, reference {reference_tokens:,}"
    )
    print(f"loss: loop {result.loss:.8f}, reference {reference_loss:.8f} (relative error {loss_relative_error:.2e})")
    print(f"gradient: max relative error {relative_error:.3e} (largest |loop - reference| / largest |reference|)")
    print(
        f"tolerance: {tolerance:g} ({config.precision.dtype} loop against a float64 reference; see RELATIVE_TOLERANCE)"
    )
    passed = (
        all(failure is None for failure in promises.values())
        and result.examples == len(row_ids)
        and result.tokens == reference_tokens
        and relative_error <= tolerance
        and loss_relative_error <= tolerance
    )
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def rows_agree_across_calls_and_ranks(
    rows: Rows, batch: StepBatch, context: DistributedContext
) -> tuple[str | None, str | None]:
    """(why the rows are not a pure function of (seed, step, row id), or None; why this step's labels hold
    other targets than supervised_counts promised on some rank (train.py's own check), or None).

    Every rank builds the whole step's rows twice and hashes them: the two calls, and all ranks, must agree.
    A mask drawn from torch's global generator differs between the calls and between ranks (dropout seeds
    that generator per rank); a mask seeded with the rank differs between ranks."""

    def digest() -> str:
        inputs, labels = rows.examples(batch.row_ids, batch.step)
        counts = rows.supervised_counts(batch.row_ids, batch.step)
        return hashlib.sha256(b"".join(t.numpy().tobytes() for t in (inputs, labels, counts))).hexdigest()

    first, second = digest(), digest()
    try:
        check_supervised_counts(batch)
        mismatch = None
    except DataError as error:
        mismatch = f"rank {context.rank}, {error}"
    everyone = [(first, second, mismatch)]
    if context.world_size > 1:
        everyone = [None] * context.world_size
        dist.all_gather_object(everyone, (first, second, mismatch))
    if any(a != b for a, b, _ in everyone):
        same = "the same row ids at the same step gave other rows in a second call"
    elif len({a for a, _, _ in everyone}) > 1:
        same = "the same row ids at the same step gave other rows on another rank"
    else:
        same = None
    if same is not None:
        same += "; the data's randomness must be a pure function of (seed, step, row id) (docs/forking.md)"
    return same, next((m for _, _, m in everyone if m is not None), None)


def counts_message(batch: StepBatch, reference_counts: torch.Tensor) -> str | None:
    """Where supervised_counts disagrees with the targets of the raw examples, in words; None when it agrees."""
    if torch.equal(batch.supervised_counts, reference_counts):
        return None
    row = int((batch.supervised_counts != reference_counts).nonzero()[0])
    return (
        f"row {int(batch.row_ids[row])} has {int(reference_counts[row])} targets in its raw example, but "
        f"supervised_counts says {int(batch.supervised_counts[row])} (step N {int(batch.supervised_counts.sum()):,} "
        f"instead of {int(reference_counts.sum()):,}): every update would be divided by a wrong N"
    )


def additivity_message(model, loss_sum_fn, inputs: torch.Tensor, labels: torch.Tensor) -> str | None:
    """Whether loss_sum_fn is a SUM over targets: over the step's rows it must equal its value over the first
    half plus its value over the second (float64, no gradient). A mean is not additive; the step divides by the
    global N itself, so a mean would make each micro-batch weigh the same (the mean-of-means bug), which no
    gradient comparison sees when A·D = 1."""
    if len(inputs) < 2:
        return None
    half = len(inputs) // 2
    with torch.no_grad():
        whole = float(loss_sum_fn(model(inputs), labels))
        halves = float(loss_sum_fn(model(inputs[:half]), labels[:half])) + float(
            loss_sum_fn(model(inputs[half:]), labels[half:])
        )
    difference = abs(whole - halves) / max(abs(whole), 1e-300)
    if difference <= ADDITIVITY_TOLERANCE:
        return None
    return (
        f"over the step's rows it gives {whole:.6g}, over its two halves {halves:.6g} in total (relative difference "
        f"{difference:.2e}): return the SUM of the supervised targets' losses, never a mean"
    )


def weights_agree_across_builds_and_ranks(
    model: torch.nn.Module, second_build: torch.nn.Module, context: DistributedContext
) -> bool:
    """A model must start from the same weights on every rank (DDP broadcasts rank 0's, but a resume or a
    checkpoint taken on another rank would not), which holds when it initialises from config.run.seed only.
    Two builds in this process must be bit-identical, and every rank's weights must hash the same."""
    first = [p.detach().cpu() for p in model.parameters()]
    second = [p.detach().float().cpu() for p in second_build.parameters()]  # built float32, then .double()
    same_here = all(torch.equal(a, b.to(a.dtype)) for a, b in zip(first, second, strict=True))
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in first)).hexdigest()
    if context.world_size == 1:
        return same_here
    everyone = [None] * context.world_size
    dist.all_gather_object(everyone, (same_here, digest))
    return all(agree for agree, _ in everyone) and len({digest for _, digest in everyone}) == 1


def loop_step_gradients(config, rows: Rows, batch: StepBatch, model, loss_sum_fn, context, bug: str | None):
    """One optimizer step the loop's way, exactly as train.py calls it (global_counts from supervised_counts),
    without clipping; returns (the gradients the optimizer was handed, or None when the update was skipped;
    the StepResult).

    The optimizer never moves the weights; it records the gradient of the update as it is handed it."""
    # model.loss and model.compile as train.py resolves them: the plain or the chunked loss, compiled or not.
    compiled = resolved_compile(config, context.device.type)
    forward_module, train_loss_sum_fn = training_forward_and_loss(
        config.model, config.dist, model, context.device.type, compile=compiled
    )
    if bug != "mean-loss":  # SELF-TEST ONLY otherwise: the loop keeps the given loss, a mean instead of a sum
        loss_sum_fn = train_loss_sum_fn
    else:
        forward_module = model
    param_dtype = autocast_dtype_for(config.precision)
    wrapped = wrap_for_training(forward_module, config.dist, context, compile=compiled, param_dtype=param_dtype)
    optimizer, handed = first_update_probe(model)
    micro_batches = batch.micro_batches
    if bug == "mask":  # SELF-TEST ONLY: the loop's rows supervise every real target, the prompt's included
        buggy_rows = dataclasses.replace(rows, supervised=every_real_target(rows))
        micro_batches = step_batch(
            buggy_rows,
            batch.step,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=config.batch.micro_batch_size,
            world_size=context.world_size,
            rank=context.rank,
        ).micro_batches
    if bug == "mean-of-means":
        loss_sum_fn = mean_of_means_loss(loss_sum_fn, micro_batches, context)
    # The mask bug is the loop's: its N counts the labels it supervises, as a loop that ignores the mask would.
    global_counts = None if bug == "mask" else batch.global_counts
    result = optimizer_step(
        wrapped,
        micro_batches,
        optimizer,
        device=context.device,
        scaler=torch.amp.GradScaler(context.device.type, enabled=resolved_grad_scaler(config)),
        loss_sum_fn=loss_sum_fn,
        autocast_dtype=autocast_dtype_for(config.precision),
        global_counts=global_counts,
    )
    return (handed[0] if result.applied else None), result


def reference_rows(rows: Rows, row_ids: torch.Tensor, step: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and labels rebuilt from the raw examples, one row per example, position by position:
    input j is the example's j-th input token (0 past its end), label j its target at j (-100 where none), or
    one label per row when the examples carry one; inputs that are not token ids (images, features) are the
    examples' tensors, in float64 when they are floating point, as the reference model is. Nothing of the loop's
    batching or masking code is used (accumulation/rows.py, rows_from_raw_examples)."""
    examples = [rows.raw_example(row_id, step) for row_id in row_ids.tolist()]
    inputs, labels = rows_from_raw_examples(examples, seq_len)
    return map_inputs(lambda tensor: tensor.double() if tensor.is_floating_point() else tensor, inputs), labels


def float64_full_batch(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_sum_fn):
    """∇ of the mean loss over every supervised target of the step as one float64 batch, and that loss."""
    mean_loss = loss_sum_fn(model(inputs), labels) / count_supervised_tokens(labels)
    mean_loss.backward()
    return [p.grad for p in model.parameters()], mean_loss.item()


def every_real_target(rows: RowSet) -> torch.Tensor:
    """SELF-TEST ONLY: the supervision mask with the prompt forgotten: every target of the row's real tokens."""
    return torch.arange(rows.seq_len) < (rows.lengths[:, None].long() - 1)


def mean_of_means_loss(loss_sum_fn, micro_batches, context: DistributedContext):
    """SELF-TEST ONLY: the classic accumulation mistake as a loss. Each micro-batch backpropagates its MEAN
    loss, rescaled by the average token count per micro-batch so that the overall size of the gradient stays
    right: every micro-batch then weighs the same, whatever its token count, which is wrong whenever the
    counts differ. The step multiplies by D / N, so the gradient becomes that of the mean of micro-batch means."""
    [tokens_global] = all_reduce_ints([sum(count_supervised_tokens(mb.labels) for mb in micro_batches)], context.device)
    tokens_per_micro_batch = tokens_global / (len(micro_batches) * context.world_size)

    def micro_batch_mean_times_average_count(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)  # an empty micro-batch still adds exactly zero
        return loss_sum_fn(outputs, labels) / tokens * tokens_per_micro_batch

    return micro_batch_mean_times_average_count


def mean_loss(loss_sum_fn):
    """SELF-TEST ONLY: a fork's loss that returns the MEAN over the micro-batch's supervised targets."""

    def mean(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum_fn(outputs, labels) / (labels != IGNORE_INDEX).sum().clamp(min=1)

    return mean


class BuggyRows:
    """SELF-TEST ONLY: a fork's data with one of FORK_BUGS, around the configured rows. Its raw examples are
    the data's own (what each row was meant to be); examples() and supervised_counts() carry the bug."""

    def __init__(self, rows: Rows, bug: str, rank: int):
        self.rows, self.bug, self.rank = rows, bug, rank
        self.num_rows, self.seq_len = rows.num_rows, rows.seq_len

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bug == "rank-mask":  # a mask seeded with the rank: other masks on each rank for the same row
            return self.rows.examples(row_ids, step + self.rank)
        inputs, labels = self.rows.examples(row_ids, step)
        if self.bug == "supervise-all":
            labels = torch.where(labels == IGNORE_INDEX, inputs, labels)
        return inputs, labels

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        if self.bug == "rank-mask":
            return self.rows.supervised_counts(row_ids, step + self.rank)
        return self.rows.supervised_counts(row_ids, step) + (1 if self.bug == "count" else 0)

    def raw_example(self, row_id: int, step: int) -> RawExample:
        return self.rows.raw_example(row_id, step)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
