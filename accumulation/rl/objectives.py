"""The GRPO family's objectives: group-relative advantages, the clipped PPO surrogate, and the five ways of
aggregating its per-token losses, each exact under any micro-batch size m, accumulation A and ranks D.

The step (accumulation/step.py) minimises Σ_r Σ_k S_rk / N: the SUM S_rk of each micro-batch's losses, over the
micro-batches k of every rank r, divided by one number N counted on the host before the first forward. Every
aggregation below is written in that form. For one optimizer step over the trajectories B of the global
mini-batch (mini-batch · D of them), with ℓ_it the loss of token t of trajectory i, L_i its completion tokens,
g(i) its prompt's group, T_g the completion tokens of group g in B, P the groups in B and C a constant:

    mode                        objective                               row weight w_i   normaliser N (unit)
    token-mean (DAPO)           Σ_i Σ_t ℓ_it / Σ_i L_i                  1                Σ_i L_i      (targets)
    seq-mean-token-mean (GRPO)  (1/|B|) Σ_i (1/L_i) Σ_t ℓ_it            1 / L_i          |B|          (sequences)
    seq-mean-token-sum          (1/|B|) Σ_i Σ_t ℓ_it                    1                |B|          (sequences)
    seq-mean-token-sum-norm     (1/(C·|B|)) Σ_i Σ_t ℓ_it                1                C · |B|      (constant
      (Dr. GRPO)                                                                                      × sequences)
    prompt-mean                 (1/P) Σ_g (1/T_g) Σ_{i∈g} Σ_t ℓ_it      1 / T_g(i)       P            (groups)
    token-sum (verl)            Σ_i Σ_t ℓ_it                            1                1            (none: a sum)

so that S_rk = Σ_{i in micro-batch} w_i Σ_t ℓ_it and Σ_r Σ_k S_rk / N is the objective whatever the split.
The weights are per row and depend only on the step's global rows (a length, a group's token count), never on
which micro-batch or rank a row lands in: that is what makes the split invisible. They and N are counted on the
host from the rollout, which every rank holds after the round's one exchange of rewards and lengths, so the
step needs no collective of its own for them.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX

# Each mode and the unit its normaliser counts.
NORMALISER_UNITS = {
    "token-mean": "targets",
    "seq-mean-token-mean": "sequences",
    "seq-mean-token-sum": "sequences",
    "seq-mean-token-sum-norm": "constant x sequences",
    "prompt-mean": "groups",
    "token-sum": "none (a sum)",
}

# Where the importance ratio is taken: per token (PPO, GRPO), or per sequence (GSPO: the geometric mean of the
# sequence's token ratios, the same for each of its tokens).
IMPORTANCE_LEVELS = ("token", "sequence")
# The estimators of KL(π ‖ π_ref) from a token y drawn by π, with d = log π_ref(y) − log π(y):
#   k1 = −d                  unbiased, can be negative
#   k3 = exp(d) − d − 1      unbiased, non-negative, lower variance (Schulman's; GRPO's paper and TRL use it)
KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class PolicyObjective:
    """A GRPO-family objective as settings: the per-token loss

        ℓ_it = −min(ρ·A_i, clip(ρ, 1 − ε_low, 1 + ε_high)·A_i) + β·KL_it − c_H·H_it

    with ρ = ρ_it = π(y_it)/π_old(y_it) (level "token") or s_i = exp((1/L_i) Σ_t log ρ_it) for every token of
    sequence i (level "sequence", GSPO), KL_it the `kl_estimator` of KL(π ‖ π_ref) at the token (β = kl_coef, a
    frozen reference policy), and H_it the entropy of π at the token's position (c_H = entropy_coef, a bonus);
    aggregated over the step by `aggregation` (C = `constant` for seq-mean-token-sum-norm)."""

    aggregation: str = "seq-mean-token-mean"
    constant: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0  # π is softmax(logits / temperature), as the sampler draws from it
    loss_class: type | None = field(default=None, compare=False)  # the PolicyLoss subclass that defines ℓ; None: this

    def describe(self) -> str:
        """The objective in one phrase, for start-up lines and check verdicts."""
        clip = (
            f"ε {self.clip_low:g}" if self.clip_low == self.clip_high else f"ε [{self.clip_low:g}, {self.clip_high:g}]"
        )
        ratio = "sequence-level ratio (GSPO)" if self.level == "sequence" else "token ratio"
        parts = [f"{self.aggregation}", ratio, clip]
        if self.loss_class not in (None, PolicyLoss):
            parts.insert(0, f"{self.loss_class.__module__}:{self.loss_class.__qualname__}")
        if self.kl_coef:
            parts.append(f"KL {self.kl_estimator} x {self.kl_coef:g}")
        if self.entropy_coef:
            parts.append(f"entropy bonus x {self.entropy_coef:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class StepAggregation:
    """What one optimizer step's loss needs besides the model: a weight per row (float64 [rows], in the order
    of the step's global rows) and the normaliser N, counted in `unit`."""

    row_weights: torch.Tensor
    normaliser: float
    unit: str


def completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    """L_i: the completion tokens (targets) of each row of labels [rows, seq_len]."""
    return (labels != IGNORE_INDEX).sum(dim=1)


def aggregation(mode: str, lengths: torch.Tensor, group_ids: torch.Tensor, constant: float = 0.0) -> StepAggregation:
    """The row weights and the normaliser of `mode` for one optimizer step whose global rows (all ranks, all
    micro-batches) have completion lengths `lengths` [rows] and `group_ids` [rows]: host tensors every rank holds
    after the round's exchange, so no collective is needed here. `constant` is Dr. GRPO's C (for
    seq-mean-token-sum-norm only), such as the longest completion the sampler may write."""
    if mode not in NORMALISER_UNITS:
        raise ValueError(f"loss aggregation must be one of {sorted(NORMALISER_UNITS)}, got {mode!r}")
    lengths = lengths.double()
    rows = lengths.shape[0]
    ones = torch.ones(rows, dtype=torch.float64)
    if mode == "token-mean":
        return StepAggregation(ones, float(lengths.sum()), "targets")
    if mode == "seq-mean-token-mean":
        # A completion with no token adds nothing (its sum is empty); max(L, 1) only avoids 0/0.
        return StepAggregation(1.0 / lengths.clamp(min=1), float(rows), "sequences")
    if mode == "seq-mean-token-sum":
        return StepAggregation(ones, float(rows), "sequences")
    if mode == "seq-mean-token-sum-norm":
        if constant <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive constant (the longest completion, say)")
        return StepAggregation(ones, constant * rows, "constant x sequences")
    if mode == "token-sum":
        return StepAggregation(ones, 1.0, "none (a sum)")
    # prompt-mean: T_g, the tokens of each row's group within this step, gathered back onto the rows.
    groups, group_of_row = torch.unique(group_ids, return_inverse=True)
    group_tokens = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, group_of_row, lengths)
    return StepAggregation(1.0 / group_tokens[group_of_row].clamp(min=1), float(len(groups)), "groups")


def group_relative_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """A_i = r_i − mean of its group's rewards, divided by the group's standard deviation (+ epsilon) when
    `scale_by_std` (GRPO); Dr. GRPO leaves the scaling out, since it weighs easy and hard prompts unequally.
    float64 [rows], from float rewards [rows] and int group ids [rows]."""
    rewards = rewards.double()
    groups, group_of_row = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, group_of_row, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, group_of_row, rewards) / count
    centred = rewards - mean[group_of_row]
    if not scale_by_std:
        return centred
    # The unbiased standard deviation, as GRPO's reference code (torch.std) takes it; 0 for a group of one.
    squares = torch.zeros_like(count).index_add_(0, group_of_row, centred.square())
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[group_of_row] + epsilon)


def target_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log π(label) at every position of logits [rows, seq_len, vocab], float32 at least; 0 where the label is
    IGNORE_INDEX."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    supervised = labels != IGNORE_INDEX
    picked = torch.gather(F.log_softmax(logits, dim=-1), -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * supervised


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """The `estimator` (KL_ESTIMATORS) of KL(π ‖ π_ref) at each sampled token, from log π and log π_ref there."""
    difference = ref_log_probs - log_probs
    return -difference if estimator == "k1" else torch.expm1(difference) - difference


def sequence_log_ratio(log_ratio: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """GSPO's log s_i = (1/L_i) Σ_t log ρ_it of each row [rows, 1], from token log-ratios [rows, seq_len] that are 0
    off the completion; 0 for a row without completion tokens."""
    lengths = supervised.sum(dim=1, keepdim=True).clamp(min=1)
    return log_ratio.sum(dim=1, keepdim=True) / lengths


@dataclass(frozen=True)
class RowTerms:
    """What an objective's definition reads of one completion: its tokens' log π and the whole distribution's log π
    at their positions, and the row's recorded sampling data (1-D over its L completion tokens)."""

    log_probs: torch.Tensor  # [L]: log π(y_t)
    distributions: torch.Tensor  # [L, vocab]: log π(·) at each completion position
    old_log_probs: torch.Tensor  # [L]: log π_old(y_t)
    advantage: torch.Tensor  # scalar
    ref_log_probs: torch.Tensor | None  # [L]: log π_ref(y_t), or None


def penalties_from_definition(objective: PolicyObjective, row: RowTerms) -> torch.Tensor:
    """β·KL_t − c_H·H_t of each completion token of one row, from the definitions (KL_ESTIMATORS; the entropy
    −Σ_v π(v) log π(v) at the token's position); 0 where β and c_H are."""
    penalty = torch.zeros_like(row.log_probs)
    if objective.kl_coef:
        d = row.ref_log_probs - row.log_probs  # log(π_ref / π) at the sampled token
        kl = -d if objective.kl_estimator == "k1" else d.exp() - d - 1
        penalty = penalty + objective.kl_coef * kl
    if objective.entropy_coef:
        entropy = -(row.distributions.exp() * row.distributions).sum(dim=-1)
        penalty = penalty - objective.entropy_coef * entropy
    return penalty


@dataclass
class PolicyLoss:
    """A GRPO-family loss on the step's seam: S = Σ_i w_i Σ_t ℓ_it over a micro-batch's completion tokens, with

        ℓ_it = (the policy term of the loss) + β·KL_it − c_H·H_it          (PolicyObjective's settings)

    called as loss(outputs, labels, row_weights=..., <each name of `reads`>=...), the per-row tensors arriving from
    the micro-batch. This class is the clipped surrogate (PolicyObjective); a new objective of the family subclasses
    it and declares, each once:

        reads             the round's per-row fields it takes (Round's attributes), which the rollout source hands
                          both the loop (examples) and the checker (raw_example)
        policy_terms      its policy term, vectorised over [rows, seq_len], and where its clip binds
        policy_definition the same term written from its definition for one row, in float64: the reference the
                          checks compare the loop's update with
        logged            the per-token means the run logs (each a key of log_terms), all ranks, every GRPO step

    Diagnostics are kept detached, on the device, until the source takes them (take_sums, after the step)."""

    objective: PolicyObjective = field(default_factory=PolicyObjective)
    pending: list = field(default_factory=list, repr=False)  # per micro-batch sums of `logged`, then the tokens

    reads = ("advantages", "old_log_probs", "ref_log_probs")
    # clip_fraction: the tokens where the clip binds; approx_kl: k3 = (ρ − 1) − log ρ, Schulman's unbiased,
    # non-negative estimator of KL(π_old ‖ π) from tokens sampled by π_old; entropy: of π at each completion token;
    # kl_ref: the penalty's estimate of KL(π ‖ π_ref) (0 without one).
    logged = ("clip_fraction", "approx_kl", "entropy", "kl_ref")

    def __call__(self, outputs, labels, *, advantages, old_log_probs, row_weights, ref_log_probs=None, **extras):
        objective = self.objective
        supervised = labels != IGNORE_INDEX
        logits = outputs.to(torch.promote_types(outputs.dtype, torch.float32)) / objective.temperature
        all_log_probs = F.log_softmax(logits, dim=-1)
        log_probs = torch.gather(all_log_probs, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * supervised
        token_log_ratio = (log_probs - old_log_probs.to(outputs.device)) * supervised
        log_ratio = token_log_ratio
        if objective.level == "sequence":
            log_ratio = self.sequence_log_ratio(log_ratio, supervised).expand_as(log_ratio) * supervised
        advantage = advantages.to(log_ratio.dtype)[:, None]
        per_token, clipped = self.policy_terms(log_probs, log_ratio, advantage, **extras)
        kl = None
        if ref_log_probs is not None and objective.kl_coef:
            kl = kl_estimate(log_probs, ref_log_probs.to(outputs.device).to(log_probs.dtype), objective.kl_estimator)
            per_token = per_token + objective.kl_coef * kl
        entropy = None
        if objective.entropy_coef or torch.is_grad_enabled():
            entropy = -(all_log_probs.exp() * all_log_probs).sum(dim=-1)
            if objective.entropy_coef:
                per_token = per_token - objective.entropy_coef * entropy
        per_token = per_token * supervised
        if torch.is_grad_enabled():  # a training forward's, not a probe's or a check's (those run without gradient)
            with torch.no_grad():  # diagnostics only; kept on the device until the caller asks (no read-back here)
                approx_kl = torch.expm1(token_log_ratio) - token_log_ratio
                terms = self.log_terms(
                    log_ratio=log_ratio.detach(),
                    clip_fraction=clipped.double(),
                    approx_kl=approx_kl,
                    entropy=entropy.detach(),
                    kl_ref=kl.detach() if kl is not None else torch.zeros_like(approx_kl),
                )
                sums = [(terms[name] * supervised).sum().double() for name in self.logged]
                self.pending.append(torch.stack([*sums, supervised.sum().double()]))
        return (per_token.sum(dim=1) * row_weights.to(per_token.dtype)).sum()

    def policy_terms(self, log_probs, log_ratio, advantage, **extras) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy term of ℓ at every position [rows, seq_len] (masked by the caller) and where the clip binds:
        PPO's pessimistic bound −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A), ρ = exp(log_ratio) at the objective's
        level. The clip binds where it changes the loss: ρ past 1 + ε_high with A > 0, or below 1 − ε_low with
        A < 0."""
        ratio = log_ratio.exp()
        low, high = 1 - self.objective.clip_low, 1 + self.objective.clip_high
        clipped = ((ratio > high) & (advantage > 0)) | ((ratio < low) & (advantage < 0))
        return -self.surrogate(ratio, advantage, low, high), clipped

    def surrogate(self, ratio, advantage, low: float, high: float) -> torch.Tensor:
        """PPO's pessimistic bound: the smaller of the ratio's and the clipped ratio's objective."""
        return torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)

    def sequence_log_ratio(self, log_ratio, supervised) -> torch.Tensor:
        return sequence_log_ratio(log_ratio, supervised)

    def log_terms(self, **terms) -> dict[str, torch.Tensor]:
        """The per-token quantities `logged` names, from those the loss computed (the log-ratio at the objective's
        level, and those `logged` names): a subclass adds its own."""
        return terms

    @classmethod
    def policy_definition(cls, objective: PolicyObjective, row: RowTerms) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy term of ℓ_t of each completion token of one row, written from the definition at the level the
        ratio is defined (the token, or GSPO's whole sequence), and whether the clip binds at each token."""
        log_ratio = row.log_probs - row.old_log_probs
        if objective.level == "sequence":
            # GSPO: s = (Π_t ρ_t)^(1/L), one ratio for the sequence, shared by its L tokens
            ratio = log_ratio.mean().exp().expand_as(log_ratio)
        else:
            ratio = log_ratio.exp()
        low, high = 1 - objective.clip_low, 1 + objective.clip_high
        advantage = row.advantage
        clipped = ((ratio > high) & (advantage > 0)) | ((ratio < low) & (advantage < 0))
        return -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage), clipped

    @classmethod
    def definition(cls, objective: PolicyObjective, row: RowTerms) -> tuple[torch.Tensor, torch.Tensor]:
        """ℓ_t of each completion token of one row from the definition (the policy term and the penalties), and
        where the clip binds: the reference of the objective-level checks."""
        losses, clipped = cls.policy_definition(objective, row)
        return losses + penalties_from_definition(objective, row), clipped

    def take_sums(self) -> torch.Tensor:
        """The sums of `logged`, then the tokens, over the micro-batches since the last call: float64 on the device,
        summed over ranks by the caller before the means are formed."""
        if self.pending:
            sums = torch.stack(self.pending).sum(dim=0)
        else:
            sums = torch.zeros(len(self.logged) + 1, dtype=torch.float64)
        self.pending.clear()
        return sums
