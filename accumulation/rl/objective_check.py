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
    PolicyObjective,
    RowTerms,
    StepAggregation,
    aggregation,
    completion_lengths,
)
from accumulation.step import StepSetup, optimizer_step

# How far the sampling policy is from the checked weights: each weight tensor moved by this fraction of its root mean
# square along a seeded random direction. An untrained GPT's logits are small, so its ratios move little with its
# weights: at 0.6 the clip (ε = 0.2) binds on about 13 % of the completion tokens of the shipped config's first
# round (scripts/rl/check_objectives.py), far enough to see a wrong bound, near enough that most tokens keep the
# unclipped ratio's gradient.
SAMPLING_POLICY_OFFSET = 0.6
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
    ref_log_probs: torch.Tensor | None = None  # float64 [rows, seq_len]: log π_ref(label), for a KL penalty


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
    if mode == "token-sum":
        return torch.cat(token_losses).sum()
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


def definition_token_losses(objective: PolicyObjective, row: RowTerms):
    """ℓ_t of each completion token of one row from the declared objective's definition (its loss class's
    `definition`: the clipped surrogate's unless a fork's loss declares its own), and where the clip binds."""
    return (objective.loss_class or PolicyLoss).definition(objective, row)


def row_terms(log_softmax_row: torch.Tensor, labels_row: torch.Tensor, rows: StepRows, i: int) -> RowTerms:
    """Row i's RowTerms from its log-softmax [seq_len, vocab] and labels [seq_len]."""
    supervised = labels_row != IGNORE_INDEX
    distributions = log_softmax_row[supervised]
    log_probs = distributions.gather(-1, labels_row[supervised][:, None])[:, 0]
    ref = rows.ref_log_probs[i][supervised] if rows.ref_log_probs is not None else None
    return RowTerms(log_probs, distributions, rows.old_log_probs[i][supervised], rows.advantages[i], ref)


def surrogate_token_losses(
    model: torch.nn.Module, rows: StepRows, objective: PolicyObjective
) -> tuple[list[torch.Tensor], float]:
    """ℓ_it of every completion token, one tensor per row, from one forward; and the fraction of completion tokens
    where the clip binds (ρ ≠ 1 is what makes the check see the clip and the ratio)."""
    log_softmax = torch.log_softmax(model(rows.tokens).double() / objective.temperature, dim=-1)
    losses, clipped = [], 0
    for i in range(rows.labels.shape[0]):
        row_losses, row_clipped = definition_token_losses(objective, row_terms(log_softmax[i], rows.labels[i], rows, i))
        losses.append(row_losses)
        clipped += int(row_clipped.sum())
    return losses, clipped / max(sum(len(row) for row in losses), 1)


def reference_gradient(model: torch.nn.Module, rows: StepRows, objective: PolicyObjective) -> list[torch.Tensor]:
    """∇ of the objective from its definition, float64, over the whole step at once."""
    model.zero_grad(set_to_none=True)
    losses, _ = surrogate_token_losses(model, rows, objective)
    objective_from_definition(objective.aggregation, losses, rows.group_ids.tolist(), objective.constant).backward()
    gradient = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return gradient


def micro_batches_of_rank(
    rows: StepRows, declared: StepAggregation, micro_batch: int, rank: int, ranks: int
) -> list[MicroBatch]:
    """Rank `rank`'s consecutive share of the rows, cut into micro-batches of `micro_batch`, each carrying its
    rows' advantages, old (and reference) log-probabilities and weights."""
    per_rank = rows.labels.shape[0] // ranks
    batches = []
    for first in range(rank * per_rank, (rank + 1) * per_rank, micro_batch):
        selected = slice(first, first + micro_batch)
        extras = {
            "advantages": rows.advantages[selected],
            "old_log_probs": rows.old_log_probs[selected],
            "row_weights": declared.row_weights[selected],
        }
        if rows.ref_log_probs is not None:
            extras["ref_log_probs"] = rows.ref_log_probs[selected]
        batches.append(MicroBatch(rows.tokens[selected], rows.labels[selected], micro_batch, extras))
    return batches


def accumulated_gradient(
    model: torch.nn.Module,
    rows: StepRows,
    objective: PolicyObjective,
    micro_batch: int,
    declare: Declaration = declared_by_the_library,
    rank: int = 0,
    ranks: int = 1,
    loss_sum_fn=None,
) -> list[torch.Tensor]:
    """The gradient the step applies: optimizer_step with SGD at lr 1, the change of the weights. `model` is the
    float64 policy (DDP-wrapped when ranks > 1); its weights are put back afterwards. `loss_sum_fn` is the loss
    under test (PolicyLoss(objective) unless given)."""
    per_rank = rows.labels.shape[0] // ranks
    mode, constant = objective.aggregation, objective.constant
    declared = declare(mode, rows, constant, micro_batch, per_rank // micro_batch * ranks)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    counts = GlobalCounts(declared.normaliser, rows.labels.shape[0])  # N in the declared unit
    optimizer_step(
        StepSetup(
            model, torch.device("cpu"), loss_sum_fn=loss_sum_fn or (objective.loss_class or PolicyLoss)(objective)
        ),
        micro_batches_of_rank(rows, declared, micro_batch, rank, ranks),
        optimizer,
        global_counts=counts,
    )
    with torch.no_grad():
        gradient = [old - p for old, p in zip(before, model.parameters(), strict=True)]
        for p, old in zip(model.parameters(), before, strict=True):
            p.copy_(old)
    return gradient


@torch.no_grad()
def offset_policy(policy: torch.nn.Module, seed: int) -> None:
    """Move each weight tensor of `policy` by SAMPLING_POLICY_OFFSET of its root mean square along a direction drawn
    from `seed`: the same on every rank and every call."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in policy.parameters():
        direction = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
        size = parameter.double().square().mean().sqrt()
        parameter.add_((SAMPLING_POLICY_OFFSET * size * direction).to(parameter.dtype))


def relative_error(update: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """‖update − reference‖ / ‖reference‖ over all parameters."""
    difference = torch.cat([(u - r).flatten() for u, r in zip(update, reference, strict=True)]).norm()
    return float(difference / torch.cat([r.flatten() for r in reference]).norm())


@dataclass(frozen=True)
class ObjectiveCheck:
    objective: PolicyObjective
    passed: bool
    worst_error: float  # relative, over the splits tried
    worst_split: tuple[int, int, int]  # (m, A, D) where it was worst
    whole_step_error: float  # the loss over the whole step as one micro-batch (A = 1, D = 1): the loss alone
    clipped_fraction: float  # completion tokens where the clip binds at the checked weights
    declared_unit: str
    declared_normaliser: float  # at the worst split
    objective_unit: str
    objective_normaliser: float

    def line(self) -> str:
        m, accumulation, ranks = self.worst_split
        verdict = "PASS" if self.passed else "FAIL"
        error = f"relative error {self.worst_error:.1e} at m={m} A={accumulation} D={ranks}"
        text = (
            f"{verdict} {self.objective.aggregation}: the update against the objective's float64 gradient, {error} "
            f"(clip binding on {self.clipped_fraction:.1%} of the completion tokens)"
        )
        if self.passed:
            return text
        if self.whole_step_error > RELATIVE_TOLERANCE:
            return text + (
                f"; the loss itself, over the whole step in one micro-batch, is {self.whole_step_error:.1e} off the "
                f"declared objective ({self.objective.describe()}): the loss, not accumulation"
            )
        return text + (
            f"; normaliser declared: {self.declared_unit} = {self.declared_normaliser:g}, "
            f"the objective's: {self.objective_unit} = {self.objective_normaliser:g}"
        )


def judge(
    objective: PolicyObjective,
    rows: StepRows,
    errors: dict[tuple[int, int, int], float],
    declare: Declaration,
    whole_step_error: float,
    clipped_fraction: float,
) -> ObjectiveCheck:
    """The verdict over the splits tried (`errors`: (m, A, D) → relative error), naming the normalisers."""
    mode, constant = objective.aggregation, objective.constant
    worst_split = max(errors, key=errors.get)
    m, accumulation, ranks = worst_split
    declared = declare(mode, rows, constant, m, accumulation * ranks)
    meant = aggregation(mode, completion_lengths(rows.labels), rows.group_ids, constant)
    return ObjectiveCheck(
        objective,
        errors[worst_split] <= RELATIVE_TOLERANCE,
        errors[worst_split],
        worst_split,
        whole_step_error,
        clipped_fraction,
        declared.unit,
        declared.normaliser,
        NORMALISER_UNITS[mode],
        meant.normaliser,
    )


def check_objective(
    model: torch.nn.Module,
    rows: StepRows,
    micro_batch_sizes: list[int],
    objective: PolicyObjective,
    declare: Declaration = declared_by_the_library,
    loss_sum_fn=None,
) -> ObjectiveCheck:
    """On one process (D = 1): the step's update for each micro-batch size against the objective's gradient, and
    the loss over the whole step as one micro-batch with the objective's own normaliser (which tells a loss that is
    not the objective from an accumulation that is not its sum)."""
    reference = reference_gradient(model, rows, objective)
    _, clipped_fraction = surrogate_token_losses(model, rows, objective)
    rows_total = rows.labels.shape[0]
    errors = {}
    for m in micro_batch_sizes:
        update = accumulated_gradient(model, rows, objective, m, declare, loss_sum_fn=loss_sum_fn)
        errors[(m, rows_total // m, 1)] = relative_error(update, reference)
    whole = accumulated_gradient(model, rows, objective, rows_total, loss_sum_fn=loss_sum_fn)
    return judge(objective, rows, errors, declare, relative_error(whole, reference), clipped_fraction)


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


def per_micro_batch_token_sum_over_a(mode, rows, constant, micro_batch, micro_batches):
    """The token sum divided by the micro-batches, as a loop that divides every loss by A does."""
    return StepAggregation(torch.ones(rows.labels.shape[0], dtype=torch.float64), float(micro_batches), "micro-batches")


WRONG_NORMALISERS: dict[str, Declaration] = {
    "token-mean": per_micro_batch_token_mean,
    "seq-mean-token-mean": sequence_mean_over_targets,
    "seq-mean-token-sum": sequence_mean_over_targets,
    "seq-mean-token-sum-norm": per_micro_batch_constant,
    "prompt-mean": per_micro_batch_prompt_mean,
    "token-sum": per_micro_batch_token_sum_over_a,
}


class MaxForMinSurrogate(PolicyLoss):
    """A planted loss: PPO's bound taken with max in place of min (optimistic, unbounded). At ρ = 1 both are ρ·A,
    so only an off-policy step, where the clip binds, shows it."""

    def surrogate(self, ratio, advantage, low, high):
        return torch.maximum(ratio * advantage, ratio.clamp(low, high) * advantage)


class SequenceRatioWithoutLength(PolicyLoss):
    """A planted loss: GSPO's sequence ratio as the product of the token ratios, without its 1/|y| (the sum of the
    log-ratios, not their mean)."""

    def sequence_log_ratio(self, log_ratio, supervised):
        return log_ratio.sum(dim=1, keepdim=True)


# The planted losses (scripts/rl/check_objectives.py --inject-bug): each must FAIL naming the loss.
WRONG_LOSSES = {"max-for-min": MaxForMinSurrogate, "gspo-without-length": SequenceRatioWithoutLength}
