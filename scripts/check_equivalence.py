"""Check that one optimizer step of the loop follows the gradient of the full-batch mean loss.

For anyone who changed the model, the loss, the data or the step: run it with the config you train with.

    python scripts/check_equivalence.py [--config FILE] [section.key=value ...] [--inject-bug mean-of-means|mask]
    torchrun --standalone --nproc_per_node=N scripts/check_equivalence.py [same arguments]

The loop side is one optimizer step exactly as train.py runs it: the model from `build_model` (the factory
train.py uses), the examples of step 0 of the data order, split into this rank's A micro-batches of m rows
by the loop's own batching and masking code, and `optimizer_step` with the configured loss and precision.
The gradient is read when the optimizer is handed it, i.e. after accumulation, DDP's all-reduce and
unscaling. Two settings are switched off, because no reference could reproduce them: gradient clipping
(it rescales the gradient by the step's own norm) and dropout (its random masks).

The reference is computed independently, on rank 0 only. Its rows are rebuilt from the raw examples (the
prompt and response tokens each row was made from) with the simplest possible code, not with the loop's
batching or masking. Then one float64 forward and backward over all of the step's rows at once, of the
configured loss's SUM divided by the number of supervised targets N: the mean loss of the whole global
batch, which is what every update must follow. No micro-batches, no ranks, no weighting of ours.

What a PASS proves: for this config's model, loss, data and batch split (m, A, D), the step's gradient and
logged loss equal the full-batch ones within the precision's tolerance, every rank starts from the same
weights, and the step saw the same examples and supervised tokens as the reference. What it does not:
anything about clipping, dropout, later steps, the optimizer's update rule, or the correctness of the loss
function itself (the reference uses the same loss; it checks how the loop weights and masks it).

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).
"""

import argparse
import dataclasses
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, describe_batch
from accumulation.build import autocast_dtype_for, check_config_for_world, set_tf32, wrap_for_training
from accumulation.config import Config, ConfigError, load_config, resolved_compile, resolved_grad_scaler
from accumulation.data import Data, DataError, RowSet, build_data, build_micro_batches, step_row_ids
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

INJECTABLE_BUGS = {
    "mean-of-means": "the loop weights every micro-batch equally (each micro-batch's mean loss)",
    "mask": "the loop supervises the prompt positions too (the prompt mask is ignored)",
}


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
    try:
        config = load_config(config_argv)
        check_config_for_world(config, world_size)
        data = build_data(config)
        vocab_size = resolved_vocab_size(config, data.vocab_size)
        row_ids = step_row_ids(
            data.train.num_rows, config.batch.global_batch_size, config.run.seed, 0, config.batch.tail
        )
        if arguments.inject_bug == "mask" and not any(data.train.raw_example(i).prompt for i in row_ids.tolist()):
            raise DataError(
                "--inject-bug mask needs rows with prompt positions, and step 0 of this data has none; "
                "run it on prompt/response data, e.g. --config configs/sft.toml"
            )
    except (ConfigError, DataError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    context = setup_distributed(config.device, config.dist.timeout_s)
    try:
        return check(config, data, vocab_size, row_ids, context, arguments.inject_bug)
    finally:
        teardown_distributed()


def check(
    config: Config, data: Data, vocab_size: int, row_ids: torch.Tensor, context: DistributedContext, bug: str | None
) -> int:
    config = without_dropout(config)
    set_tf32(False)  # whatever precision.tf32 says: TF32 rounds fp32 products to ~1e-3, above the fp32 tolerance
    model = build_model(config, vocab_size).to(context.device)
    reference_model = build_model(config, vocab_size).double()  # a second build: it must equal the first
    same_initial_weights = weights_agree_across_builds_and_ranks(model, reference_model, context)

    loop_gradients, result = loop_step_gradients(config, data, row_ids, model, context, bug)
    if not context.is_main:
        return 0
    batch = describe_batch(config.batch.global_batch_size, config.batch.micro_batch_size, context.world_size)
    print(
        f"check_equivalence: {batch}; step 0: {len(row_ids)} examples; device {context.device}; "
        f"precision {config.precision.dtype}"
    )
    print(
        f"model: {type(model).__name__} ({config.model.name}), {count_parameters(config, vocab_size):,} parameters "
        f"from accumulation.models.build_model; compared with gradient clipping and dropout off"
    )
    if bug:
        print(f"SELF-TEST: --inject-bug {bug}: {INJECTABLE_BUGS[bug]}; this must FAIL")
    if not same_initial_weights:
        print("initial weights: two builds from the same seed, or two ranks, differ: initialise from config.run.seed")
        print("FAIL")
        return 1
    if loop_gradients is None:
        print(f"FAIL: the loop did not apply its update ({result.skip_reason}), so there is no gradient to compare")
        return 1

    inputs, labels = reference_rows(data.train, row_ids, config.data.seq_len)
    reference_gradients, reference_loss = float64_full_batch(reference_model, inputs, labels, config)
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
        result.examples == len(row_ids)
        and result.tokens == reference_tokens
        and relative_error <= tolerance
        and loss_relative_error <= tolerance
    )
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


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


def loop_step_gradients(config, data: Data, row_ids, model, context: DistributedContext, bug: str | None):
    """One optimizer step the loop's way, without clipping; returns (the gradients the optimizer was handed,
    or None when the update was skipped; the StepResult).

    The optimizer never moves the weights; it records the gradient of the update as it is handed it."""
    # model.loss and model.compile as train.py resolves them: the plain or the chunked loss, compiled or not.
    compiled = resolved_compile(config, context.device.type)
    forward_module, loss_sum_fn = training_forward_and_loss(config, model, context.device.type, compile=compiled)
    wrapped = wrap_for_training(forward_module, config, context)
    optimizer, handed = first_update_probe(model)
    rows = data.train
    if bug == "mask":  # SELF-TEST ONLY: the loop's rows supervise every real target, the prompt's included
        rows = dataclasses.replace(rows, supervised=every_real_target(rows))
    micro_batches = build_micro_batches(
        rows,
        row_ids,
        config.batch.global_batch_size,
        config.batch.micro_batch_size,
        context.world_size,
        context.rank,
    )
    if bug == "mean-of-means":
        loss_sum_fn = mean_of_means_loss(loss_sum_fn, micro_batches, context)
    result = optimizer_step(
        wrapped,
        micro_batches,
        optimizer,
        device=context.device,
        scaler=torch.amp.GradScaler(context.device.type, enabled=resolved_grad_scaler(config)),
        loss_sum_fn=loss_sum_fn,
        autocast_dtype=autocast_dtype_for(config),
    )
    return (handed[0] if result.applied else None), result


def reference_rows(rows: RowSet, row_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and labels rebuilt from the raw examples, one row per example.

    A row is the example's tokens, prompt then response, cut to seq_len + 1. Input position j predicts token
    j + 1, which is supervised exactly when it is a response token. Unused positions are padding."""
    inputs = torch.zeros(len(row_ids), seq_len, dtype=torch.long)
    labels = torch.full((len(row_ids), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, row_id in enumerate(row_ids.tolist()):
        example = rows.raw_example(row_id)
        tokens = (example.prompt + example.response)[: seq_len + 1]
        for j in range(len(tokens) - 1):
            inputs[row, j] = tokens[j]
            if j + 1 >= len(example.prompt):
                labels[row, j] = tokens[j + 1]
    return inputs, labels


def float64_full_batch(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, config: Config):
    """∇ of the mean loss over every supervised target of the step as one float64 batch, and that loss."""
    loss_sum_fn = loss_sum_fn_for(config)
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


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
