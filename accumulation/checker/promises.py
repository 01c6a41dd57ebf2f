"""The fork's promises the step relies on, each checked on its own and named when it fails; each is
independent of m, A and D (a bug in them can hide behind a particular split: a mean returned as a "sum" is
exact when A·D = 1). Every function returns None when the promise holds, else the line that says why not.
"""

import hashlib

import torch
import torch.distributed as dist

from accumulation.data import DataError, Rows, StepBatch, check_supervised_counts
from accumulation.distributed import DistributedContext

# loss_sum_fn's additivity: the float64 sums over two halves of the step's rows and over all of them agree to
# rounding, about 1e-16 per addition over a few thousand targets; 1e-9 is far above that and far below the
# factor of about 2 a mean gives.
ADDITIVITY_TOLERANCE = 1e-9


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
