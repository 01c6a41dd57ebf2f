"""The checker's command and its verdict: main(argv) parses the arguments as the script takes them, builds
the config's data and step-0 rows, and check() runs the loop's step, the reference and the fork's promises and
prints one line each, then PASS or FAIL (accumulation/checker/__init__.py says what a PASS proves).

The loop's side is loop_step_gradients: one optimizer step as train.py runs it for the configured layout. A
layout whose step is not optimizer_step over a DDP/FSDP2-wrapped model (pipeline stages) plugs in there, and
only there: everything else compares the gradient it returns with the reference.
"""

import argparse
import dataclasses
import os
import sys

import torch

from accumulation.batching import IGNORE_INDEX, describe_batch
from accumulation.build import autocast_dtype_for, check_config_for_world, set_tf32, wrap_for_training
from accumulation.checker.promises import (
    additivity_message,
    counts_message,
    rows_agree_across_calls_and_ranks,
    weights_agree_across_builds_and_ranks,
)
from accumulation.checker.reference import (
    first_update_probe,
    float64_full_batch,
    max_relative_error,
    reference_rows,
    without_dropout,
)
from accumulation.checker.self_test import (
    FORK_BUGS,
    INJECTABLE_BUGS,
    BuggyRows,
    every_real_target,
    mean_loss,
    mean_of_means_loss,
    refuse_a_bug_this_data_cannot_show,
)
from accumulation.config import Config, ConfigError, load_config, resolved_compile, resolved_grad_scaler
from accumulation.data import DataError, Rows, StepBatch, build_data, step_batch
from accumulation.distributed import DistributedContext, setup_distributed, teardown_distributed
from accumulation.models import (
    build_model,
    count_parameters,
    loss_sum_fn_for,
    resolved_vocab_size,
    training_forward_and_loss,
)
from accumulation.step import count_supervised_tokens, optimizer_step

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
        refuse_a_bug_this_data_cannot_show(bug, data.train, batch.row_ids, CHECKED_STEP)
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
