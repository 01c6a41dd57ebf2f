"""Check that one optimizer step of the loop follows the gradient of the full-batch token-mean loss.

For anyone who changed the model, the loss or the step: run it with the config you train with.

    python scripts/check_equivalence.py [--config FILE] [section.key=value ...]
    torchrun --standalone --nproc_per_node=N scripts/check_equivalence.py [--config FILE] [section.key=value ...]

The loop side is one optimizer step exactly as train.py runs it: the model built from the config, the
examples of step 0 of the data order, split into this rank's A micro-batches of m rows, and
`accumulation.step.optimizer_step` (the same function train.py calls) with the configured precision.
The gradient is read when the optimizer is handed it, i.e. after accumulation, DDP's all-reduce and
unscaling. Two settings are switched off for the comparison, because the reference could not reproduce
them: gradient clipping (it rescales the gradient by the step's own norm) and dropout (its random masks).

The reference is computed independently, on rank 0 only: a float64 copy of the same initial model, one
forward and backward over every real row of step 0 at once, with PyTorch's own
`F.cross_entropy(..., ignore_index=-100, reduction="mean")`. No micro-batches, no ranks, no weighting
of ours.

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).
"""

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

# Run as `python scripts/check_equivalence.py`, Python puts scripts/ on the path, not the project root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import accumulation.step  # noqa: E402  (after the path fix above)
from accumulation.batching import IGNORE_INDEX, accumulation_steps, describe_batch  # noqa: E402
from accumulation.build import autocast_dtype_for, check_config_for_world, gpt_config  # noqa: E402
from accumulation.config import Config, ConfigError, load_config, resolved_grad_scaler  # noqa: E402
from accumulation.data import Corpus, DataError, build_micro_batches, load_corpus, micro_batch, step_row_ids  # noqa: E402
from accumulation.distributed import DistributedContext, run_and_exit, setup_distributed, teardown_distributed  # noqa: E402
from accumulation.model import GPT  # noqa: E402
from accumulation.schedule import build_scheduler  # noqa: E402
from accumulation.step import Counters, optimizer_step  # noqa: E402

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

INJECTABLE_BUGS = ("mean-of-means",)


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
        choices=INJECTABLE_BUGS,
        help="self-test of this checker: make the loop weight every micro-batch equally (a known wrong "
        "normalization); the check must then FAIL",
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
        corpus = load_corpus(config.data.source, config.data.seq_len, config.data.val_fraction)
        row_ids = step_row_ids(
            corpus.train.num_rows, config.batch.global_batch_size, config.run.seed, 0, config.batch.tail
        )
    except (ConfigError, DataError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    context = setup_distributed(config.device, config.dist.timeout_s)
    try:
        return check(config, corpus, row_ids, context, arguments.inject_bug)
    finally:
        teardown_distributed()


def check(
    config: Config, corpus: Corpus, row_ids: torch.Tensor, context: DistributedContext, inject_bug: str | None
) -> int:
    device = context.device
    model = comparable_model(config, device)
    reference_model = copy.deepcopy(model) if context.is_main else None  # taken before the loop touches it

    with mean_of_means_injected(config, corpus, row_ids, context) if inject_bug else contextlib.nullcontext():
        loop_gradients, result = loop_step_gradients(config, corpus, row_ids, model, context)
    if not context.is_main:
        return 0
    if loop_gradients is None:
        print(f"FAIL: the loop did not apply its update ({result.skip_reason}), so there is no gradient to compare")
        return 1

    reference_gradients, reference_loss, reference_tokens = full_batch_reference(
        reference_model, corpus, row_ids, device
    )
    names = [name for name, _ in model.named_parameters()]
    errors = [
        (loop.double().cpu() - reference.cpu()).abs().max().item()
        for loop, reference in zip(loop_gradients, reference_gradients, strict=True)
    ]
    largest_reference_entry = max(reference.abs().max().item() for reference in reference_gradients)
    worst = max(range(len(errors)), key=errors.__getitem__)
    relative_error = errors[worst] / largest_reference_entry
    loss_relative_error = abs(result.loss - reference_loss) / abs(reference_loss)
    tolerance = RELATIVE_TOLERANCE[config.precision.dtype]

    batch = describe_batch(config.batch.global_batch_size, config.batch.micro_batch_size, context.world_size)
    print(
        f"check_equivalence: {batch}"
        f"; step 0: {len(row_ids)} examples, {reference_tokens:,} supervised tokens; device {device}; "
        f"precision {config.precision.dtype}"
    )
    print(f"model: {model.num_parameters():,} parameters; compared with gradient clipping and dropout off")
    if inject_bug:
        print(f"SELF-TEST: --inject-bug {inject_bug}: the loop weights every micro-batch equally; this must FAIL")
    print(
        f"examples: loop {result.examples}, reference {len(row_ids)}; "
        f"supervised tokens: loop {result.tokens:,}, reference {reference_tokens:,}"
    )
    print(f"loss: loop {result.loss:.8f}, reference {reference_loss:.8f} (relative error {loss_relative_error:.2e})")
    print(
        f"gradient: max absolute error {errors[worst]:.3e} (in {names[worst]}), largest reference entry "
        f"{largest_reference_entry:.3e}, max relative error {relative_error:.3e}"
    )
    print(
        f"tolerance: {tolerance:g} relative "
        f"({config.precision.dtype} loop against a float64 reference; see RELATIVE_TOLERANCE)"
    )
    passed = (
        result.examples == len(row_ids)
        and result.tokens == reference_tokens
        and relative_error <= tolerance
        and loss_relative_error <= tolerance
    )
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def comparable_model(config: Config, device: torch.device) -> GPT:
    """The config's model with dropout off (its masks are random: no reference could draw the same ones),
    with the same initial weights on every rank and at every call."""
    return GPT(dataclasses.replace(gpt_config(config), dropout=0.0), seed=config.run.seed).to(device)


def gradient_probe(config: Config, model: GPT, context: DistributedContext):
    """What optimizer_step needs to run the loop's update on `model`, and a record of the gradients.

    Returns (the model wrapped as train.py wraps it: torch.compile when configured, DDP over several ranks;
    optimizer; scheduler; scaler; handed). The optimizer does not matter, only the gradient it is handed:
    SGD with learning rate 0, so the weights never move, and without momentum, so it holds no state. Its
    hook puts into `handed` the gradients of the first applied update, as the optimizer sees them: after
    accumulation, DDP's all-reduce, unscaling and (when on) clipping. Later updates add nothing, so that
    memory measured around them holds no copies of the probe's.
    """
    device = context.device
    wrapped = torch.compile(model) if config.model.compile else model
    if context.world_size > 1:
        wrapped = DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = build_scheduler(optimizer, "constant", 0, 0, 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    handed = []

    def record_first_gradient(opt, args, kwargs):
        if not handed:
            handed.append([p.grad.detach().clone() for p in model.parameters()])

    optimizer.register_step_pre_hook(record_first_gradient)
    return wrapped, optimizer, scheduler, scaler, handed


def loop_step_gradients(config: Config, corpus: Corpus, row_ids: torch.Tensor, model: GPT, context: DistributedContext):
    """One optimizer step the loop's way, without clipping; returns (the gradients the optimizer was handed,
    or None when the update was skipped; the StepResult)."""
    wrapped, optimizer, scheduler, scaler, handed = gradient_probe(config, model, context)
    micro_batches = build_micro_batches(
        corpus.train,
        row_ids,
        config.batch.global_batch_size,
        config.batch.micro_batch_size,
        context.world_size,
        context.rank,
    )
    result = optimizer_step(
        wrapped,
        micro_batches,
        optimizer,
        scheduler,
        scaler,
        Counters(),
        grad_clip=0.0,
        device=context.device,
        autocast_dtype=autocast_dtype_for(config),
    )
    return (handed[0] if result.applied else None), result


def full_batch_reference(model: GPT, corpus: Corpus, row_ids: torch.Tensor, device: torch.device):
    """∇ of the token-mean loss over every real row of the step as one float64 batch; also the loss and N."""
    model = model.double()
    batch = micro_batch(corpus.train, row_ids, len(row_ids))  # all of the step's rows, no padding rows
    inputs, labels = batch.inputs.to(device), batch.labels.to(device)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="mean")
    loss.backward()
    return [p.grad for p in model.parameters()], loss.item(), int((labels != IGNORE_INDEX).sum())


def mean_of_means_injected(config: Config, corpus: Corpus, row_ids: torch.Tensor, context: DistributedContext):
    """SELF-TEST ONLY: a context in which the loop makes the classic accumulation mistake.

    Inside it, the per-micro-batch loss the step backpropagates is the micro-batch's token MEAN, rescaled
    by the average token count per micro-batch so that the overall size of the gradient stays right:
    every micro-batch then weighs the same, whatever its token count, which is wrong whenever the counts
    differ. The step multiplies by D / N, so the gradient becomes that of the mean of the A·D micro-batch
    means. Only `accumulation.step.token_loss_sum` is replaced, and only while the context is open.
    """
    accumulation_per_rank = accumulation_steps(
        config.batch.global_batch_size, config.batch.micro_batch_size, context.world_size
    )
    tokens_global = int(corpus.train.supervised_tokens()[row_ids].sum())
    tokens_per_micro_batch = tokens_global / (accumulation_per_rank * context.world_size)
    correct_token_loss_sum = accumulation.step.token_loss_sum

    def micro_batch_mean_times_average_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)  # an empty micro-batch still adds exactly zero
        return correct_token_loss_sum(logits, labels) / tokens * tokens_per_micro_batch

    return mock.patch.object(accumulation.step, "token_loss_sum", micro_batch_mean_times_average_count)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
