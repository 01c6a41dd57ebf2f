"""The objective-level check for RL losses: is the accumulated update the gradient of the objective the fork
means, for every split of its rows into micro-batches and ranks?

The equivalence checker (accumulation/checker/) proves that the step computes ∇(Σ S / N) for the N a fork
declares; it cannot see that a fork meant another N. Here the reference is written from the objective's
definition instead, in float64: the per-token losses of each completion, its length, its advantage, its prompt's
group, aggregated with explicit means over tokens, sequences or prompts (objective_from_definition), and
differentiated by autograd over the whole step at once. The update under test is the step's own: the rows cut into
micro-batches of m on D ranks, each carrying its per-row weights, N counted by the fork's declaration, and
accumulation/step.py's optimizer_step with SGD at lr 1, so that the change of the weights is the gradient.

A declaration that is right for one split and wrong for another (a per-micro-batch mean is right when every
micro-batch holds the same tokens) is caught by trying several splits and reporting the worst.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch
from accumulation.rl.objectives import (
    NORMALISER_UNITS,
    PolicyLoss,
    StepAggregation,
    aggregation,
    completion_lengths,
    target_log_probs,
)
from accumulation.step import StepSetup, optimizer_step

# Both sides run in float64 and differ only in the order of their sums (micro-batches, ranks, DDP's mean): a few
# units of 2**-52 per addition, far below this. Every wrong normaliser tried is off by a factor of order one.
RELATIVE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class StepRows:
    """One optimizer step's global rows, all ranks, in row order: what the objective is defined over."""

    tokens: torch.Tensor  # int64 [rows, seq_len]: prompt and completion
    labels: torch.Tensor  # int64 [rows, seq_len]: the next completion token, IGNORE_INDEX elsewhere
    old_log_probs: torch.Tensor  # float64 [rows, seq_len]: log π_old(label), recorded at sampling time
    advantages: torch.Tensor  # float64 [rows]
    group_ids: torch.Tensor  # int64 [rows]: the prompt each row answers


# A declaration: the row weights and normaliser a fork gives the step, from the step's rows, the constant C, and
# the number of rows in each micro-batch (m) and of micro-batches over all ranks (A · D), which a correct one ignores.
Declaration = Callable[[str, StepRows, float, int, int], StepAggregation]


def declared_by_the_library(mode: str, rows: StepRows, constant: float, micro_batch: int, micro_batches: int):
    return aggregation(mode, completion_lengths(rows.labels), rows.group_ids, constant)


def objective_from_definition(
    mode: str, token_losses: list[torch.Tensor], group_ids: list[int], constant: float
) -> torch.Tensor:
    """The objective of `mode` from its definition: `token_losses[i]` the losses of completion i's tokens (a 1-D
    tensor of length L_i), `group_ids[i]` its prompt. No weights and no N: means over what the mode says."""
    if mode == "token-mean":
        return torch.cat(token_losses).mean()
    if mode == "seq-mean-token-mean":
        return torch.stack([losses.mean() for losses in token_losses]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([losses.sum() for losses in token_losses]).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([losses.sum() / constant for losses in token_losses]).mean()
    if mode == "prompt-mean":
        prompts = sorted(set(group_ids))
        per_prompt = [
            torch.cat([losses for losses, g in zip(token_losses, group_ids, strict=True) if g == prompt]).mean()
            for prompt in prompts
        ]
        return torch.stack(per_prompt).mean()
    raise ValueError(f"unknown mode {mode!r}")


def surrogate_token_losses(model: torch.nn.Module, rows: StepRows, clip_ratio: float) -> list[torch.Tensor]:
    """ℓ_it = −min(ρ·A, clip(ρ, 1 ± ε)·A) for each completion token, one tensor per row, from one forward."""
    log_probs = target_log_probs(model(rows.tokens), rows.labels)
    losses = []
    for i in range(rows.labels.shape[0]):
        supervised = rows.labels[i] != IGNORE_INDEX
        ratio = (log_probs[i][supervised] - rows.old_log_probs[i][supervised]).exp()
        advantage = rows.advantages[i]
        clipped = ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
        losses.append(-torch.minimum(ratio * advantage, clipped * advantage))
    return losses


def reference_gradient(
    model: torch.nn.Module, mode: str, rows: StepRows, constant: float, clip_ratio: float
) -> list[torch.Tensor]:
    """∇ of the objective from its definition, float64, over the whole step at once."""
    model.zero_grad(set_to_none=True)
    losses = surrogate_token_losses(model, rows, clip_ratio)
    objective_from_definition(mode, losses, rows.group_ids.tolist(), constant).backward()
    gradient = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return gradient


def micro_batches_of_rank(
    rows: StepRows, declared: StepAggregation, micro_batch: int, rank: int, ranks: int
) -> list[MicroBatch]:
    """Rank `rank`'s consecutive share of the rows, cut into micro-batches of `micro_batch`, each carrying its
    rows' advantages, old log-probabilities and weights."""
    per_rank = rows.labels.shape[0] // ranks
    batches = []
    for first in range(rank * per_rank, (rank + 1) * per_rank, micro_batch):
        selected = slice(first, first + micro_batch)
        extras = {
            "advantages": rows.advantages[selected],
            "old_log_probs": rows.old_log_probs[selected],
            "row_weights": declared.row_weights[selected],
        }
        batches.append(MicroBatch(rows.tokens[selected], rows.labels[selected], micro_batch, extras))
    return batches


def accumulated_gradient(
    model: torch.nn.Module,
    mode: str,
    rows: StepRows,
    constant: float,
    clip_ratio: float,
    micro_batch: int,
    declare: Declaration,
    rank: int = 0,
    ranks: int = 1,
) -> list[torch.Tensor]:
    """The gradient the step applies: optimizer_step with SGD at lr 1, the change of the weights. `model` is the
    float64 policy (DDP-wrapped when ranks > 1); its weights are put back afterwards."""
    per_rank = rows.labels.shape[0] // ranks
    declared = declare(mode, rows, constant, micro_batch, per_rank // micro_batch * ranks)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    counts = GlobalCounts(declared.normaliser, rows.labels.shape[0])  # N in the declared unit
    optimizer_step(
        StepSetup(model, torch.device("cpu"), loss_sum_fn=PolicyLoss(clip_ratio)),
        micro_batches_of_rank(rows, declared, micro_batch, rank, ranks),
        optimizer,
        global_counts=counts,
    )
    with torch.no_grad():
        gradient = [old - p for old, p in zip(before, model.parameters(), strict=True)]
        for p, old in zip(model.parameters(), before, strict=True):
            p.copy_(old)
    return gradient


def relative_error(update: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """‖update − reference‖ / ‖reference‖ over all parameters."""
    difference = torch.cat([(u - r).flatten() for u, r in zip(update, reference, strict=True)]).norm()
    return float(difference / torch.cat([r.flatten() for r in reference]).norm())


@dataclass(frozen=True)
class ObjectiveCheck:
    mode: str
    passed: bool
    worst_error: float  # relative, over the splits tried
    worst_split: tuple[int, int, int]  # (m, A, D) where it was worst
    declared_unit: str
    declared_normaliser: float  # at the worst split
    objective_unit: str
    objective_normaliser: float

    def line(self) -> str:
        m, accumulation, ranks = self.worst_split
        verdict = "PASS" if self.passed else "FAIL"
        error = f"relative error {self.worst_error:.1e} at m={m} A={accumulation} D={ranks}"
        text = f"{verdict} {self.mode}: the update against the objective's float64 gradient, {error}"
        if not self.passed:
            text += (
                f"; normaliser declared: {self.declared_unit} = {self.declared_normaliser:g}, "
                f"the objective's: {self.objective_unit} = {self.objective_normaliser:g}"
            )
        return text


def judge(
    mode: str, rows: StepRows, constant: float, errors: dict[tuple[int, int, int], float], declare: Declaration
) -> ObjectiveCheck:
    """The verdict over the splits tried (`errors`: (m, A, D) → relative error), naming the normalisers."""
    worst_split = max(errors, key=errors.get)
    m, accumulation, ranks = worst_split
    declared = declare(mode, rows, constant, m, accumulation * ranks)
    meant = aggregation(mode, completion_lengths(rows.labels), rows.group_ids, constant)
    return ObjectiveCheck(
        mode,
        errors[worst_split] <= RELATIVE_TOLERANCE,
        errors[worst_split],
        worst_split,
        declared.unit,
        declared.normaliser,
        NORMALISER_UNITS[mode],
        meant.normaliser,
    )


def check_objective(
    model: torch.nn.Module,
    mode: str,
    rows: StepRows,
    micro_batch_sizes: list[int],
    declare: Declaration = declared_by_the_library,
    constant: float = 0.0,
    clip_ratio: float = 0.2,
) -> ObjectiveCheck:
    """On one process (D = 1): the step's update for each micro-batch size against the objective's gradient."""
    reference = reference_gradient(model, mode, rows, constant, clip_ratio)
    rows_total = rows.labels.shape[0]
    errors = {}
    for m in micro_batch_sizes:
        update = accumulated_gradient(model, mode, rows, constant, clip_ratio, m, declare)
        errors[(m, rows_total // m, 1)] = relative_error(update, reference)
    return judge(mode, rows, constant, errors, declare)


# The wrong normalisers the check must catch, one per mode: each is an accumulation bug that frameworks have
# shipped (docs/rl.md names them). Each is a Declaration; the micro-batches are consecutive runs of m rows.


def per_micro_batch_token_mean(mode, rows, constant, micro_batch, micro_batches):
    """token-mean taken in each micro-batch, then averaged over the micro-batches (the loss divided by A)."""
    tokens = completion_lengths(rows.labels).double().view(-1, micro_batch).sum(dim=1).clamp(min=1)
    return StepAggregation(1.0 / tokens.repeat_interleave(micro_batch), float(micro_batches), "micro-batches")


def sequence_mean_over_targets(mode, rows, constant, micro_batch, micro_batches):
    """A sequence mean divided by the completion tokens instead of the completions."""
    meant = aggregation(mode, completion_lengths(rows.labels), rows.group_ids, constant)
    return StepAggregation(meant.row_weights, float(completion_lengths(rows.labels).sum()), "targets")


def per_micro_batch_constant(mode, rows, constant, micro_batch, micro_batches):
    """Dr. GRPO's token sum over C in each micro-batch, averaged over the micro-batches: off by a factor m."""
    return StepAggregation(
        torch.ones(rows.labels.shape[0], dtype=torch.float64), constant * micro_batches, "constant x micro-batches"
    )


def per_micro_batch_prompt_mean(mode, rows, constant, micro_batch, micro_batches):
    """The prompt mean of each micro-batch (its groups' tokens counted there), averaged over the micro-batches."""
    weights = []
    for first in range(0, rows.labels.shape[0], micro_batch):
        selected = slice(first, first + micro_batch)
        piece = aggregation("prompt-mean", completion_lengths(rows.labels[selected]), rows.group_ids[selected])
        weights.append(piece.row_weights / piece.normaliser)
    return StepAggregation(torch.cat(weights), float(micro_batches), "micro-batches")


WRONG_NORMALISERS: dict[str, Declaration] = {
    "token-mean": per_micro_batch_token_mean,
    "seq-mean-token-mean": sequence_mean_over_targets,
    "seq-mean-token-sum": sequence_mean_over_targets,
    "seq-mean-token-sum-norm": per_micro_batch_constant,
    "prompt-mean": per_micro_batch_prompt_mean,
}
