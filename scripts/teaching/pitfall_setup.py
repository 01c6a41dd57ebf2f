"""The pitfall gallery's shared set-up (scripts/teaching/pitfalls.py runs it): the step's rows, the float64
model, the tolerances, the metrics, and how a pair of twins is measured against the reference."""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from accumulation.batching import MicroBatch, accumulation_steps, count_supervised_tokens
from accumulation.data.rows import RowSet, make_rows
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.reference import capture_gradients, float64_reference_gradient, max_relative_error

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
    optimizer_step(StepSetup(model, CPU, scaler=scaler, grad_clip=grad_clip), batches, optimizer)
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
