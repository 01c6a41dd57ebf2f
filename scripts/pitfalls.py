"""A gallery of real gradient-accumulation bugs, each measured next to the correct update on the same data.

    python scripts/pitfalls.py [--json] [--png PATH]

Every pitfall is a pair of twins. The buggy twin is the mistake written out plainly, as people write it; the
correct twin is this project's `optimizer_step` (or its data order), so the gallery tests our loop as well.
Most pairs are judged against an independent reference: PyTorch's own token-mean cross-entropy
(`reduction="mean"`, `ignore_index=-100`) over one big float64 batch made of every micro-batch of the step.

The table on stdout (or, with --json, a list of {"pitfall", "metric", "buggy", "correct"}) shows one number
per twin; the figure (--png, default pitfalls.png) shows the same numbers as bars on a log scale. The exit
status is 1 when a correct twin disagrees with its reference or a buggy twin fails to show its bug, so the
gallery doubles as a test. It takes about ten seconds on 2 CPU cores; three pitfalls need 2 gloo ranks,
which it spawns itself.
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
    max_relative_error,
)

SEQ_LEN = 16
VOCAB_SIZE = 256  # byte tokens, as make_rows cuts them
MODEL = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=32, vocab_size=VOCAB_SIZE)
MODEL_SEED = 7
MICRO_BATCH_SIZE = 2  # m
LR = 0.1
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

GRADIENT_ERROR = "relative gradient error vs float64 full batch"
ALLREDUCE_BYTES = "gradient bytes all-reduced per update"
RANK_DIVERGENCE = "gradient difference between ranks (relative)"
LR_ERROR = "relative lr error after 2 updates"
ROWS_NOT_ONCE = "rows of epoch 1 seen twice or never"
SAVED_BYTES = "peak bytes saved for backward"


@dataclass
class Measurement:
    pitfall: str
    metric: str
    buggy: float
    correct: float
    correct_agrees: bool  # the correct twin matches its reference within the metric's tolerance
    bug_shown: bool  # the buggy twin is off by at least the metric's threshold

    def as_json(self) -> dict:
        return {
            "pitfall": self.pitfall,
            "metric": self.metric,
            "buggy": float(self.buggy),
            "correct": float(self.correct),
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


def step_batches(step_ids: list[int], world_size: int = 1, rank: int = 0) -> list[MicroBatch]:
    """This rank's A micro-batches of a step, laid out by the project's own batch builder."""
    return build_micro_batches(rows(), torch.tensor(step_ids), len(step_ids), MICRO_BATCH_SIZE, world_size, rank)


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


def gradient_measurement(pitfall: str, buggy: float, correct: float) -> Measurement:
    return Measurement(pitfall, GRADIENT_ERROR, buggy, correct, correct <= GRADIENT_RTOL, buggy >= BUG_MIN)


def against_one_step(pitfall: str, buggy_model: nn.Module, batches: list[MicroBatch]) -> Measurement:
    """The buggy twin's accumulated .grad and the correct twin (optimizer_step on a fresh model), both judged
    against the reference gradient of the same step at the initial weights."""
    reference = float64_reference_gradient(gpt(), batches)
    buggy = max_relative_error(gradients(buggy_model), reference)
    correct = max_relative_error(correct_step(gpt(), batches), reference)
    return gradient_measurement(pitfall, buggy, correct)


# ---------------------------------------------------------------------------------------------------------
# Single-process pitfalls. Each function: the buggy twin, written out, then the correct twin.
# ---------------------------------------------------------------------------------------------------------


def mean_of_micro_batch_means() -> Measurement:
    """1. Each micro-batch's mean loss, averaged over the A micro-batches. A token of the 3-token micro-batch
    then weighs 32/3 times a token of the 32-token one; the objective is the mean over all N tokens."""
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
        reference = float64_reference_gradient(model, batches)
        tokens = tokens_in(batches)
        for mb in batches:
            (loss_sum(model, mb) / tokens).backward()
        optimizer.step()
        # The mistake: no optimizer.zero_grad() here.
    buggy = max_relative_error(gradients(model), reference)

    model = gpt()
    for batches in groups:
        reference = float64_reference_gradient(model, batches)
        used = correct_step(model, batches)
    correct = max_relative_error(used, reference)
    return gradient_measurement("5. no zero_grad between groups", buggy, correct)


def scheduler_stepped_per_micro_batch() -> Measurement:
    """6. scheduler.step() inside the micro-batch loop: the schedule advances A times per update, so an 8-update
    warm-up is over after 2 updates. Expected after k updates of a linear warm-up over W: lr·(k + 1)/(W + 1)."""
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
        "6. scheduler stepped per micro-batch", LR_ERROR, buggy, correct, correct <= LR_RTOL, buggy >= BUG_MIN
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
    buggy = max_relative_error(gradients(model), clipped_reference)

    correct = max_relative_error(correct_step(gpt(), batches, grad_clip=max_norm), clipped_reference)
    return gradient_measurement("7. clipped per micro-batch", buggy, correct)


def clipped_before_unscale() -> Measurement:
    """8. With a GradScaler, clipping before scaler.unscale_: the gradients still carry the loss scale s, so
    the threshold is applied to s·g, and the update ends up s times too small (here s = 1024)."""
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
    buggy = max_relative_error(gradients(model), clipped_reference)

    correct = max_relative_error(
        correct_step(gpt(), batches, grad_clip=max_norm, scaler=loss_scaler()), clipped_reference
    )
    return gradient_measurement("8. clipped before unscale_", buggy, correct)


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
    m·A rows of the step, so no accumulation can give the full-batch gradient. Both twins run optimizer_step
    and are compared with the full batch of the same model; the correct twin normalises per token
    (LayerNorm, as the project's GPT does), so micro-batching does not change it."""
    batches = step_batches(STEP_IDS)
    errors = []
    for norm_class in (nn.BatchNorm1d, nn.LayerNorm):
        model = norm_model(norm_class)
        reference = float64_reference_gradient(model, batches)
        errors.append(max_relative_error(correct_step(model, batches), reference))
    return gradient_measurement("12. BatchNorm under micro-batching", *errors)


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
    while as many of that epoch's own rows wait for the epoch after. The project's data order
    (batch.tail="partial") runs a short last step instead: every row exactly once per epoch."""
    num_rows, global_batch_size, seed = rows().num_rows, len(STEP_IDS), 0
    buggy = rows_not_seen_once(leaky_data_order(num_rows, global_batch_size, seed, epochs=2)[1], num_rows)
    steps_in_epoch = steps_per_epoch(num_rows, global_batch_size, "partial")
    epoch_1 = [
        step_row_ids(num_rows, global_batch_size, seed, step, "partial")
        for step in range(steps_in_epoch, 2 * steps_in_epoch)
    ]
    correct = rows_not_seen_once(epoch_1, num_rows)
    return Measurement("13. tail group leaking into next epoch", ROWS_NOT_ONCE, buggy, correct, correct == 0, buggy > 0)


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
    )


# ---------------------------------------------------------------------------------------------------------
# Two-rank pitfalls: one run of 2 gloo ranks computes every twin; the parent measures.
# ---------------------------------------------------------------------------------------------------------


def counted_ddp_model() -> tuple[DistributedDataParallel, dict]:
    model = DistributedDataParallel(gpt())
    state = {"bytes": 0}
    model.register_comm_hook(state, counting_allreduce_hook)
    return model, state


def two_rank_twins(rank: int, world_size: int) -> dict:
    """Runs on each rank: the correct step, then the three buggy loops, each on a fresh DDP model."""
    batches = step_batches(TWO_RANK_STEP_IDS, world_size, rank)
    last = len(batches) - 1
    results = {}

    model, sent = counted_ddp_model()
    results["correct"] = {"gradient": correct_step(model, batches), "bytes": sent["bytes"]}

    # 2. Each rank divides by its own token count; DDP then averages the D per-rank means, so a token on the
    # rank with 37 tokens weighs 128/37 times one on the rank with 128.
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
    return [
        gradient_measurement(
            "2. no cross-rank token normalization",
            max_relative_error(per_rank[0]["per-rank means"], reference),
            max(max_relative_error(r["gradient"], reference) for r in correct),
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
        ),
        Measurement(
            "10. sync boundary on the wrong micro-batch",
            RANK_DIVERGENCE,
            buggy_divergence,
            correct_divergence,
            correct_divergence == 0,
            buggy_divergence >= BUG_MIN,
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


def table(measurements: list[Measurement]) -> str:
    header = ("pitfall", "metric", "buggy", "correct", "check")
    lines = [(m.pitfall, m.metric, number(m.buggy), number(m.correct), verdict(m)) for m in measurements]
    widths = [max(len(line[column]) for line in [header, *lines]) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    )


def draw(measurements: list[Measurement], png_path: str) -> None:
    """Horizontal bars on a log scale, buggy and correct side by side for each pitfall. Units differ from row
    to row (each row names its metric); a value of exactly 0 is drawn at the axis floor and marked "0"."""
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    floor = 1e-18
    figure = Figure(figsize=(11, 0.55 * len(measurements) + 1.2), layout="constrained")
    axes = figure.subplots()
    positions = range(len(measurements))
    for offset, twin, colour in ((-0.2, "buggy", "tab:red"), (0.2, "correct", "tab:green")):
        values = [getattr(m, twin) for m in measurements]
        bars = axes.barh(
            [p + offset for p in positions], [max(v, floor) for v in values], height=0.4, color=colour, label=twin
        )
        axes.bar_label(bars, labels=["0" if v == 0 else f"{v:.2g}" for v in values], padding=3, fontsize=7)
    axes.set_xscale("log")
    axes.set_xlim(floor, 1e10)
    axes.set_xlabel(f"each row's own metric, log scale (exactly 0 is drawn at {floor:g})")
    axes.set_yticks(list(positions), [f"{m.pitfall}\n{m.metric}" for m in measurements], fontsize=7)
    axes.invert_yaxis()
    axes.set_title("Gradient-accumulation pitfalls: buggy twin vs the correct update")
    figure.legend(loc="outside upper right")
    figure.savefig(png_path, dpi=120)


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
