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
}


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


@dataclass
class PolicyLoss:
    """The clipped PPO surrogate as the step's loss: S = Σ_i w_i Σ_t ℓ_it over a micro-batch's completion tokens,

        ρ_it = π(y_it) / π_old(y_it)           (π_old: the sampling policy, its log-probabilities recorded then)
        ℓ_it = −min(ρ_it · A_i, clip(ρ_it, 1 − ε, 1 + ε) · A_i)

    called as loss(outputs, labels, advantages=..., old_log_probs=..., row_weights=...), the per-row tensors
    arriving from the micro-batch. It also keeps, detached, what the logs report: tokens where the clip binds,
    and Σ_t of the approximate KL to the sampling policy, k3 = (ρ − 1) − log ρ (Schulman's unbiased,
    non-negative estimator of KL(π_old ‖ π) from tokens sampled by π_old: E[ρ] = 1 under π_old)."""

    clip_ratio: float = 0.2  # ε
    pending: list = field(default_factory=list, repr=False)  # per micro-batch [clipped, KL sum, tokens], on device

    def __call__(self, outputs, labels, *, advantages, old_log_probs, row_weights) -> torch.Tensor:
        supervised = labels != IGNORE_INDEX
        log_ratio = (target_log_probs(outputs, labels) - old_log_probs.to(outputs.device)) * supervised
        ratio = log_ratio.exp()
        advantage = advantages.to(ratio.dtype)[:, None]
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - self.clip_ratio, 1 + self.clip_ratio) * advantage)
        per_token = -surrogate * supervised
        if torch.is_grad_enabled():  # a training forward's, not a probe's or a check's (those run without gradient)
            with torch.no_grad():  # diagnostics only; kept on the device until the caller asks (no read-back here)
                # The clip binds where it changes the loss: the ratio past 1 + ε with A > 0, or below 1 − ε with A < 0.
                above, below = ratio > 1 + self.clip_ratio, ratio < 1 - self.clip_ratio
                clipped = ((above & (advantage > 0)) | (below & (advantage < 0))) & supervised
                kl = (torch.expm1(log_ratio) - log_ratio) * supervised
                self.pending.append(torch.stack([clipped.sum().double(), kl.sum().double(), supervised.sum().double()]))
        return (per_token.sum(dim=1) * row_weights.to(per_token.dtype)).sum()

    def take_sums(self) -> torch.Tensor:
        """[clipped tokens, Σ approximate KL, tokens] over the micro-batches since the last call: float64 on the
        device, summed over ranks by the caller before the ratios are formed."""
        sums = torch.stack(self.pending).sum(dim=0) if self.pending else torch.zeros(3, dtype=torch.float64)
        self.pending.clear()
        return sums
