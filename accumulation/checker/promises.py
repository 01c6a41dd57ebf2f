"""The fork's promises the step relies on, each checked on its own and named when it fails; each is
independent of m, A and D (a bug in them can hide behind a particular split: a mean returned as a "sum" is
exact when A·D = 1). Every function returns None when the promise holds, else the line that says why not.
"""

import hashlib

import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX
from accumulation.checker.reference import map_tensors
from accumulation.data.rows import DataError, Rows
from accumulation.data.sources import StepBatch, check_supervised_counts
from accumulation.parallel.distributed import DistributedContext
from accumulation.probe import ignored_outputs_change_the_loss, ignored_targets_line


def rows_agree_across_calls_and_ranks(
    rows: Rows, batch: StepBatch, context: DistributedContext
) -> tuple[str | None, str | None]:
    """(why the rows are not a pure function of (seed, step, row id), or None; why this step's labels hold
    other targets than supervised_counts promised on some rank (train.py's own check), or None).

    Every rank builds the whole step's rows twice and hashes them: the two calls, and all ranks, must agree.
    A mask drawn from torch's global generator differs between the calls and between ranks (dropout seeds
    that generator per rank); a mask seeded with the rank differs between ranks."""

    def digest() -> str:
        inputs, labels, *extras = rows.examples(batch.row_ids, batch.step)
        counts = rows.supervised_counts(batch.row_ids, batch.step)
        tensors = (inputs, labels, counts, *(extras[0].values() if extras else ()))
        return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()

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


def labels_message(
    inputs: torch.Tensor, labels: torch.Tensor, reference_inputs: torch.Tensor, reference_labels: torch.Tensor, row_ids
) -> str | None:
    """Whether examples() gives, position by position, the inputs and the targets its raw examples state; None
    when it does. Names the first differing row and position and, for token rows, the usual cause: labels
    shifted once more than the raw targets (label j holds token j + 2: shifted twice, as when a loss shifts
    labels that arrive shifted), or not shifted at all (label j is input token j: HF's labels = input_ids)."""
    if not same_tensors(inputs, reference_inputs):
        return (
            "examples() gives other inputs than the raw examples state: raw_example must state the row the model reads"
        )
    if labels.shape != reference_labels.shape:
        return (
            f"examples() gives labels of shape {tuple(labels.shape)}, the raw examples {tuple(reference_labels.shape)}"
        )
    if torch.equal(labels, reference_labels):
        return None
    position = (labels != reference_labels).nonzero()[0].tolist()
    where = f"row {int(row_ids[position[0]])}, " + ("label" if len(position) == 1 else f"position {position[1]}")
    said, stated = int(labels[tuple(position)]), int(reference_labels[tuple(position)])
    found = f"{where}: examples() says {said}, the raw example {stated}"
    if stated == IGNORE_INDEX:
        found += "; the raw example has no target there: padding or a prompt left supervised? Give it -100"
    if labels.dim() != 2 or not isinstance(inputs, torch.Tensor) or inputs.shape != labels.shape:
        return found
    supervised = labels != IGNORE_INDEX
    # Shifted twice: label j = the raw target of position j + 1. Unshifted: label j = input token j.
    if torch.equal(labels[:, :-1][supervised[:, :-1]], reference_labels[:, 1:][supervised[:, :-1]]):
        return f"{found}; label j holds the target of position j + 1: label j should be token j + 1: shifted twice?"
    if torch.equal(labels[supervised], inputs[supervised]):
        return (
            f"{found}; label j is input token j: labels arrive shifted, label j = token j + 1 (HF-style "
            "labels = input_ids are not)"
        )
    return found


class NotApplicable(str):
    """Why a check cannot apply to this fork's data: the checker prints "n/a: <why>", neither ok nor a failure."""


# How many labels loss_alignment_message tries before it gives up finding one whose loss alone has a gradient: one
# backward each, on the step's fixed outputs.
PAIRING_CANDIDATES = 16


def loss_alignment_message(loss_sum_fn, outputs: torch.Tensor, labels: torch.Tensor, keywords=None) -> str | None:
    """Whether the loss of label j reads output j (labels [rows, seq] against outputs [rows, seq, ...]); None
    when it does, NotApplicable(why) when the labels have no positions to pair. On fixed outputs, one supervised
    label is kept (the others -100) and the gradient of the loss says which output positions it reads. A loss that
    shifts the labels itself (HF's loss_function does) pairs label j with output j - 1: together with labels that
    arrive shifted, every target is two tokens ahead, and loop and reference agree on it, so no comparison of
    gradients can see it. `keywords`: what the loss reads of the rows besides their labels ([rows, ...] each, as
    MicroBatch.extras hands it), every row's at each call."""
    keywords = keywords or {}
    if labels.dim() != 2:
        return NotApplicable(f"one label per example (labels {list(labels.shape)}), no positions to pair")
    if outputs.dim() < 3 or outputs.shape[:2] != labels.shape:
        return NotApplicable(f"outputs {list(outputs.shape)} are not one per label position {list(labels.shape)}")
    if labels.shape[1] < 3:
        return NotApplicable(f"rows of {labels.shape[1]} positions, too short to tell output j from j - 1 and j + 1")
    supervised = (labels != IGNORE_INDEX).nonzero()
    inner = supervised[(supervised[:, 1] > 0) & (supervised[:, 1] < labels.shape[1] - 1)]
    if len(inner) == 0:
        return NotApplicable("no supervised label between a row's first and last position")
    # A row whose loss has no gradient shows no pairing (a surrogate's row of advantage 0 reads its outputs with
    # weight 0): the label is one of a row whose loss has a gradient, where there is such a row.
    rows_with_gradient = gradient_per_position(loss_sum_fn, outputs, labels, keywords).sum(dim=1) > 0
    if rows_with_gradient[inner[:, 0]].any():
        inner = inner[rows_with_gradient[inner[:, 0]]]
    # Nor does a single target whose own term has none (a surrogate's ratio clipped there): from the middle label
    # outwards, the first of a few whose loss alone has a gradient is judged.
    middle = len(inner) // 2
    order = sorted(range(len(inner)), key=lambda index: abs(index - middle))[:PAIRING_CANDIDATES]
    for index in order:
        row, position = inner[index].tolist()
        one_label = torch.full_like(labels, IGNORE_INDEX)
        one_label[row, position] = labels[row, position]
        read_per_position = gradient_per_position(loss_sum_fn, outputs, one_label, keywords)[row]
        if read_per_position.sum() > 0:
            break
    else:
        return NotApplicable(f"none of {len(order)} labels near the middle has a loss with a gradient on its own")
    if read_per_position[position] > 0:
        return None
    read = read_per_position.nonzero().flatten().tolist()
    if position - 1 in read:
        return (
            f"the loss of label {position} (row {row} of the step) reads output {position - 1}, not {position}: "
            "the loss shifts the labels again (as HF's loss_function does), but labels arrive shifted "
            "(label j = token j + 1): shifted twice? Use a loss that pairs label j with output j"
        )
    return f"the loss of label {position} (row {row} of the step) reads outputs {read[:4]}, not output {position}"


def gradient_per_position(loss_sum_fn, outputs: torch.Tensor, labels: torch.Tensor, keywords: dict) -> torch.Tensor:
    """|∂ loss / ∂ outputs| summed over each position's outputs, [rows, seq], on fixed outputs: where the loss
    reads them."""
    probe = outputs.detach().clone().requires_grad_(True)
    loss_sum_fn(probe, labels, **keywords).backward()
    gradient = torch.zeros_like(probe) if probe.grad is None else probe.grad
    return gradient.abs().reshape(*labels.shape, -1).sum(dim=2)


def same_tensors(a, b) -> bool:
    """Whether two inputs (a tensor, or several in a tuple, list or dict) hold the same values in the same shapes."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_tensors(a[k], b[k]) for k in a)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


def first_tensor(inputs):
    """The first tensor of the inputs (one tensor, or several): its first dimension counts the rows."""
    if isinstance(inputs, dict):
        return next(iter(inputs.values()))
    return inputs[0] if isinstance(inputs, (tuple, list)) else inputs


# Row independence: float64 outputs of a row computed with and without the rows beside it differ by rounding
# only, about 1e-15 relative (another batch size may pick other kernels); 1e-9 is far above that and far below
# what batch statistics do to a row (BatchNorm over 4 rows instead of 8 moves each output by about 1e-2).
# The same bound serves two identical forwards, which differ by nothing or (atomic adds on a GPU) by
# rounding, while a dropout of p = 0.1 moves outputs by about 1e-1.
ROW_INDEPENDENCE_TOLERANCE = 1e-9


def rows_coupling_modules(model: torch.nn.Module) -> list[str]:
    """The modules that compute statistics over the rows of a batch in train mode: BatchNorm and its kin."""
    modules = model.named_modules()
    return [f"{type(m).__name__} at '{name}'" for name, m in modules if name and "BatchNorm" in type(m).__name__]


def relative_difference(outputs: torch.Tensor, reference: torch.Tensor) -> float:
    """max |outputs - reference| relative to the largest |reference|."""
    return float((outputs - reference).abs().max() / reference.abs().max().clamp(min=1e-300))


def repeat_difference(model: torch.nn.Module, inputs) -> float:
    """How far two identical forwards of the same rows land apart (train mode, float64, no gradient): rounding
    only, or nothing, for a model that draws nothing at random."""
    model.train()
    with torch.no_grad():
        return relative_difference(model(inputs), model(inputs))


def determinism_message(model: torch.nn.Module, inputs, dropout_off: list[str]) -> str | None:
    """Whether two identical forwards give the same outputs, once the checker switched every dropout it knows
    off (dropout_off: what it switched off, in words); None when they do. Randomness left in the forward
    differs between the loop, the reference and the A = 1, D = 1 baseline, so no comparison of them means
    anything: it would hide an accumulation error, or blame one that is not there."""
    difference = repeat_difference(model, inputs)
    if difference <= ROW_INDEPENDENCE_TOLERANCE:
        return None
    switched = f"after switching off {', '.join(dropout_off)}" if dropout_off else "with no dropout left on"
    return (
        f"this model is not deterministic between two identical forwards (relative {difference:.2e}, train mode, "
        f"float64, {switched}): randomness in its forward that is not a torch.nn Dropout module (torch.rand, a "
        "sampled mask, functional dropout with a fixed p); no reference draws the same. Make it a Dropout module, "
        "give it a probability the checker can set to 0, or draw it from the data as a pure function of "
        "(seed, step, row id)"
    )


def row_independence_message(model: torch.nn.Module, inputs) -> str | None:
    """Whether a row's outputs depend on the other rows of its batch, in train mode (as the loop runs the
    model): the outputs of the whole step's rows against those of each half on its own (float64, no
    gradient). Micro-batches of m rows cannot reproduce a model whose rows see one another (BatchNorm
    normalises each micro-batch by its own statistics), whatever the weighting. A model whose two identical
    forwards differ already cannot be judged this way: the line then names the randomness, not the rows."""
    rows = len(first_tensor(inputs))
    if rows < 2:
        return None
    half = rows // 2
    repeated = repeat_difference(model, inputs)
    if repeated > ROW_INDEPENDENCE_TOLERANCE:
        return (
            f"cannot tell: two identical forwards of the step's rows already differ (relative {repeated:.2e}): "
            "dropout left on or other randomness in the forward, not necessarily an operation across rows"
        )
    with torch.no_grad():
        whole = model(inputs)
        halves = torch.cat(
            [model(map_tensors(lambda t: t[:half], inputs)), model(map_tensors(lambda t: t[half:], inputs))]
        )
    difference = relative_difference(halves, whole)
    if difference <= ROW_INDEPENDENCE_TOLERANCE:
        return None
    found = rows_coupling_modules(model)
    named = (
        f"modules that mix rows: {', '.join(found)}"
        if found
        else "no BatchNorm-like module found; look for an operation across rows"
    )
    return (
        f"a row's outputs change with the rows around it in train mode (relative {difference:.2e} between the "
        f"step's rows at once and in two halves): {named}. No accumulation reproduces batch statistics: use "
        "GroupNorm or LayerNorm, or A·D = 1"
    )


def stages_message(model: torch.nn.Module, num_stages: int, inputs) -> str | None:
    """Whether the model's pipeline stages (its pipeline_split, as the pipelined loop cuts it), run one after
    another on the step's rows, compute its forward (train mode, float64, no gradient); None when they do. The
    loop trains the stages and the reference the forward, so a stage that computes something else (a block run
    without its causal mask, positions restarted at 0 on a later stage) would read as an accumulation error."""
    from accumulation.parallel.pipeline import split_into_stages  # only for dist.pipeline_stages > 1

    model.train()
    with torch.no_grad():
        whole = model(inputs)
        outputs = inputs
        for stage in split_into_stages(model, num_stages):
            outputs = stage(outputs)
    if outputs.shape == whole.shape and relative_difference(outputs, whole) <= ROW_INDEPENDENCE_TOLERANCE:
        return None
    found = (
        f"relative {relative_difference(outputs, whole):.2e}"
        if outputs.shape == whole.shape
        else f"outputs {list(outputs.shape)} against {list(whole.shape)}"
    )
    return (
        f"the {num_stages} pipeline stages of the model's pipeline_split, run one after another, compute another "
        f"function than its forward ({found}; float64, train mode): the loop trains the stages, the reference the "
        "forward; each stage must run the model's own layers as its forward does (a causal mask, positions, a norm)"
    )


# loss_sum_fn's additivity: the float64 sums over two halves of the step's rows and over all of them agree to
# rounding, about 1e-16 per addition over a few thousand targets; 1e-9 is far above that and far below the
# factor of about 2 a mean gives. A loss that computes in float32 whatever its inputs (HF's losses do) rounds
# each of those additions to 2^-24 ≈ 6e-8: over a few thousand targets the sums then agree to about 1e-6, so
# 1e-5, still far below what a mean or a coupling between examples does. The difference is relative to the size
# of the loss's terms (additivity_message says which), which bounds every partial sum and so the rounding of each
# addition.
ADDITIVITY_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}


def additivity_message(
    loss_sum_fn, outputs: torch.Tensor, labels: torch.Tensor, keywords=None
) -> tuple[str | None, str | None]:
    """(why loss_sum_fn is not a SUM over targets, or None; a note on its precision, or None).

    On fixed outputs (the model's float64 outputs for the step's rows, computed once, so that only the loss is
    tested): its value over the step's rows must equal its value over the first half plus its value over the
    second. A mean is not additive, but it is once each value is multiplied by its count of targets (or of rows);
    a loss that couples examples (in-batch negatives: each row's loss reads the other rows' outputs) is neither.
    The step divides by the global N itself, so a mean would make each micro-batch weigh the same (the
    mean-of-means bug), which no gradient comparison sees when A·D = 1.

    `keywords`: what the loss reads of the rows besides their labels ([rows, ...] each, as MicroBatch.extras
    hands it), split with the rows. The difference is measured against the size of the loss's terms: |its value|
    for a loss of the labels alone (cross-entropy's terms are all ≥ 0, so |value| is their size); with keywords
    (a GRPO surrogate, whose terms -ρ·A cancel within a group and leave a value near 0 that rounding alone would
    put far off), Σ_i |value of row i alone|, each row counted in the unit compared (a row's own terms share the
    sign of its advantage)."""
    if len(outputs) < 2:
        return None, None
    keywords = keywords or {}
    half = len(outputs) // 2

    def loss_of(rows: slice) -> torch.Tensor:
        return loss_sum_fn(outputs[rows], labels[rows], **{name: value[rows] for name, value in keywords.items()})

    with torch.no_grad():
        values = [loss_of(slice(None)), loss_of(slice(None, half)), loss_of(slice(half, None))]
        each_row = torch.stack([loss_of(slice(i, i + 1)) for i in range(len(outputs))]) if keywords else None
    dtype = values[0].dtype
    note = None
    if dtype != outputs.dtype:
        note = (
            f"loss_sum_fn returns {dtype} for {outputs.dtype} outputs: the reference is only as precise as "
            f"{dtype} inside the loss (a precision note, not a failure)"
        )
    tolerance = ADDITIVITY_TOLERANCE.get(dtype, 1e-2)
    whole, first, second = (float(v) for v in values)
    targets_per_row = (labels != IGNORE_INDEX).reshape(len(labels), -1).sum(dim=1).double()
    rows_per_row = torch.ones(len(labels), dtype=torch.float64)

    def mismatch(weights: list[float], per_row: torch.Tensor) -> float:
        """The relative difference once each value is multiplied by its part's weight (its count of targets or
        rows, per_row counting the same for each row)."""
        combined = weights[1] * first + weights[2] * second
        size = abs(weights[0] * whole) if each_row is None else float((per_row * each_row.abs().double()).sum())
        return abs(weights[0] * whole - combined) / max(size, 1e-300)

    difference = mismatch([1, 1, 1], rows_per_row)
    if difference <= tolerance:
        return None, note
    parts = [slice(None), slice(None, half), slice(half, None)]
    by_targets = mismatch([float(targets_per_row[part].sum()) for part in parts], targets_per_row)
    by_rows = mismatch([float(rows_per_row[part].sum()) for part in parts], rows_per_row)
    said = (
        f"over the step's rows it gives {whole:.6g}, over its two halves {first + second:.6g} in total "
        f"(relative difference {difference:.2e})"
    )
    if by_targets <= tolerance or by_rows <= tolerance:
        unit = "targets" if by_targets <= tolerance else "rows"
        return f"{said}: a mean over {unit}; return the SUM of the supervised targets' losses, never a mean", note
    return (
        f"{said}, and it is no mean either: the loss couples examples, e.g. in-batch negatives; no accumulation "
        "can reproduce it: A·D = 1 or a technique such as GradCache",
        note,
    )


# A row's loss that leaves its positions labelled -100 out of its sum does not move at all when only their outputs
# move (their terms are dropped, or multiplied by 0); 1e-9 of the rows' losses allows for a masked loss's own
# rounding and lies far below what one supervised padding position moves them by (a target 0 on noisy logits:
# about 1e-3 of the loss of a few hundred targets, and far more for the hundreds a padded batch holds).
IGNORED_TOLERANCE = 1e-9


def ignored_targets_message(
    loss_sum_fn, outputs: torch.Tensor, labels: torch.Tensor, keywords=None, pairing_failed: bool = False
) -> str | None:
    """Whether the loss leaves out every position whose label is -100: on fixed outputs, each row's loss with and
    without noise on its outputs at those positions (probe.ignored_outputs_change_the_loss, as train.py's probe
    asks it); None when none moves, NotApplicable when no label is -100 or the outputs are not one per label
    position. Loop and reference call the same loss, and splitting rows keeps each row's padding, so neither the
    gradient comparison nor the 'is a sum' check sees a loss that trains padding or prompts as targets.
    `keywords`: what the loss reads of the rows besides their labels, as for additivity_message. `pairing_failed`:
    loss_alignment_message found label j read off another output, which reads the outputs beside the targets;
    that line names it, so this one judges only the positions away from every target."""
    moved = ignored_outputs_change_the_loss(loss_sum_fn, outputs, labels, keywords or {})
    if moved is None:
        return NotApplicable("no label is -100 here, or the outputs are not one per label position")
    away, beside = moved
    if pairing_failed and away <= IGNORED_TOLERANCE and beside > IGNORED_TOLERANCE:
        return NotApplicable(
            "it reads the outputs beside its targets, as the pairing line's fault does; none away from them"
        )
    return ignored_targets_line(away, beside, IGNORED_TOLERANCE)


def first_failure(checks: dict) -> str | None:
    """The name of the first check that FAILs (neither None nor NotApplicable), or None."""
    return next((name for name, why in checks.items() if why is not None and not isinstance(why, NotApplicable)), None)


def loss_promises(checks: dict, loss_sum_fn, outputs: torch.Tensor, labels: torch.Tensor, keywords: dict, skip: bool):
    """Adds to `checks` the lines of the loss's own promises on fixed outputs (with `skip`, each n/a and why) and
    returns their notes."""
    names = ("loss_sum_fn is a sum", "loss pairs label j with output j", "loss leaves the positions labelled -100 out")
    if skip:
        why = NotApplicable("the raw examples' extras disagree with those of examples() (above): the loss is not run")
        checks.update(dict.fromkeys(names, why))
        return {}
    additivity, precision_note = additivity_message(loss_sum_fn, outputs, labels, keywords)
    pairing = loss_alignment_message(loss_sum_fn, outputs, labels, keywords)
    pairing_failed = pairing is not None and not isinstance(pairing, NotApplicable)
    ignored = ignored_targets_message(loss_sum_fn, outputs, labels, keywords, pairing_failed=pairing_failed)
    checks.update(zip(names, (additivity, pairing, ignored), strict=True))
    return {names[0]: precision_note}


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
