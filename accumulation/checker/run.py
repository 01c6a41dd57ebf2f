"""The checker's command and its verdict: main(argv) parses the arguments as the script takes them, builds
the config's data and step-0 rows, and check() runs the loop's step, the reference and the fork's promises and
prints one line each, then PASS or FAIL (accumulation/checker/__init__.py says what a PASS proves).

The loop's side is loop_step_gradients: one optimizer step as train.py runs it for the configured layout. With
dist.pipeline_stages = P > 1 (under torchrun, world size D × P) it is train.py's pipelined step instead
(pipelined_step_gradients: the replica's micro-batches through the stages in one schedule step, the stages'
gradients gathered into the whole model's on rank 0; two such steps on the same weights, each compared):
everything else compares the gradient it returns with the reference.
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, count_supervised_tokens, describe_batch
from accumulation.checker.objective_reference import (
    bind_initial_policy,
    extras_message,
    promise_keywords,
    raw_extras,
    refuse_a_step_without_gradient,
    step_reference,
)
from accumulation.checker.promises import (
    NotApplicable,
    counts_message,
    determinism_message,
    first_failure,
    labels_message,
    loss_promises,
    row_independence_message,
    rows_agree_across_calls_and_ranks,
    stages_message,
    weights_agree_across_builds_and_ranks,
)
from accumulation.checker.reference import (
    as_float64,
    clipped,
    first_update_probe,
    max_relative_error,
    parameters_compared,
    reference_rows,
    switch_off_dropout,
    trainable_gradients,
    without_dropout,
)
from accumulation.checker.self_test import (
    DATA_BUGS,
    INJECTABLE_BUGS,
    LOSS_BUGS,
    BuggyRows,
    RowsNormalisedTogether,
    check_bug_fits_the_layout,
    every_real_target,
    in_batch_negatives_loss,
    mean_loss,
    mean_of_means_loss,
    refuse_a_bug_this_data_cannot_show,
    shifted_again_loss,
    targets_per_micro_batch,
)
from accumulation.config.config import Config, ConfigError, load_config
from accumulation.data.rows import DataError, RowHooks, Rows, row_hooks
from accumulation.data.sources import StepBatch, build_data, step_batch
from accumulation.models.factory import (
    build_model,
    build_model_on_meta,
    loss_sum_fn_for,
    resolved_vocab_size,
)
from accumulation.parallel.distributed import DistributedContext, setup_distributed, teardown_distributed
from accumulation.parallel.mesh import layout_of
from accumulation.parallel.pipeline import check_model_splits
from accumulation.probe import StepZeroFailed, outputs_and_loss
from accumulation.run.build import Training, build_training, check_config_for_world, set_tf32
from accumulation.step import StepResult

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


def check_outputs_fit_the_loss(model: torch.nn.Module, loss_sum_fn, micro_batch: MicroBatch, device) -> None:
    """StepZeroFailed unless the model's forward and the loss run on `micro_batch` (for the checker, which has no
    step-0 probe). In eval mode, so that nothing is drawn or updated; the model is left in the mode it was in."""
    batch = micro_batch.to(device)
    was_training = model.training
    model.eval()
    try:
        outputs_and_loss(model, loss_sum_fn, batch.inputs, batch.labels, batch.extras)
    finally:
        model.train(was_training)


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
        help="self-test of this checker: put a known bug into the loop or the fork; the check must then FAIL. "
        + "; ".join(f"{name}: {effect}" for name, effect in INJECTABLE_BUGS.items()),
    )
    parser.add_argument(
        "--step",
        type=int,
        default=0,
        help="the optimizer step of the data order whose rows are checked (default 0), as that step sees them; "
        "the weights are the initial ones whatever the step (a GRPO step's rollout is sampled from them)",
    )
    arguments = parser.parse_intermixed_args(argv)
    if arguments.step < 0:
        parser.error(f"--step counts optimizer steps from 0, got {arguments.step}")
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
        check_bug_fits_the_layout(bug, config)
        layout = layout_of(world_size, rank, config.dist.pipeline_stages)  # the stages of a replica: the same rows
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        vocab_size = resolved_vocab_size(config.model, data.vocab_size)
        # dist.pipeline_stages > 1: the model's pipeline_split, at most one stage a block
        check_model_splits(build_model_on_meta(config.model, vocab_size, config.data.seq_len), config)
        rows = BuggyRows(data.train, bug, layout.replica) if bug in DATA_BUGS else data.train
        bind_initial_policy(data.train, config, vocab_size, rank, arguments.step)  # rows sampled from the model (RL)
        batch = step_batch(
            rows,
            arguments.step,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=config.batch.micro_batch_size,
            world_size=layout.replicas,
            rank=layout.replica,
        )
        micro_batch_targets = targets_per_micro_batch(
            batch, config.batch.global_batch_size, config.batch.micro_batch_size, layout.replicas
        )
        refuse_a_bug_this_data_cannot_show(bug, data.train, batch.row_ids, arguments.step, micro_batch_targets)
        refuse_a_step_without_gradient(rows, batch.row_ids, arguments.step)
    except (ConfigError, DataError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    context = setup_distributed(config.device, config.dist.timeout_s, config.dist.pipeline_stages)
    try:
        return check(config, rows, vocab_size, batch, context, bug)
    finally:
        teardown_distributed()


def check(
    config: Config, rows: Rows, vocab_size: int, batch: StepBatch, context: DistributedContext, bug: str | None
) -> int:
    """The whole check on every rank: the loop's step everywhere, the comparison on rank 0, which prints one line
    per check and the verdict. Every rank returns the verdict's exit status (0 PASS, 1 FAIL), so that under
    torchrun a FAIL ends all ranks alike, none killed by the launcher while it still prints."""
    configured_dropout = config.model.dropout
    config = without_dropout(config)
    # whatever precision.tf32 says: TF32 rounds fp32 products to ~1e-3, above the fp32 tolerance
    config = dataclasses.replace(config, precision=dataclasses.replace(config.precision, tf32=False))
    set_tf32(False)
    model, dropout_off = build_checked_model(config, vocab_size, bug)
    model = model.to(context.device)
    reference_model, _ = build_checked_model(config, vocab_size, bug)  # a second build: it must equal the first
    reference_model = reference_model.double()
    if configured_dropout > 0:
        dropout_off.insert(0, f"model.dropout ({configured_dropout:g} -> 0)")
    hooks = row_hooks(rows)  # RL rollouts hand the step their declared loss (RowHooks.loss_sum_fn)
    loss_sum_fn = checked_loss_sum_fn(config, hooks, bug)
    try:  # before any collective: every rank finds it on its own rows, and every rank says so (as train.py)
        check_outputs_fit_the_loss(model, loss_sum_fn, batch.micro_batches[0], context.device)
    except StepZeroFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    same_initial_weights = weights_agree_across_builds_and_ranks(model, reference_model, context)
    same_rows, labels_as_promised = rows_agree_across_calls_and_ranks(rows, batch, context)

    if bug == "mean-of-means":  # SELF-TEST ONLY: it wraps the loss, so forward and loss are not compiled as one
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, compile=False))
    # The loop as train.py builds it (model.loss, compile, the wrapper, the strategy, the scaler, optim.grad_clip,
    # batch.on_oom), from the checker's model; SELF-TEST ONLY: a buggy loss replaces the configured one.
    buggy_loss = loss_sum_fn if bug in LOSS_BUGS else None
    training = build_training(config, vocab_size, None, context, model=model, loss_sum_fn=buggy_loss, hooks=hooks)
    # The recording optimizer fused where the configured one is (fused AdamW on CUDA): the update then queued on
    # the device (accumulation/update_on_device.py), as train.py's
    fused = all(group.get("fused") for group in training.optimizer.param_groups)
    if context.pipelined:
        loop_gradients, result, loss_path = pipelined_step_gradients(batch, training, fused, context, config, bug)
    else:
        loop_gradients, result, loss_path = loop_step_gradients(config, rows, batch, training, fused, context, bug)
    found = FoundOnEveryRank(
        same_initial_weights,
        same_rows,
        labels_as_promised,
        type(model).__name__,
        dropout_off,
        loss_path,
        fused,
        loop_gradients,
        result,
    )
    failure = None
    if context.is_main:
        failure = compare_on_main(config, rows, vocab_size, batch, context, bug, reference_model, loss_sum_fn, found)
    return agree_on_the_verdict(failure, context)


@dataclasses.dataclass
class FoundOnEveryRank:
    """What the collective part of the check found, for rank 0's comparison."""

    same_initial_weights: bool  # two builds and every rank start from the same weights
    same_rows: str | None  # why the rows differ between calls or ranks, or None
    labels_as_promised: str | None  # why some rank's labels hold other targets than supervised_counts, or None
    model_class: str  # the loop's model as it ran (FSDP2 changes its class)
    dropout_off: list[str]  # the dropout the checker switched off, in words ("13 Dropout modules (p 0.1 -> 0)")
    loss_path: str  # which loss path the loop ran, in words
    fused_update: bool  # whether the loop's optimizer was fused (as configured): its update queued on the device
    loop_gradients: list | None  # per step the loop ran, the gradient its optimizer was handed; None: skipped
    result: StepResult


def compare_on_main(
    config: Config,
    rows: Rows,
    vocab_size: int,
    batch: StepBatch,
    context: DistributedContext,
    bug: str | None,
    reference_model: torch.nn.Module,
    loss_sum_fn,
    found: FoundOnEveryRank,
) -> str | None:
    """Rank 0's part: print one line per check, then PASS or FAIL; returns the first failing line, or None."""
    loop_gradients, result = found.loop_gradients, found.result
    row_ids = batch.row_ids
    stages = config.dist.pipeline_stages
    described = describe_batch(config.batch.global_batch_size, config.batch.micro_batch_size, context.replicas, stages)
    if stages > 1:
        described += f"; {stages} pipeline stages ({config.dist.pipeline_schedule}), {context.world_size} ranks"
    print(
        f"check_equivalence: {described}; step {batch.step}: {len(row_ids)} examples; device {context.device}; "
        f"precision {config.precision.dtype}"
    )
    parameters = parameters_compared(reference_model)
    dropout_off = "; ".join(found.dropout_off) or "none was on"
    print(
        f"model: {found.model_class} ({config.model.name}), {parameters} "
        f"from accumulation.models.factory.build_model; compared with dropout off: {dropout_off}"
    )
    clipping = f"at optim.grad_clip = {config.optim.grad_clip:g}" if config.optim.grad_clip > 0 else "off"
    print(
        f"the step as train.py runs it: gradient clipping {clipping}, batch.on_oom = {config.batch.on_oom}, "
        f"{'a fused' if found.fused_update else 'an unfused'} optimizer, as configured; "
        "not checked: the optimizer's own update (a learning-rate-0 SGD records the gradient it is handed), "
        "dropout, TF32, and the steps after the first from the initial weights"
    )
    print(
        f"loss path: {found.loss_path}; the reference: {function_name(loss_sum_fn)} on the model's outputs, in float64"
    )
    if bug:
        print(f"SELF-TEST: --inject-bug {bug}: {INJECTABLE_BUGS[bug]}; this must FAIL")
    if not found.same_initial_weights:
        return report(
            {"initial weights": "two builds from the same seed, or two ranks, differ: initialise from config.run.seed"}
        )

    # The fork's promises, one line each (docs/forking.md, "The promises each guarantee depends on").
    inputs, labels = reference_rows(rows, row_ids, batch.step, config.data.seq_len)
    float_inputs = as_float64(inputs)
    example_inputs, example_labels, *optional_extras = rows.examples(row_ids, batch.step)
    example_extras = optional_extras[0] if optional_extras else {}  # a third item: what the loss reads besides
    extras = raw_extras(rows, row_ids, batch.step)
    reference_counts = (labels != IGNORE_INDEX).reshape(len(row_ids), -1).sum(dim=1)
    with torch.no_grad():
        fixed_outputs = reference_model.train()(float_inputs)  # the outputs the additivity check holds fixed
    extras_check = extras_message(example_extras, extras, row_ids)
    checks = {
        "rows": found.same_rows,
        "examples() vs the raw examples": labels_message(example_inputs, example_labels, inputs, labels, row_ids),
        "extras of examples() vs the raw examples": extras_check,
        "supervised_counts vs the raw examples' targets": counts_message(batch, reference_counts),
        "supervised_counts vs the labels of examples()": found.labels_as_promised,
        "forward deterministic": determinism_message(reference_model, float_inputs, found.dropout_off),
        "rows independent": row_independence_message(reference_model, float_inputs),
    }
    # Extras that disagree: the loss's checks and the reference would not run the loss the loop trains.
    extras_differ = extras_check is not None and not isinstance(extras_check, NotApplicable)
    keywords = promise_keywords(rows, batch.step, extras)  # on a GRPO step, the surrogate's advantages and the like
    notes = loss_promises(checks, loss_sum_fn, fixed_outputs, labels, keywords, skip=extras_differ)
    if context.pipelined:  # the loop trains the stages: they must compute the reference's forward
        checks["pipeline stages compute the forward"] = stages_message(reference_model, stages, float_inputs)
    if loop_gradients is None:
        checks["update"] = (
            f"the loop did not apply its update ({result.skip_reason}), so there is no gradient to compare"
        )
    if loop_gradients is None or extras_differ:  # no gradient, or a reference of another objective: no figures
        return report(checks, notes)

    # The figures, each beside the same step without accumulation (A = 1, D = 1) in the loop's precision.
    baseline_model, _ = build_checked_model(config, vocab_size, bug)
    baseline_model = baseline_model.to(context.device)
    reference = step_reference(
        rows, batch.step, inputs, labels, extras, loss_sum_fn, reference_model, baseline_model, config, context
    )
    reference_tokens = count_supervised_tokens(labels)
    tolerance = RELATIVE_TOLERANCE[config.precision.dtype]
    # The reference clipped by its own norm, from the definition; the same step without accumulation likewise.
    reference_gradients, reference_norm = clipped(reference.gradients, config.optim.grad_clip)
    baseline_gradients, baseline_norm = clipped(reference.baseline_gradients, config.optim.grad_clip)
    reference_loss = reference.loss
    promise_failed = first_failure(checks)  # a failing promise makes loop and reference differ, not accumulation
    gradient_error = max(max_relative_error(step_gradients, reference_gradients) for step_gradients in loop_gradients)
    baseline_error = max_relative_error(baseline_gradients, reference_gradients)
    loss_error = abs(result.loss - reference_loss) / reference.loss_scale
    baseline_loss_error = abs(reference.baseline_loss - reference_loss) / reference.loss_scale
    allowed, floor_note = allowed_error(tolerance, baseline_error)
    allowed_loss, _ = allowed_error(tolerance, baseline_loss_error)
    # ‖g‖ before clipping (StepResult.grad_norm): where the clip binds, a gradient off by a constant factor (a
    # wrong N) is clipped to the reference's, and only its norm shows it.
    norm_error = abs(result.grad_norm - reference_norm) / reference_norm
    baseline_norm_error = abs(baseline_norm - reference_norm) / reference_norm
    allowed_norm, _ = allowed_error(tolerance, baseline_norm_error)
    at_once = f"A = 1, D = 1 in {config.precision.dtype}"
    if config.optim.grad_clip > 0:
        factor = config.optim.grad_clip / (reference_norm + 1e-6)
        binds = f"binds: the reference scaled by {factor:.4g}" if factor < 1 else "does not bind"
        print(
            f"gradient clipping: the reference's norm {reference_norm:.6g}, optim.grad_clip "
            f"{config.optim.grad_clip:g}: {binds}"
        )
    checks["examples"] = None if result.examples == len(row_ids) else "the loop counted other examples than the step's"
    checks["supervised targets"] = (
        None if result.tokens == reference_tokens else "the loop's N is not the raw examples' count of targets"
    )
    same_n = (result.unit, result.normaliser) == (reference.unit, reference.normaliser)
    checks["normaliser"] = None if same_n else "the loop's N is not the objective's, counted from its definition"
    checks["loss"] = None if loss_error <= allowed_loss else f"the logged loss is off by more than {allowed_loss:.1e}"
    if checks["loss"] and promise_failed:
        checks["loss"] += f": explained by '{promise_failed}' above"
    checks["gradient norm"] = (
        None if norm_error <= allowed_norm else f"the norm before clipping is off by more than {allowed_norm:.1e}"
    )
    if gradient_error <= allowed:
        checks["gradient"] = None
    elif reference.loss_alone is not None:  # a declared objective that the configured loss does not compute
        checks["gradient"] = reference.loss_alone
    elif baseline_error <= allowed:  # after a failing promise, loop and reference ran different objectives
        cause = f", the same step at {at_once} is within it: accumulation, not rounding"
        cause = f": explained by '{promise_failed}' above" if promise_failed else cause
        checks["gradient"] = f"the accumulated gradient is off by more than {allowed:.1e}{cause}"
    else:
        checks["gradient"] = (
            f"the accumulated gradient is off by more than {allowed:.1e}, and so is the same step at {at_once}: "
            "the model's own forward is too far from float64 to check accumulation (see the lines above)"
        )
    notes["gradient"] = floor_note
    figures = {
        "examples": f"loop {result.examples}, reference {len(row_ids)}",
        "supervised targets": f"loop {result.tokens:,}, reference {reference_tokens:,}",
        "normaliser": f"loop {result.unit} = {result.normaliser:g}, "
        f"reference {reference.unit} = {reference.normaliser:g} (from the objective's definition)",
        "loss": f"loop {result.loss:.8f}, reference {reference_loss:.8f}, relative error {loss_error:.2e} "
        f"({at_once}: {baseline_loss_error:.2e})",
        "gradient norm": f"loop {result.grad_norm:.8g}, reference {reference_norm:.8g}, relative error "
        f"{norm_error:.2e} ({at_once}: {baseline_norm_error:.2e})",
        "gradient": f"max relative error {gradient_error:.3e} ({at_once}: {baseline_error:.3e}; allowed {allowed:.1e}, "
        f"the {config.precision.dtype} tolerance against float64 being {tolerance:g}; "
        "largest |loop - reference| / largest |reference|)",
    }
    if reference.ratio_figure is not None:  # an off-policy GRPO step: where the importance ratio's clip binds
        checks["importance ratio"] = None if reference.clipped_tokens else NotApplicable("the clip binds on no token")
        figures["importance ratio"] = reference.ratio_figure
    return report(checks, notes, figures)


# When the same step without accumulation (A = 1, D = 1) is itself further from the float64 reference than the
# tolerance, the model's own rounding is above it (a ReLU or max-pool whose ties break differently in fp32 and
# float64; eval-mode BatchNorm over fp32 statistics): the loop's error is then judged against that floor. Two
# fp32 runs that each land at the floor's distance differ by up to about twice it; 4 leaves a margin of 2.
ROUNDING_FLOOR_FACTOR = 4
# The floor widens the allowed error up to this cap and no further. A tie that breaks the other way moves the
# few entries that pass through one unit, by rounding-sized steps compounded over a few layers; 1e-3 of the
# largest entry, 33 times the fp32 tolerance, leaves room for that. A wrong weighting moves the gradient by
# about the relative spread of the weights it gets wrong (the mean of means over micro-batches whose target
# counts differ by a few per cent: 1e-2 and more), so a cap ten times below that keeps it visible. A floor above
# the cap is no rounding: randomness left in the forward (dropout, torch.rand), which no allowance may absorb.
# bf16's and fp16's own tolerances (5e-2, 1e-2) lie above the cap: there the floor widens nothing.
ROUNDING_FLOOR_CAP = 1e-3


def allowed_error(tolerance: float, baseline_error: float) -> tuple[float, str | None]:
    """(the largest relative error that passes, a note when the rounding floor raised it above the tolerance or
    was too high to raise it as far)."""
    if baseline_error <= tolerance:
        return tolerance, None
    widened = ROUNDING_FLOOR_FACTOR * baseline_error
    floor = f"the step without accumulation is itself {baseline_error:.1e} off the float64 reference"
    cap = max(tolerance, ROUNDING_FLOOR_CAP)
    if widened <= cap:
        return widened, (
            f"{floor}, above the tolerance {tolerance:g}: rounding in this model, not accumulation; allowed "
            f"{ROUNDING_FLOOR_FACTOR} x that"
        )
    return cap, (
        f"{floor}, so far that an allowance of {ROUNDING_FLOOR_FACTOR} x it would hide an accumulation error: "
        f"allowed {cap:g} at most; rounding does not go that far (a forward that differs from itself does)"
    )


def report(checks: dict, notes: dict | None = None, figures: dict | None = None) -> str | None:
    """Print one line per check (its figure, then ok, n/a and why (a NotApplicable), or FAIL and why), then PASS
    or FAIL; returns the first failing check as '<name>: <why>', or None. The verdict is the conjunction of every
    check printed."""
    notes, figures = notes or {}, figures or {}
    for name, failure in checks.items():
        figure = f"{figures[name]}: " if name in figures else ""
        if failure is None:
            verdict = "ok"
        elif isinstance(failure, NotApplicable):  # a check this fork's data gives nothing to test
            verdict = f"n/a: {failure}"
        else:
            verdict = f"FAIL: {failure}"
        print(f"{name}: {figure}{verdict}")
        if notes.get(name):
            print(f"  note: {notes[name]}")
    failures = [
        f"{name}: {failure}"
        for name, failure in checks.items()
        if failure is not None and not isinstance(failure, NotApplicable)
    ]
    print("FAIL" if failures else "PASS")
    return failures[0] if failures else None


def agree_on_the_verdict(failure: str | None, context: DistributedContext) -> int:
    """Every rank's exit status: rank 0's verdict, broadcast. Under torchrun a FAIL then ends every rank with
    status 1 at the same moment (none is stopped by the launcher with SIGTERM), and each rank leaves the line of
    the first failing check in torchrun's error file, which torchrun's failure summary shows as the rank's
    "traceback" instead of advice on how to enable tracebacks."""
    if context.world_size > 1:
        verdict = [failure]
        dist.broadcast_object_list(verdict, src=0)
        failure = verdict[0]
    if failure is None:
        return 0
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        message = f"check_equivalence FAIL: {failure} (the checker's lines are above)"
        record = {
            "message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        }
        with open(error_file, "w") as file:
            json.dump(record, file)
    return 1


def function_name(function) -> str:
    """module.name of a loss function (or of its class, for a callable object; of the function a partial binds)."""
    function = function.func if isinstance(function, functools.partial) else function
    named = function if hasattr(function, "__qualname__") else type(function)
    return f"{named.__module__}.{named.__qualname__}"


def build_checked_model(config: Config, vocab_size: int, bug: str | None) -> tuple[torch.nn.Module, list[str]]:
    """(the model as train.py builds it (build_model), with the self-test's model bug around it if one is asked,
    and every dropout in it switched off, the config's or not; what was switched off, in words)."""
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    model = RowsNormalisedTogether(model, features=vocab_size) if bug == "batch-norm" else model
    return model, switch_off_dropout(model)


def checked_loss_sum_fn(config: Config, hooks: RowHooks, bug: str | None):
    """The configured loss (loss_sum_fn_for, as the rows' hooks hand it to the step: RowHooks.loss_sum_fn), or the
    self-test's buggy version of it."""
    loss_sum_fn = hooks.loss_sum_fn(loss_sum_fn_for(config.model))
    if bug == "mean-loss":
        return mean_loss(loss_sum_fn)
    if bug == "in-batch-negatives":
        return in_batch_negatives_loss(loss_sum_fn)
    if bug == "double-shift":
        return shifted_again_loss(loss_sum_fn)
    return loss_sum_fn


def loop_step_gradients(config, rows: Rows, batch: StepBatch, training: Training, fused: bool, context, bug):
    """One optimizer step exactly as train.py runs it (build_training's step function and StepSetup: clipping per
    optim.grad_clip, batch.on_oom's retry, the fused update where the configured optimizer is fused), global_counts
    from supervised_counts; returns (the gradients the optimizer was handed, or None when the update was skipped;
    the StepResult; which loss path ran, in words).

    The optimizer never moves the weights; it records the gradient of the update as it is handed it."""
    setup, model_config, compiled = training.setup, training.model_config, training.compiled
    loss_sum_fn = setup.loss_sum_fn
    if model_config.loss == "chunked":
        path = "chunked: the final hidden states into ChunkedCrossEntropySum over the output head"
    else:
        path = f"plain: the model's outputs into {function_name(training.evaluation[1])}"
    loss_path = f"the loop ran model.loss = {config.model.loss} as {path}, {'compiled' if compiled else 'eager'}"
    optimizer, handed = first_update_probe(training.model, fused=fused)
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
            world_size=context.replicas,  # D, as main() split the step's rows
            rank=context.replica,
        ).micro_batches
    if bug == "mean-of-means":
        setup = dataclasses.replace(setup, loss_sum_fn=mean_of_means_loss(loss_sum_fn, micro_batches, context))
    global_counts = batch.global_counts  # N in the unit the objective declares, as train.py counts it
    if bug == "mask":  # the loop's N counts the labels it supervises, as a loop that ignores the mask would
        global_counts = None
    if bug == "wrong-normaliser":  # SELF-TEST ONLY: N counts the targets whatever unit the objective declares
        global_counts = GlobalCounts(global_counts.tokens, global_counts.examples)
    result = training.step(setup, micro_batches, optimizer, global_counts=global_counts)
    return ([handed[0]] if result.applied else None), result, loss_path


def pipelined_step_gradients(
    batch: StepBatch, training: Training, fused: bool, context: DistributedContext, config, bug
):
    """The pipelined step as train.py runs it (accumulation/parallel/pipeline.py, build_training's StepSetup:
    clipping per optim.grad_clip by the stages' norm shares), run PIPELINED_STEPS times on the same rows; returns
    (for each step, the whole model's gradient as the stages' optimizers were handed it, gathered on rank 0 in the
    model's parameter order, or None when the update was skipped; the last StepResult; which loss path ran, in
    words). The optimizers never move the weights, so each step must give the reference's gradient: the second one
    runs after DDP rebuilt its gradient buckets (D > 1) and after the schedule's first step inferred the stages'
    shapes, which a one-step check never reaches."""
    pipeline, model = training.pipeline, training.model
    if bug == "scale-grads":  # SELF-TEST ONLY: PyTorch's default, the gradient divided by A once more
        pipeline.schedule.scale_grads = True
    loss_path = (
        f"the loop ran {config.dist.pipeline_stages} pipeline stages ({config.dist.pipeline_schedule}), the last "
        f"stage's outputs into {function_name(pipeline.loss.loss_sum_fn)}, eager, {PIPELINED_STEPS} steps on the "
        "same rows"
    )
    optimizer = torch.optim.SGD(pipeline.stage_module.parameters(), lr=0.0, fused=fused or None)
    handed = []  # per step: this stage's gradients by name

    def record(opt, args, kwargs):
        handed.append({pipeline.names[id(p)]: g.detach().cpu() for p, g in trainable_gradients(pipeline.stage_module)})

    optimizer.register_step_pre_hook(record)
    for _ in range(PIPELINED_STEPS):
        result = training.step(training.setup, batch.micro_batches, optimizer, global_counts=batch.global_counts)
    everyone = [None] * context.world_size if context.is_main else None
    dist.gather_object(handed if context.layout.replica == 0 else [], everyone, dst=0)
    if not context.is_main or len(handed) < PIPELINED_STEPS:  # a step skipped (every rank decides alike)
        return None, result, loss_path
    steps = []
    for step in range(PIPELINED_STEPS):
        whole = {name: grad for part in everyone for name, grad in (part[step].items() if part else ())}
        steps.append([whole[name] for name, p in model.named_parameters() if p.requires_grad])
    return steps, result, loss_path


# Two steps: the second is the first that runs on DDP's rebuilt buckets and on the schedule's inferred shapes.
PIPELINED_STEPS = 2
