"""A gallery of real gradient-accumulation bugs, each measured next to the correct update on the same data.

    python scripts/teaching/pitfalls.py [--json] [--png PATH]

Every pitfall is a pair of twins. The buggy twin is the mistake written out plainly, as people write it; the
correct twin is this project's `optimizer_step` (or its data order), so the gallery tests our loop as well.
Most pairs are judged against an independent reference: PyTorch's own token-mean cross-entropy
(`reduction="mean"`, `ignore_index=-100`) over one big float64 batch made of every micro-batch of the step.

The table on stdout (or, with --json, a list of {"pitfall", "metric", "buggy", "correct", "cosine",
"norm_ratio", "reference"}) shows one number per twin. Where the twins are gradients or updates, two more
numbers split the error into its direction and its scale: the cosine between the buggy and the correct
vector (1 = same direction) and the ratio of their norms (1 = same length). A bug with cosine 1 is "only a
scale", which Adam largely absorbs and SGD does not; a cosine below 1 changes where the model goes.
`reference` says what the correct column is compared with. The figure (--png, default pitfalls.png) draws
the rows in panels by kind of metric: relative errors, cosines, norm ratios, bytes and counts each on an
axis of their own. The exit status is 1 when a correct twin disagrees with its reference or a buggy twin
fails to show its bug, so the gallery doubles as a test. It takes about ten seconds on 2 CPU cores; five
pitfalls need 2 gloo ranks, which it spawns itself.
"""

import argparse
import contextlib
import functools
import json
import math
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch, accumulation_steps
from accumulation.data import RowSet, build_micro_batches, epoch_permutation, make_rows, step_row_ids, steps_per_epoch
from accumulation.model import GPT, GPTConfig
from accumulation.schedule import build_scheduler
from accumulation.step import all_reduce_ints, count_supervised_tokens, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import (
    capture_gradients,
    counting_allreduce_hook,
    float64_reference_gradient,
    full_batch_mean_loss,
    max_relative_error,
)

SEQ_LEN = 16
VOCAB_SIZE = 256  # byte tokens, as make_rows cuts them
MODEL = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=32, vocab_size=VOCAB_SIZE)
MODEL_SEED = 7
MICRO_BATCH_SIZE = 2  # m
LR = 0.1
ADAM_LR = 1e-3
CPU = torch.device("cpu")

# Documents of uneven lengths cut into rows by the project's own pipeline (make_rows, then micro_batch), so
# rows supervise anything from 1 to 16 tokens and short rows end in padding, as real data does.
DOCUMENT_BYTES = (40, 2, 9, 17, 4, 33, 6, 49, 3, 12, 21, 8)  # 18 rows; supervised tokens of rows 0..17:
# 16 16 7 1 8 16 3 16 16 5 16 16 16 2 11 16 4 7

# Row ids of each step, in micro-batches of m = 2. Supervised tokens per micro-batch in the comments.
STEP_IDS = [0, 1, 3, 13, 5, 2, 6, 16]  # 32, 3, 23, 7: one micro-batch holds over 10x the tokens of another
NEXT_STEP_IDS = [7, 8, 9, 4, 10, 17, 14, 11]  # 32, 13, 23, 27: a second step, for pitfalls across steps
# Two ranks: rank 0 takes the first 8 ids (full rows, 128 tokens), rank 1 the last 8 (short rows, 37 tokens).
TWO_RANK_STEP_IDS = [0, 1, 5, 7, 8, 10, 11, 12, 3, 13, 6, 16, 9, 2, 17, 4]
# A partial last group: 4 full rows (16 tokens each), 2 of the A = 4 micro-batches of m = 2.
PARTIAL_STEP_IDS = [0, 1, 5, 7]
WORLD_SIZE = 2
ACCUMULATION_STEPS = accumulation_steps(len(STEP_IDS), MICRO_BATCH_SIZE, 1)  # A = 8 / (2 · 1) = 4
assert ACCUMULATION_STEPS == accumulation_steps(len(TWO_RANK_STEP_IDS), MICRO_BATCH_SIZE, WORLD_SIZE)

# Float64 runs of a correct twin and of the reference add the same terms in different orders (per
# micro-batch, then over micro-batches and ranks, versus one big sum): a few ulps (2.2e-16 relative) per
# term over a few thousand terms, far below 1e-10 of the largest gradient entry. Every bug below is off by
# 1e-2 or more; 1e-3 is the least a buggy twin must show.
GRADIENT_RTOL = 1e-10
BUG_MIN = 1e-3
# The learning rate is one product base · multiplier; the expected value is the same product in another order.
LR_RTOL = 1e-12
# Adam's first update is lr · g / (|g| + eps) entry by entry: the float64 gradients' reordering errors pass
# through at most |δg| / eps relative to lr, and the entries that decide the max have |g| far above eps.
UPDATE_RTOL = 1e-10

GRADIENT_ERROR = "relative gradient error vs float64 full batch"
ALLREDUCE_BYTES = "gradient bytes all-reduced per update"
RANK_DIVERGENCE = "gradient difference between ranks (relative)"
LR_ERROR = "relative lr error after 2 updates"
UPDATE_ERROR = "relative update error vs float64 full batch"
LOSS_ERROR = "relative error of the logged loss"
ROWS_NOT_ONCE = "rows of epoch 1 seen twice or never"
SAVED_BYTES = "peak bytes saved for backward"

# What a correct twin's residue is printed as. Its digits depend on the order in which the CPU's kernels add
# (vector width, blocking), so they differ from machine to machine while the order of magnitude does not: a
# float64 reordering costs a few ulps (1.1e-16 relative) of the largest entry, 5e-16 at most on the machines
# measured, and 1e-14 leaves a factor of 20. Adam's update divides by sqrt(v) + eps, which magnifies the
# same residue for small-gradient entries: 1.1e-12 and 3.1e-13 on two machines, bound 1e-11. The checks
# above keep their wider tolerances; these bounds only decide what the table and the guide print.
ROUNDING_BOUND = {GRADIENT_ERROR: 1e-14, LR_ERROR: 1e-14, LOSS_ERROR: 1e-14, UPDATE_ERROR: 1e-11}


@dataclass
class Measurement:
    pitfall: str
    metric: str
    buggy: float
    correct: float
    correct_agrees: bool  # the correct twin matches its reference within the metric's tolerance
    bug_shown: bool  # the buggy twin is off by at least the metric's threshold
    reference: str  # what the correct column is compared with
    cosine: float | None = None  # cos(buggy, reference) of gradients or updates: 1 = right direction
    norm_ratio: float | None = None  # |buggy| / |reference|: 1 = right length

    def as_json(self) -> dict:
        return {
            "pitfall": self.pitfall,
            "metric": self.metric,
            "buggy": float(self.buggy),
            "correct": float(self.correct),
            "cosine": self.cosine,
            "norm_ratio": self.norm_ratio,
            "reference": self.reference,
        }


# ---------------------------------------------------------------------------------------------------------
# Shared set-up: data, models, the reference, and the pieces every twin uses.
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def rows() -> RowSet:
    """The 18 rows every pitfall draws from (built once per process)."""
    generator = torch.Generator().manual_seed(0)
    documents = [
        bytes(torch.randint(ord("a"), ord("z") + 1, (length,), generator=generator).tolist())
        for length in DOCUMENT_BYTES
    ]
    return make_rows(documents, SEQ_LEN)


def step_batches(
    step_ids: list[int],
    world_size: int = 1,
    rank: int = 0,
    micro_batch_size: int = MICRO_BATCH_SIZE,
    global_batch_size: int | None = None,
) -> list[MicroBatch]:
    """This rank's A micro-batches of a step, laid out by the project's own batch builder. A global batch
    larger than the ids makes a partial step: the missing rows become fully masked padding rows."""
    global_batch_size = global_batch_size or len(step_ids)
    ids = torch.tensor(step_ids)
    return build_micro_batches(rows(), ids, global_batch_size, micro_batch_size, world_size, rank, step=0)


def gpt() -> GPT:
    """The same float64 weights every time (the initialisation draws from its own seeded generator)."""
    return GPT(MODEL, seed=MODEL_SEED).double()


def norm_model(norm_class: type[nn.Module]) -> nn.Sequential:
    """The smallest token model with a normalisation layer: embed, normalise, ReLU, project to the vocabulary.

    The norm sees every token of the batch as one row of [rows · seq_len, width], so BatchNorm's statistics
    span all rows and positions of whatever batch it is given. Weights come from a fixed seed without
    touching the caller's random state, so two calls differ only in `norm_class`.
    """
    width = 16
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        model = nn.Sequential(
            nn.Embedding(VOCAB_SIZE, width),
            nn.Flatten(0, 1),
            norm_class(width),
            nn.ReLU(),
            nn.Linear(width, VOCAB_SIZE),
            nn.Unflatten(0, (-1, SEQ_LEN)),
        )
    return model.double()


def clip_like_pytorch(gradient: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """The whole gradient scaled to norm max_norm, as clip_grad_norm_ does (its documented 1e-6 guard included)."""
    total_norm = math.sqrt(sum(float((g**2).sum()) for g in gradient))
    factor = min(1.0, max_norm / (total_norm + 1e-6))
    return [g * factor for g in gradient]


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest entry-wise difference of two gradients, relative to the largest entry of the reference."""
    scale = max(float(r.abs().max()) for r in reference)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) / scale


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def tokens_in(batches: list[MicroBatch]) -> int:
    """N: supervised tokens of the given micro-batches (labels already shifted, padding excluded)."""
    return sum(count_supervised_tokens(mb.labels) for mb in batches)


def loss_sum(model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
    """S_k: the sum of token losses of one micro-batch."""
    return token_cross_entropy_sum(model(micro_batch.inputs), micro_batch.labels)


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR)


def loss_scaler() -> torch.amp.GradScaler:
    """An fp16 run's GradScaler, here on float64: a power-of-two scale multiplies and divides exactly."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


def correct_step(
    model: nn.Module,
    batches: list[MicroBatch],
    grad_clip: float = 0.0,
    scaler: torch.amp.GradScaler | None = None,
) -> list[torch.Tensor]:
    """One step of the project's optimizer_step with SGD; returns the gradient the optimizer used (after
    unscaling and clipping), captured just before the update since the step sets .grad to None at its end."""
    optimizer = sgd(model)
    captured = capture_gradients(optimizer)
    optimizer_step(model, batches, optimizer, device=CPU, scaler=scaler, grad_clip=grad_clip)
    return captured[0]


def flat(vectors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.double().flatten() for v in vectors])


def direction_and_scale(buggy: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[float, float]:
    """(cosine, norm ratio) of the buggy vector against the reference, both flattened over all parameters.

    For SGD the update is -lr · gradient, so the gradients' cosine and norm ratio are the updates'."""
    b, r = flat(buggy), flat(reference)
    cosine = float(b @ r / (b.norm() * r.norm()))
    return round(cosine, 12), float(b.norm() / r.norm())  # rounded: a parallel pair prints 1, not 0.9999999999


def gradient_measurement(
    pitfall: str,
    buggy_gradient: list[torch.Tensor],
    correct_gradient: list[torch.Tensor],
    reference: list[torch.Tensor],
    buggy_reference: list[torch.Tensor] | None = None,
    described: str = "float64 full batch",
) -> Measurement:
    """Both twins' gradients against the reference (the buggy twin's own, when its weights differ)."""
    buggy_reference = reference if buggy_reference is None else buggy_reference
    buggy = max_relative_error(buggy_gradient, buggy_reference)
    correct = max_relative_error(correct_gradient, reference)
    cosine, norm_ratio = direction_and_scale(buggy_gradient, buggy_reference)
    return Measurement(
        pitfall,
        GRADIENT_ERROR,
        buggy,
        correct,
        correct <= GRADIENT_RTOL,
        buggy >= BUG_MIN,
        described,
        cosine,
        norm_ratio,
    )


def against_one_step(pitfall: str, buggy_model: nn.Module, batches: list[MicroBatch]) -> Measurement:
    """The buggy twin's accumulated .grad and the correct twin (optimizer_step on a fresh model), both judged
    against the reference gradient of the same step at the initial weights."""
    reference = float64_reference_gradient(gpt(), batches)
    return gradient_measurement(pitfall, gradients(buggy_model), correct_step(gpt(), batches), reference)


# ---------------------------------------------------------------------------------------------------------
# Single-process pitfalls. Each function: the buggy twin, written out, then the correct twin.
# ---------------------------------------------------------------------------------------------------------


def mean_of_micro_batch_means() -> Measurement:
    """1. Each micro-batch's mean loss, averaged over the A micro-batches. A token of the 3-token micro-batch
    then weighs 32/3 times a token of the 32-token one; the token-mean objective is the mean over all N
    tokens. The Hugging Face Trainer did this until October 2024, and still does for a model whose forward
    takes no count of items (https://github.com/huggingface/transformers/issues/37766)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    for mb in batches:
        micro_mean = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
        (micro_mean / len(batches)).backward()
    return against_one_step("1. mean of micro-batch means", model, batches)


def divided_by_accumulation_twice() -> Measurement:
    """3. The global token denominator N is right, but the habit of dividing by A stays: the gradient is A times
    too small (an lr silently divided by A)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        (loss_sum(model, mb) / tokens / len(batches)).backward()
    return against_one_step("3. divided by A on top of N", model, batches)


def zero_grad_inside_the_group() -> Measurement:
    """4. zero_grad at the top of the micro-batch loop: only the last micro-batch's gradient reaches the update."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    optimizer = sgd(model)
    tokens = tokens_in(batches)
    for mb in batches:
        optimizer.zero_grad()
        (loss_sum(model, mb) / tokens).backward()
    return against_one_step("4. zero_grad inside the group", model, batches)


def missing_zero_grad_between_groups() -> Measurement:
    """5. No zero_grad after the update: the second step's update uses the first step's gradient plus its own.

    Each twin's reference is the gradient of the second step's batch at that twin's weights after step one."""
    groups = [step_batches(STEP_IDS), step_batches(NEXT_STEP_IDS)]
    model = gpt()
    optimizer = sgd(model)
    for batches in groups:
        buggy_reference = float64_reference_gradient(model, batches)
        tokens = tokens_in(batches)
        for mb in batches:
            (loss_sum(model, mb) / tokens).backward()
        optimizer.step()
        # The mistake: no optimizer.zero_grad() here.
    buggy = gradients(model)

    model = gpt()
    for batches in groups:
        reference = float64_reference_gradient(model, batches)
        used = correct_step(model, batches)
    return gradient_measurement(
        "5. no zero_grad between groups", buggy, used, reference, buggy_reference, "float64 full batch of step 2"
    )


def scheduler_stepped_per_micro_batch() -> Measurement:
    """6. scheduler.step() inside the micro-batch loop: the schedule advances A times per update, so an 8-update
    warm-up is over after 2 updates. Expected after k updates of a linear warm-up over W: lr·(k + 1)/(W + 1).
    Accelerate's scheduler wrapper stepped on accumulation steps that applied no update
    (https://github.com/huggingface/accelerate/issues/963)."""
    warmup_updates, updates = 8, 2
    expected_lr = LR * (updates + 1) / (warmup_updates + 1)
    groups = [step_batches(STEP_IDS), step_batches(NEXT_STEP_IDS)]

    model = gpt()
    optimizer = sgd(model)
    scheduler = build_scheduler(optimizer, "constant", warmup_updates, 0, 1.0)
    with warnings.catch_warnings():
        # PyTorch warns when a scheduler steps before the first optimizer.step(): the very mistake shown here.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
        for batches in groups:
            tokens = tokens_in(batches)
            for mb in batches:
                (loss_sum(model, mb) / tokens).backward()
                scheduler.step()  # the mistake
            optimizer.step()
            optimizer.zero_grad()
    buggy_lr = optimizer.param_groups[0]["lr"]

    model = gpt()
    optimizer = sgd(model)
    scheduler = build_scheduler(optimizer, "constant", warmup_updates, 0, 1.0)
    for batches in groups:
        result = optimizer_step(model, batches, optimizer, device=CPU)
        if result.applied:
            scheduler.step()  # as train.py does: the schedule's unit is applied updates
    correct_lr = optimizer.param_groups[0]["lr"]

    buggy, correct = (abs(lr - expected_lr) / expected_lr for lr in (buggy_lr, correct_lr))
    return Measurement(
        "6. scheduler stepped per micro-batch",
        LR_ERROR,
        buggy,
        correct,
        correct <= LR_RTOL,
        buggy >= BUG_MIN,
        "lr · (k + 1) / (W + 1), the warm-up's formula",
    )


def clip_threshold(batches: list[MicroBatch]) -> float:
    """A clipping threshold that bites: a tenth of the norm of the step's true gradient."""
    reference = float64_reference_gradient(gpt(), batches)
    return 0.1 * math.sqrt(sum(float((g**2).sum()) for g in reference))


def clipped_per_micro_batch() -> Measurement:
    """7. clip_grad_norm_ after every backward: the running sum is shrunk again and again, so early
    micro-batches count less than late ones, and the direction of the update changes."""
    batches = step_batches(STEP_IDS)
    max_norm = clip_threshold(batches)
    clipped_reference = clip_like_pytorch(float64_reference_gradient(gpt(), batches), max_norm)
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        (loss_sum(model, mb) / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the mistake: inside the loop
    correct = correct_step(gpt(), batches, grad_clip=max_norm)
    return gradient_measurement(
        "7. clipped per micro-batch",
        gradients(model),
        correct,
        clipped_reference,
        described="float64 full batch, clipped",
    )


def clipped_before_unscale() -> Measurement:
    """8. With a GradScaler, clipping before scaler.unscale_: the gradients still carry the loss scale s, so
    clipping s·g at max_norm clips the true gradient g at max_norm / s. Once it clips (here the threshold is a
    tenth of the true norm, so it always does), the update is s times smaller than the correctly clipped one
    (s = 1024): the right direction, a norm ratio of 1/s."""
    batches = step_batches(STEP_IDS)
    max_norm = clip_threshold(batches)
    clipped_reference = clip_like_pytorch(float64_reference_gradient(gpt(), batches), max_norm)
    model = gpt()
    optimizer = sgd(model)
    scaler = loss_scaler()
    tokens = tokens_in(batches)
    for mb in batches:
        scaler.scale(loss_sum(model, mb) / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the mistake: no scaler.unscale_ before
    scaler.step(optimizer)  # unscales now, after the clip
    scaler.update()
    correct = correct_step(gpt(), batches, grad_clip=max_norm, scaler=loss_scaler())
    return gradient_measurement(
        "8. clipped before unscale_",
        gradients(model),
        correct,
        clipped_reference,
        described="float64 full batch, clipped",
    )


def denominator_counts_unshifted_tokens() -> Measurement:
    """11. N counted from the inputs (an attention mask's sum) instead of the shifted labels: a row of L real
    tokens has L inputs but L - 1 targets, so every short row adds one token that has no loss."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = sum(int((mb.inputs != 0).sum()) for mb in batches)  # the mistake; byte 0 is the padding
    for mb in batches:
        (loss_sum(model, mb) / tokens).backward()
    return against_one_step("11. denominator counts unshifted tokens", model, batches)


def batch_norm_under_micro_batching() -> Measurement:
    """12. BatchNorm normalises with the statistics of the batch it sees: m rows per micro-batch instead of all
    m·A rows of the step, so no accumulation can give the full-batch gradient (and its running statistics
    take A momentum updates per step, each from m rows). Both twins run optimizer_step on the same BatchNorm
    model; the buggy twin accumulates A = 4 micro-batches of m = 2, the correct twin runs the step's 8 rows
    as one micro-batch (A = 1), the only layout whose statistics are the full batch's."""
    micro_batches = step_batches(STEP_IDS)
    whole_batch = step_batches(STEP_IDS, micro_batch_size=len(STEP_IDS))
    reference = float64_reference_gradient(norm_model(nn.BatchNorm1d), micro_batches)
    buggy = correct_step(norm_model(nn.BatchNorm1d), micro_batches)
    correct = correct_step(norm_model(nn.BatchNorm1d), whole_batch)
    return gradient_measurement(
        "12. BatchNorm under micro-batching", buggy, correct, reference, described="float64 full batch (same model)"
    )


def leaky_data_order(num_rows: int, global_batch_size: int, seed: int, epochs: int) -> list[list[torch.Tensor]]:
    """The row ids of every step, by epoch, when an epoch's incomplete last batch is not run but kept in a
    buffer and put in front of the next epoch's rows."""
    steps_by_epoch = []
    carried = torch.empty(0, dtype=torch.long)
    for epoch in range(epochs):
        ids = torch.cat([carried, epoch_permutation(num_rows, seed, epoch)])
        full_steps = len(ids) // global_batch_size
        steps_by_epoch.append(list(ids[: full_steps * global_batch_size].split(global_batch_size)))
        carried = ids[full_steps * global_batch_size :]  # the mistake: the remainder leaks into the next epoch
    return steps_by_epoch


def rows_not_seen_once(step_ids: list[torch.Tensor], num_rows: int) -> int:
    seen = torch.bincount(torch.cat(step_ids), minlength=num_rows)
    return int((seen != 1).sum())


def tail_leaking_into_next_epoch() -> Measurement:
    """13. 18 rows in steps of 8: each epoch leaves 2. Leaked into the next epoch, they are seen twice there
    while as many of that epoch's own rows wait for the epoch after. The project's data order with
    batch.tail="partial" runs a short last step instead: every row exactly once per epoch, the number in the
    correct column. With the default batch.tail="drop" the 2 rows are left out of each epoch (a different 2
    each epoch, as each epoch draws its own permutation): no row twice, 2 never, by design; the check asserts
    that too. The correct twin is the data order (step_row_ids of epoch 1 = steps steps_per_epoch .. 2 ·
    steps_per_epoch - 1): no optimizer step is involved."""
    num_rows, global_batch_size, seed = rows().num_rows, len(STEP_IDS), 0
    buggy = rows_not_seen_once(leaky_data_order(num_rows, global_batch_size, seed, epochs=2)[1], num_rows)
    epoch_1 = {}
    for tail in ("partial", "drop"):
        steps_in_epoch = steps_per_epoch(num_rows, global_batch_size, tail)
        steps = range(steps_in_epoch, 2 * steps_in_epoch)
        epoch_1[tail] = torch.cat([step_row_ids(num_rows, global_batch_size, seed, step, tail) for step in steps])
    correct = rows_not_seen_once(list(epoch_1["partial"].split(1)), num_rows)
    drop_seen = torch.bincount(epoch_1["drop"], minlength=num_rows)
    drop_as_designed = int((drop_seen > 1).sum()) == 0 and int((drop_seen == 0).sum()) == num_rows % global_batch_size
    return Measurement(
        "13. tail group leaking into next epoch",
        ROWS_NOT_ONCE,
        buggy,
        correct,
        correct == 0 and drop_as_designed,
        buggy > 0,
        'every row once with tail "partial" (the data order, step_row_ids; no step runs)',
    )


@contextlib.contextmanager
def saved_tensor_bytes():
    """Track the bytes autograd saves for backward: `live` now, and the `peak` while the context is open.

    Every saved tensor is wrapped in a small object; autograd drops the wrapper when it frees the tensor
    (after backward, or when the graph is garbage), and a finalizer then subtracts its bytes."""
    counts = {"live": 0, "peak": 0}

    class Saved:
        def __init__(self, tensor: torch.Tensor):
            self.tensor = tensor

    def forget(num_bytes: int) -> None:
        counts["live"] -= num_bytes

    def pack(tensor: torch.Tensor) -> Saved:
        num_bytes = tensor.numel() * tensor.element_size()
        counts["live"] += num_bytes
        counts["peak"] = max(counts["peak"], counts["live"])
        saved = Saved(tensor)
        weakref.finalize(saved, forget, num_bytes)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        yield counts


def loss_summed_with_its_graph() -> Measurement:
    """14. `total_loss += loss` with the graph attached, and one backward at the end: the gradient is right, but
    the activations of all A micro-batches are alive at once, the memory accumulation exists to save. The
    correct loop backpropagates each micro-batch at once and keeps only `loss.detach()` for the log.

    torchtune's first fix of its normalization did this and restored a backward per micro-batch in
    https://github.com/meta-pytorch/torchtune/pull/1917.

    (Summing the attached loss only for the log, with a backward per micro-batch, leaks less: backward frees
    the saved tensors, and what the sum keeps is the chain of graph nodes, growing over the run.)"""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = tokens_in(batches)
    with saved_tensor_bytes() as buggy:
        total_loss = torch.zeros((), dtype=torch.float64)
        for mb in batches:
            total_loss += loss_sum(model, mb) / tokens  # the mistake: the sum holds every micro-batch's graph
        total_loss.backward()

    with saved_tensor_bytes() as one_micro_batch:  # the reference: one micro-batch's forward and loss
        loss_sum(gpt(), batches[0])
    with saved_tensor_bytes() as correct:
        correct_step(gpt(), batches)
    return Measurement(
        "14. loss summed with its graph",
        SAVED_BYTES,
        buggy["peak"],
        correct["peak"],
        correct["peak"] == one_micro_batch["peak"],
        buggy["peak"] >= 2 * correct["peak"],
        "one micro-batch's forward",
    )


def partial_group_divided_by_a() -> Measurement:
    """16. The classic loop divides each micro-batch's loss by A. The last group of an epoch may hold fewer
    micro-batches (here 2 of A = 4, full rows only, so the mean-of-means weighting plays no part): its
    gradient is 2/4 of the right one, a silently halved learning rate on that step. Lightning was reported
    to do this (https://github.com/Lightning-AI/pytorch-lightning/issues/19987). The project pads the partial
    step with fully masked rows and divides by its true token count."""
    batches = step_batches(PARTIAL_STEP_IDS, global_batch_size=len(STEP_IDS))  # 2 real micro-batches, 2 padding
    real_batches = [mb for mb in batches if mb.num_examples > 0]
    model = gpt()
    for mb in real_batches:
        micro_mean = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
        (micro_mean / ACCUMULATION_STEPS).backward()  # the mistake: A, though only 2 micro-batches ran
    return against_one_step("16. partial last group divided by A", model, batches)


def adam(model: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR)


def update_of(model: nn.Module, run) -> list[torch.Tensor]:
    """Weights after `run(model)` minus the weights before: the update that was applied."""
    before = [p.detach().clone() for p in model.parameters()]
    run(model)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def optimizer_step_per_micro_batch() -> Measurement:
    """18. optimizer.step() and zero_grad() after every backward (the `if (k + 1) % A == 0` forgotten): A updates
    per step, each from one micro-batch. With Adam each update has about lr per weight whatever the
    gradient's size, so the step moves about A times as far, in a direction no single batch asked for.
    Judged on the update (weights after minus before) against one Adam update with the float64 full-batch
    gradient."""
    batches = step_batches(STEP_IDS)
    tokens = tokens_in(batches)

    def apply_reference(model: nn.Module) -> None:
        for parameter, gradient in zip(model.parameters(), float64_reference_gradient(model, batches), strict=True):
            parameter.grad = gradient
        adam(model).step()

    def buggy_loop(model: nn.Module) -> None:
        optimizer = adam(model)
        for mb in batches:
            (loss_sum(model, mb) / tokens).backward()
            optimizer.step()  # the mistake: inside the loop
            optimizer.zero_grad()

    reference = update_of(gpt(), apply_reference)
    buggy = update_of(gpt(), buggy_loop)
    correct = update_of(gpt(), lambda model: optimizer_step(model, batches, adam(model), device=CPU))
    buggy_error, correct_error = (max_relative_error(u, reference) for u in (buggy, correct))
    return Measurement(
        "18. optimizer.step per micro-batch",
        UPDATE_ERROR,
        buggy_error,
        correct_error,
        correct_error <= UPDATE_RTOL,
        buggy_error >= BUG_MIN,
        "one Adam update from the float64 full batch",
        *direction_and_scale(buggy, reference),
    )


def scaler_update_per_micro_batch() -> Measurement:
    """19. scaler.update() inside the micro-batch loop. On its own it raises at the first micro-batch
    (AssertionError "No inf checks were recorded prior to update": only unscale_ or step record them). With
    unscale_ per micro-batch too (to log or clip each micro-batch's gradient) it runs silently: update()
    clears the "already unscaled" mark, so each later unscale_ divides the whole running sum by the scale s
    again, and scaler.step divides once more. Micro-batch k ends up divided by s^(A - k + 1) on top of its
    own unscaling: the update is all but zero."""
    batches = step_batches(STEP_IDS)
    reference = float64_reference_gradient(gpt(), batches)
    model = gpt()
    optimizer = sgd(model)
    handed = capture_gradients(optimizer)
    scaler = loss_scaler()
    tokens = tokens_in(batches)
    for mb in batches:
        scaler.scale(loss_sum(model, mb) / tokens).backward()
        scaler.unscale_(optimizer)  # e.g. to log each micro-batch's gradient norm
        scaler.update()  # the mistake: once per step, after scaler.step
    scaler.step(optimizer)
    scaler.update()
    correct = correct_step(gpt(), batches, scaler=loss_scaler())
    return gradient_measurement("19. scaler.update per micro-batch", handed[0], correct, reference)


def logged_loss_of_last_micro_batch() -> Measurement:
    """20. The gradient is right (S_k / N per micro-batch), but the loop logs the last micro-batch's mean loss
    (nanoGPT logs `loss.item() * A` of the last micro-batch, an estimate its author chose to avoid a host
    read: https://github.com/karpathy/nanoGPT/pull/207). The logged curve then follows whichever
    micro-batch came last. The project logs the exact global token mean (loss sums all-reduced once)."""
    batches = step_batches(STEP_IDS)
    inputs, labels = torch.cat([mb.inputs for mb in batches]), torch.cat([mb.labels for mb in batches])
    with torch.no_grad():
        reference_loss = float(full_batch_mean_loss(gpt()(inputs), labels))
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        loss = loss_sum(model, mb)
        (loss / tokens).backward()
        logged = float(loss.detach()) / count_supervised_tokens(mb.labels)  # the mistake: the last one wins
    result = optimizer_step(gpt(), batches, sgd(gpt()), device=CPU)
    buggy, correct = (abs(value - reference_loss) / reference_loss for value in (logged, result.loss))
    return Measurement(
        "20. logged loss of the last micro-batch",
        LOSS_ERROR,
        buggy,
        correct,
        correct <= GRADIENT_RTOL,
        buggy >= BUG_MIN,
        "float64 full-batch mean loss",
    )


def micro_batch_means_summed() -> Measurement:
    """21. Each micro-batch's mean loss backpropagated as it is, neither divided by A nor weighted by tokens:
    the gradient is about A times too large, and short micro-batches still weigh too much (both errors at
    once). Reported against nanoGPT in https://github.com/karpathy/nanoGPT/issues/206 (a false alarm there:
    nanoGPT does divide by A)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    for mb in batches:
        F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    return against_one_step("21. micro-batch means summed, not divided by A", model, batches)


# ---------------------------------------------------------------------------------------------------------
# Two-rank pitfalls: one run of 2 gloo ranks computes every twin; the parent measures.
# ---------------------------------------------------------------------------------------------------------


def counted_ddp_model() -> tuple[DistributedDataParallel, dict]:
    model = DistributedDataParallel(gpt())
    state = {"bytes": 0}
    model.register_comm_hook(state, counting_allreduce_hook)
    return model, state


def two_rank_twins(rank: int, world_size: int) -> dict:
    """Runs on each rank: the correct step, then the buggy loops, each on a fresh DDP model."""
    batches = step_batches(TWO_RANK_STEP_IDS, world_size, rank)
    last = len(batches) - 1
    results = {}

    model, sent = counted_ddp_model()
    results["correct"] = {"gradient": correct_step(model, batches), "bytes": sent["bytes"]}

    # 2. Each rank divides by its own token count; DDP then averages the D per-rank means, so a token on the
    # rank with 37 tokens weighs 128/37 times one on the rank with 128. torchtitan normalised per rank until
    # https://github.com/pytorch/torchtitan/pull/2206.
    model = DistributedDataParallel(gpt())
    tokens_local = tokens_in(batches)
    for k, mb in enumerate(batches):
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss_sum(model, mb) / tokens_local).backward()
    results["per-rank means"] = gradients(model)

    # 9. The forward outside no_sync: DDP decides at forward time whether the coming backward all-reduces,
    # so every micro-batch synchronises. The gradient is still right; the communication is A times larger.
    model, sent = counted_ddp_model()
    [tokens_global] = all_reduce_ints([tokens_local], CPU)
    loss_multiplier = world_size / tokens_global  # D / N, as in optimizer_step: DDP's mean over D undoes the D
    for k, mb in enumerate(batches):
        loss = loss_sum(model, mb)
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss * loss_multiplier).backward()
    results["forward outside no_sync"] = {"gradient": gradients(model), "bytes": sent["bytes"]}

    # 10. The sync boundary on the wrong micro-batch: the first synchronises, the last stays local. Each rank
    # steps with the all-reduced first micro-batch plus its own unsynchronised rest, and the replicas drift.
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        with model.no_sync() if k > 0 else contextlib.nullcontext():
            (loss_sum(model, mb) * loss_multiplier).backward()
    results["wrong sync boundary"] = gradients(model)

    # 22. The sync flag set after the forward, in the style of loops that write DDP's attribute by hand
    # (`model.require_backward_grad_sync = k == last`) instead of entering no_sync. DDP reads the flag during
    # the forward, so each forward uses the value set one micro-batch earlier: the first micro-batch finds the
    # default True and all-reduces its partial gradient, the last finds False and stays local. Each rank
    # steps with its own, different gradient.
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        loss = loss_sum(model, mb)
        model.require_backward_grad_sync = k == last  # the mistake: set after the forward that reads it
        (loss * loss_multiplier).backward()
    results["sync flag after the forward"] = gradients(model)

    # 15. Each loss divided by the global N, but not multiplied by D: DDP's mean over the ranks then divides
    # once more, so the gradient is the true one over D. TRL divides its count by the process count for this
    # reason (https://github.com/huggingface/trl/issues/5619 shows the line).
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss_sum(model, mb) / tokens_global).backward()  # the mistake: no × D
    results["times D forgotten"] = gradients(model)

    # 17. No sharding: every rank reads the same examples (rank 0's share, as a loader without a distributed
    # sampler does). The step itself is the project's, so the gradient is exactly that of half the batch,
    # counted twice: the other half of the global batch is never seen.
    model = DistributedDataParallel(gpt())
    results["same data on every rank"] = correct_step(model, step_batches(TWO_RANK_STEP_IDS, world_size, 0))
    return results


def two_rank_pitfalls() -> list[Measurement]:
    per_rank = run_on_ranks(two_rank_twins, WORLD_SIZE)
    batches = [mb for rank in range(WORLD_SIZE) for mb in step_batches(TWO_RANK_STEP_IDS, WORLD_SIZE, rank)]
    reference = float64_reference_gradient(gpt(), batches)
    gradient_bytes = sum(p.numel() * p.element_size() for p in gpt().parameters())
    correct = [r["correct"] for r in per_rank]
    forward_outside = per_rank[0]["forward outside no_sync"]
    correct_divergence = relative_difference(correct[0]["gradient"], correct[1]["gradient"], reference)
    buggy_divergence = relative_difference(*(r["wrong sync boundary"] for r in per_rank), reference)
    flag_divergence = relative_difference(*(r["sync flag after the forward"] for r in per_rank), reference)
    correct_gradient = correct[0]["gradient"]  # rank 1's is bit-identical (row 10's correct column)
    return [
        gradient_measurement(
            "2. no cross-rank token normalization", per_rank[0]["per-rank means"], correct_gradient, reference
        ),
        gradient_measurement(
            "15. ×D compensation forgotten", per_rank[0]["times D forgotten"], correct_gradient, reference
        ),
        gradient_measurement(
            "17. same data on every rank", per_rank[0]["same data on every rank"], correct_gradient, reference
        ),
        Measurement(
            "9. forward outside no_sync",
            ALLREDUCE_BYTES,
            forward_outside["bytes"],
            correct[0]["bytes"],
            correct[0]["bytes"] == gradient_bytes,
            # Exactly this bug: A all-reduces instead of one, while the gradient itself stays right.
            forward_outside["bytes"] == ACCUMULATION_STEPS * gradient_bytes
            and max_relative_error(forward_outside["gradient"], reference) <= GRADIENT_RTOL,
            "one gradient's bytes",
        ),
        Measurement(
            "10. sync boundary on the wrong micro-batch",
            RANK_DIVERGENCE,
            buggy_divergence,
            correct_divergence,
            correct_divergence == 0,
            buggy_divergence >= BUG_MIN,
            "0: ranks bit-identical",
        ),
        Measurement(
            "22. sync flag set after the forward",
            RANK_DIVERGENCE,
            flag_divergence,
            correct_divergence,
            correct_divergence == 0,
            flag_divergence >= BUG_MIN,
            "0: ranks bit-identical",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------
# The gallery: run, print, draw.
# ---------------------------------------------------------------------------------------------------------

SINGLE_PROCESS_PITFALLS = [
    mean_of_micro_batch_means,
    divided_by_accumulation_twice,
    zero_grad_inside_the_group,
    missing_zero_grad_between_groups,
    scheduler_stepped_per_micro_batch,
    clipped_per_micro_batch,
    clipped_before_unscale,
    denominator_counts_unshifted_tokens,
    batch_norm_under_micro_batching,
    tail_leaking_into_next_epoch,
    loss_summed_with_its_graph,
    partial_group_divided_by_a,
    optimizer_step_per_micro_batch,
    scaler_update_per_micro_batch,
    logged_loss_of_last_micro_batch,
    micro_batch_means_summed,
]


def pitfall_number(measurement: Measurement) -> int:
    return int(measurement.pitfall.split(".")[0])


def run_gallery() -> list[Measurement]:
    measurements = two_rank_pitfalls() + [pitfall() for pitfall in SINGLE_PROCESS_PITFALLS]
    return sorted(measurements, key=pitfall_number)


def verdict(measurement: Measurement) -> str:
    if not measurement.correct_agrees:
        return "FAIL: correct twin disagrees"
    if not measurement.bug_shown:
        return "FAIL: bug not shown"
    return "ok"


def number(value: float) -> str:
    """Counts (bytes, rows) in full, anything else to 3 significant digits."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3g}"


def correct_cell(metric: str, value: float) -> str:
    """The correct column as the table prints it: a rounding-level residue as its bound ("< 1e-14"), since its
    digits are the CPU's reduction order (the same row gave 2.54e-16 on an AMD EPYC and 5.09e-16 on an Intel
    Xeon); an exact 0 or a count as it is."""
    bound = ROUNDING_BOUND.get(metric)
    if bound is not None and 0 < value < bound:
        return f"< {bound:.0e}"
    return number(value)


def optional_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def table(measurements: list[Measurement]) -> str:
    header = ("pitfall", "metric", "buggy", "correct", "cosine", "norm ratio", "check")
    lines = [
        (
            m.pitfall,
            m.metric,
            number(m.buggy),
            correct_cell(m.metric, m.correct),
            optional_number(m.cosine),
            optional_number(m.norm_ratio),
            verdict(m),
        )
        for m in measurements
    ]
    widths = [max(len(line[column]) for line in [header, *lines]) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    )


# The figure's panels: each kind of metric on an axis of its own, so bytes, rows and ratios never share a scale.
RELATIVE_ERRORS = (GRADIENT_ERROR, UPDATE_ERROR, LR_ERROR, LOSS_ERROR, RANK_DIVERGENCE)
BYTES = (ALLREDUCE_BYTES, SAVED_BYTES)
COUNTS = (ROWS_NOT_ONCE,)


def draw(measurements: list[Measurement], png_path: str) -> None:
    """Five panels. Top row, one line per pitfall measured as a relative error: the error of each twin (log
    scale; exactly 0 drawn at the floor and marked "0"), then for the rows with vectors the buggy twin's
    direction (cosine with the correct vector) and scale (norm ratio, log scale). Bottom row: the rows
    measured in bytes, and in rows of data."""
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    errors = [m for m in measurements if m.metric in RELATIVE_ERRORS]
    byte_rows = [m for m in measurements if m.metric in BYTES]
    count_rows = [m for m in measurements if m.metric in COUNTS]
    figure = Figure(figsize=(13, 0.32 * len(errors) + 3.2), layout="constrained")
    panels = figure.subplot_mosaic(
        [["error", "cosine", "scale"], ["bytes", "bytes", "counts"]],
        height_ratios=[len(errors), 2.2],
        width_ratios=[1.5, 1, 1],
    )
    floor = 1e-18
    positions = list(range(len(errors)))
    labels = [m.pitfall for m in errors]

    def twin_bars(axes, rows, scale_floor=None):
        for offset, twin, colour in ((-0.2, "buggy", "tab:red"), (0.2, "correct", "tab:green")):
            values = [getattr(m, twin) for m in rows]
            drawn = [max(v, scale_floor) for v in values] if scale_floor else values
            bars = axes.barh([p + offset for p in range(len(rows))], drawn, height=0.4, color=colour, label=twin)
            printed = [number(m.buggy) if twin == "buggy" else correct_cell(m.metric, m.correct) for m in rows]
            axes.bar_label(bars, labels=printed, padding=3, fontsize=7)

    axes = panels["error"]
    twin_bars(axes, errors, floor)
    axes.set_xscale("log")
    axes.set_xlim(floor, 1e6)  # room on the right for the legend
    axes.set_yticks(positions, labels, fontsize=7)
    axes.set_ylim(len(errors) - 0.5, -0.5)  # the first pitfall on top, in every panel of this row
    axes.set_title("relative error against the reference (log)", fontsize=9)
    axes.legend(fontsize=7, loc="upper right")

    for key, field, title in (
        ("cosine", "cosine", "direction: cos(buggy, correct)"),
        ("scale", "norm_ratio", "scale: |buggy| / |correct| (log)"),
    ):
        axes = panels[key]
        values = [getattr(m, field) for m in errors]
        shown = [p for p, v in zip(positions, values, strict=True) if v is not None]
        bars = axes.barh(shown, [v for v in values if v is not None], height=0.5, color="tab:red")
        axes.bar_label(bars, labels=[f"{v:.3g}" for v in values if v is not None], padding=3, fontsize=7)
        axes.set_yticks(positions, [""] * len(positions))
        axes.set_title(title, fontsize=9)
    panels["cosine"].set_xlim(-0.2, 1.25)
    panels["cosine"].axvline(1.0, color="grey", linewidth=0.8)
    panels["scale"].set_xscale("log")
    panels["scale"].set_xlim(1e-6, 1e3)
    panels["scale"].axvline(1.0, color="grey", linewidth=0.8)

    for key, rows, unit in (("bytes", byte_rows, "bytes"), ("counts", count_rows, "rows")):
        axes = panels[key]
        twin_bars(axes, rows)
        axes.set_xlim(0, 1.3 * max(max(m.buggy, m.correct) for m in rows))
        axes.set_xlabel(unit, fontsize=8)
        axes.invert_yaxis()
    panels["bytes"].set_yticks(range(len(byte_rows)), [f"{m.pitfall}\n{m.metric}" for m in byte_rows], fontsize=7)
    panels["counts"].set_yticks([])  # one row: named in the title, so the column keeps the width of the others
    panels["counts"].set_title("\n".join(f"{m.pitfall}\n{m.metric}" for m in count_rows), fontsize=7)
    for key in ("cosine", "scale"):
        panels[key].set_ylim(panels["error"].get_ylim())
    for axes in panels.values():
        axes.tick_params(labelsize=7)
    figure.suptitle("Gradient-accumulation pitfalls: the buggy twin against the correct one", fontsize=10)
    figure.savefig(png_path, dpi=90)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print the measurements as a JSON list instead of the table"
    )
    parser.add_argument("--png", default="pitfalls.png", help="where to write the figure (default: %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one intra-op thread: the spawned ranks use the same two cores
    measurements = run_gallery()
    if args.json:
        print(json.dumps([m.as_json() for m in measurements], indent=1))
    else:
        print(table(measurements))
    draw(measurements, args.png)
    return 0 if all(verdict(m) == "ok" for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
