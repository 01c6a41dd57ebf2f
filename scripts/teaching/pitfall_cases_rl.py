"""The gallery's RL rows: accumulation bugs of GRPO-family losses as frameworks shipped them, each next to the
correct update. scripts/teaching/pitfalls.py runs them with the other rows; docs/accumulation.md (section 23)
explains the modes and names the code each bug was read in.

The data is one optimizer step of a small rollout: 4 prompts x 2 completions, whose completions hold 1 to 12
tokens, with group-relative advantages and old log-probabilities a little off the current policy (so that the
PPO clip binds on some tokens). Every buggy twin is the framework's loop written out plainly: a forward per
micro-batch, the loss normalised the way that code normalised it, a backward. The correct twin is this project's
`optimizer_step`, its loss weighted per row and its normaliser N counted on the host (accumulation/rl/objectives.py
gives the weights and N of each mode). Both are judged against the float64 gradient of the objective written from
its definition (`objective_from_definition`): explicit means over tokens, completions or prompts, one forward over
the whole step, no weights and no N.
"""

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch
from accumulation.models.gpt import GPT
from accumulation.rl.objectives import aggregation
from accumulation.step import StepSetup, optimizer_step
from scripts.teaching.pitfall_setup import CPU, MODEL, SEQ_LEN, WORLD_SIZE, Measurement, gpt, gradient_measurement
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients

PROMPT_TOKENS = 3
COMPLETION_TOKENS = (11, 12, 2, 1, 9, 7, 3, 5)  # L_i of the 8 trajectories: 50 completion tokens in all
# In micro-batches of m = 2 rows they hold 23, 3, 16 and 8 completion tokens.
GROUP_SIZE = 2  # completions per prompt; rows 2g and 2g + 1 answer prompt g
REWARDS = (1.0, 0.0, 0.2, 0.9, 0.7, 0.1, 0.0, 0.6)
MICRO_BATCH_SIZE = 2  # m: one prompt's group per micro-batch
CLIP_RATIO = 0.2  # ε of the PPO clip
DR_GRPO_CONSTANT = 12.0  # C: the longest completion the sampler may write
# verl's use_dynamic_bsz cuts a mini-batch into micro-batches by a budget of tokens (prompt and completion) per
# micro-batch instead of a count of rows: here they hold 1, 2, 2, 2 and 1 rows.
TOKEN_BUDGET = 20
TEACHER_SEED = 11  # the distillation rows' teacher: the same architecture, other weights
REFERENCE = "float64 objective from its definition"
OBJECTIVE_ERROR = "relative gradient error vs float64 objective"


# ---------------------------------------------------------------------------------------------------------
# The rollout, the per-token losses and the objective from its definition.
# ---------------------------------------------------------------------------------------------------------


def rollout() -> dict[str, torch.Tensor]:
    """The step's 8 trajectories: tokens [rows, SEQ_LEN] (prompt, completion, padding), labels (the next
    completion token, IGNORE_INDEX elsewhere), advantages [rows] (reward minus its group's mean, Dr. GRPO's
    unscaled form), group ids [rows], and old log-probabilities [rows, SEQ_LEN]: the current policy's, moved by up
    to ±0.3 nats per token, as if sampled a few updates ago."""
    generator = torch.Generator().manual_seed(3)
    rows = len(COMPLETION_TOKENS)
    sequence = torch.randint(ord("a"), ord("z") + 1, (rows, SEQ_LEN + 1), generator=generator)
    labels = torch.full((rows, SEQ_LEN), IGNORE_INDEX)
    for i, length in enumerate(COMPLETION_TOKENS):
        # Position t predicts token t + 1: the completion's tokens sit at PROMPT_TOKENS .. PROMPT_TOKENS + L - 1.
        labels[i, PROMPT_TOKENS - 1 : PROMPT_TOKENS - 1 + length] = sequence[i, PROMPT_TOKENS : PROMPT_TOKENS + length]
    group_ids = torch.arange(rows) // GROUP_SIZE
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    group_means = rewards.view(-1, GROUP_SIZE).mean(dim=1)
    advantages = rewards - group_means[group_ids]
    with torch.no_grad():
        current = target_log_probs(gpt()(sequence[:, :SEQ_LEN]), labels)
    offsets = (torch.rand(rows, SEQ_LEN, generator=generator, dtype=torch.float64) - 0.5) * 0.6
    old_log_probs = (current + offsets) * (labels != IGNORE_INDEX)
    return {
        "tokens": sequence[:, :SEQ_LEN],
        "labels": labels,
        "advantages": advantages,
        "group_ids": group_ids,
        "old_log_probs": old_log_probs,
    }


def target_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log π(label) at each position [rows, seq]; 0 where nothing is supervised."""
    picked = torch.gather(F.log_softmax(logits, dim=-1), -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (labels != IGNORE_INDEX)


def surrogate_losses(logits, labels, advantages, old_log_probs) -> torch.Tensor:
    """ℓ_it = −min(ρ·A_i, clip(ρ, 1 ± ε)·A_i), ρ = π/π_old, at each completion token; 0 elsewhere. [rows, seq]"""
    ratio = (target_log_probs(logits, labels) - old_log_probs).exp()
    advantage = advantages[:, None]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP_RATIO, 1 + CLIP_RATIO) * advantage)
    return -surrogate * (labels != IGNORE_INDEX)


def distillation_losses(logits, labels, teacher_logits) -> torch.Tensor:
    """KL(teacher ‖ student) over the vocabulary at each completion position (a supervised distillation loss);
    0 elsewhere. [rows, seq]"""
    teacher = F.log_softmax(teacher_logits, dim=-1)
    kl = (teacher.exp() * (teacher - F.log_softmax(logits, dim=-1))).sum(dim=-1)
    return kl * (labels != IGNORE_INDEX)


def teacher_logits(tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return GPT(MODEL, seed=TEACHER_SEED).double()(tokens)


def token_losses(model, rows: dict, selected=slice(None), loss: str = "surrogate") -> torch.Tensor:
    """The per-token losses [rows, seq] of the selected rows, from one forward of `model`."""
    logits = model(rows["tokens"][selected])
    labels = rows["labels"][selected]
    if loss == "distillation":
        return distillation_losses(logits, labels, teacher_logits(rows["tokens"][selected]))
    return surrogate_losses(logits, labels, rows["advantages"][selected], rows["old_log_probs"][selected])


def objective_from_definition(mode: str, per_token: torch.Tensor, labels: torch.Tensor, group_ids) -> torch.Tensor:
    """The step's objective, means taken over what `mode` says: tokens (token-mean), completions of their token
    mean (seq-mean-token-mean), completions of their token sum over C (seq-mean-token-sum-norm, Dr. GRPO)."""
    completions = [per_token[i][labels[i] != IGNORE_INDEX] for i in range(labels.shape[0])]
    if mode == "token-mean":
        return torch.cat(completions).mean()
    if mode == "seq-mean-token-mean":
        return torch.stack([losses.mean() for losses in completions]).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([losses.sum() / DR_GRPO_CONSTANT for losses in completions]).mean()
    raise ValueError(f"no definition written for {mode!r}")


def reference_gradient(mode: str, loss: str = "surrogate") -> list[torch.Tensor]:
    """∇ of the objective from its definition, float64, all 8 rows in one forward."""
    rows, model = rollout(), gpt()
    objective_from_definition(mode, token_losses(model, rows, loss=loss), rows["labels"], rows["group_ids"]).backward()
    return [p.grad.clone() for p in model.parameters()]


def implied_gradient(row_weights: torch.Tensor, loss: str = "surrogate") -> list[torch.Tensor]:
    """∇ Σ_i c_i Σ_t ℓ_it for any per-row weights c [rows]: what a bug that reweights rows computes, for the tests
    to predict each buggy twin from its formula."""
    rows, model = rollout(), gpt()
    (token_losses(model, rows, loss=loss).sum(dim=1) * row_weights).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------------------
# The correct twin: optimizer_step with the mode's row weights and normaliser.
# ---------------------------------------------------------------------------------------------------------


def weighted_surrogate_sum(outputs, labels, *, advantages, old_log_probs, row_weights) -> torch.Tensor:
    """S = Σ_i w_i Σ_t ℓ_it over one micro-batch: the step divides the sum of these by N."""
    return (surrogate_losses(outputs, labels, advantages, old_log_probs).sum(dim=1) * row_weights).sum()


def weighted_distillation_sum(outputs, labels, *, teacher, row_weights) -> torch.Tensor:
    return (distillation_losses(outputs, labels, teacher).sum(dim=1) * row_weights).sum()


def micro_batches(rows: dict, weights: torch.Tensor, bounds: list[tuple[int, int]], loss: str) -> list[MicroBatch]:
    """The rows [first, last) of each bound as a micro-batch, with the per-row tensors its loss reads."""
    batches = []
    for first, last in bounds:
        selected = slice(first, last)
        extras = {"row_weights": weights[selected]}
        if loss == "distillation":
            extras["teacher"] = teacher_logits(rows["tokens"][selected])
        else:
            extras |= {"advantages": rows["advantages"][selected], "old_log_probs": rows["old_log_probs"][selected]}
        batches.append(MicroBatch(rows["tokens"][selected], rows["labels"][selected], last - first, extras))
    return batches


def fixed_bounds(first: int, last: int, micro_batch_size: int = MICRO_BATCH_SIZE) -> list[tuple[int, int]]:
    return [(start, start + micro_batch_size) for start in range(first, last, micro_batch_size)]


def correct_gradient(
    mode: str, model=None, bounds=None, loss: str = "surrogate", step_rows: slice = slice(None)
) -> list[torch.Tensor]:
    """The gradient optimizer_step hands to SGD for the step's rows `step_rows` (all ranks), this rank's share
    cut at `bounds`: row weights and N of `mode` from the library, counted over the step's rows on the host."""
    rows = rollout()
    lengths = (rows["labels"][step_rows] != IGNORE_INDEX).sum(dim=1)
    declared = aggregation(mode, lengths, rows["group_ids"][step_rows], DR_GRPO_CONSTANT)
    weights = torch.zeros(rows["labels"].shape[0], dtype=torch.float64)
    weights[step_rows] = declared.row_weights
    model = gpt() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    optimizer_step(
        StepSetup(
            model, CPU, loss_sum_fn=weighted_distillation_sum if loss == "distillation" else weighted_surrogate_sum
        ),
        micro_batches(rows, weights, bounds or fixed_bounds(0, len(COMPLETION_TOKENS)), loss),
        optimizer,
        global_counts=GlobalCounts(declared.normaliser, int(lengths.numel())),
    )
    return captured[0]


def gradient_of(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def objective_measurement(pitfall, buggy, correct, reference, described=REFERENCE) -> Measurement:
    """Both twins against the objective's gradient (the gallery's gradient numbers, under this metric's name)."""
    measured = gradient_measurement(pitfall, buggy, correct, reference, described=described)
    return dataclasses.replace(measured, metric=OBJECTIVE_ERROR)


# ---------------------------------------------------------------------------------------------------------
# The buggy twins, one process.
# ---------------------------------------------------------------------------------------------------------


def token_mean_per_micro_batch_over_a() -> Measurement:
    """26. A token-mean (DAPO) loss averaged inside each micro-batch, then scaled by 1/A: a token of the 3-token
    micro-batch weighs 23/3 times one of the 23-token micro-batch. verl's legacy actor loop did this whenever
    agg_loss fell back to the micro-batch's own token count (https://github.com/volcengine/verl/pull/906,
    https://github.com/verl-project/verl/issues/7321); TRL's "bnpo" loss and its DAPO before
    https://github.com/huggingface/trl/pull/3938 normalise the same way, and so does mlx-lm's SFT trainer
    (https://github.com/ml-explore/mlx-lm/pull/1544)."""
    rows, model = rollout(), gpt()
    bounds = fixed_bounds(0, len(COMPLETION_TOKENS))
    for first, last in bounds:
        per_token = token_losses(model, rows, slice(first, last))
        micro_batch_tokens = (rows["labels"][first:last] != IGNORE_INDEX).sum()
        (per_token.sum() / micro_batch_tokens / len(bounds)).backward()
    return objective_measurement(
        "26. RL token-mean per micro-batch, × 1/A (verl #906, #7321)",
        gradient_of(model),
        correct_gradient("token-mean"),
        reference_gradient("token-mean"),
    )


def token_budget_bounds() -> list[tuple[int, int]]:
    """Consecutive rows packed into micro-batches of at most TOKEN_BUDGET prompt and completion tokens."""
    bounds, first, used = [], 0, 0
    for i, length in enumerate(COMPLETION_TOKENS):
        if used + PROMPT_TOKENS + length > TOKEN_BUDGET:
            bounds.append((first, i))
            first, used = i, 0
        used += PROMPT_TOKENS + length
    return bounds + [(first, len(COMPLETION_TOKENS))]


def token_mean_scaled_by_row_share() -> Measurement:
    """27. Micro-batches cut by a token budget hold different numbers of rows; each micro-batch's token mean is
    scaled by its share of the rows (rows_k / rows of the step), a weighting that is right for a sequence mean
    and wrong for a token mean. verl's legacy actor with use_dynamic_bsz
    (https://github.com/verl-project/verl/issues/5625, fix proposed in #5641)."""
    rows, model = rollout(), gpt()
    step_rows = len(COMPLETION_TOKENS)
    bounds = token_budget_bounds()
    for first, last in bounds:
        per_token = token_losses(model, rows, slice(first, last))
        micro_batch_tokens = (rows["labels"][first:last] != IGNORE_INDEX).sum()
        (per_token.sum() / micro_batch_tokens * ((last - first) / step_rows)).backward()
    return objective_measurement(
        "27. RL token-mean × row share of the micro-batch (verl #5625)",
        gradient_of(model),
        correct_gradient("token-mean", bounds=bounds),
        reference_gradient("token-mean"),
    )


def dr_grpo_sum_over_c_per_micro_batch() -> Measurement:
    """28. Dr. GRPO's loss, each completion's token sum over the constant C, summed over the micro-batch's
    completions instead of averaged, then scaled by 1/A: the gradient is m times the objective's (m rows per
    micro-batch). verl's agg_loss "seq-mean-token-sum-norm" until February 2026
    (https://github.com/verl-project/verl/issues/3741, fixed by #5366)."""
    rows, model = rollout(), gpt()
    bounds = fixed_bounds(0, len(COMPLETION_TOKENS))
    for first, last in bounds:
        per_token = token_losses(model, rows, slice(first, last))
        (per_token.sum(dim=1).sum() / DR_GRPO_CONSTANT / len(bounds)).backward()
    return objective_measurement(
        "28. Dr. GRPO sums / C per micro-batch, × 1/A (verl #3741)",
        gradient_of(model),
        correct_gradient("seq-mean-token-sum-norm"),
        reference_gradient("seq-mean-token-sum-norm"),
    )


GENERATION_STEPS = 2  # optimizer steps per generation batch, in row 29: steps_per_generation = 2 · A
STEP_ROWS = len(COMPLETION_TOKENS) // GENERATION_STEPS  # rows of one optimizer step in row 29


def token_mean_over_generation_batch() -> Measurement:
    """29. A token-mean (DAPO) loss divided by the completion tokens of the whole generation batch, which here
    feeds two optimizer steps (steps_per_generation = 2 x gradient_accumulation_steps): each step's gradient is
    scaled by its tokens over the generation batch's, a factor that changes from step to step. TRL's "dapo"
    normaliser, num_items_in_batch, is counted over the generation batch, and before TRL PR #6024 (merged June
    2026, in TRL 1.16.0) it divided each step by it as it stood (https://github.com/huggingface/trl/issues/5619).
    Since #6024 TRL divides by the mean step's tokens instead (the framework cards measure it). Measured on the
    first of the two steps."""
    rows, model = rollout(), gpt()
    generation_tokens = (rows["labels"] != IGNORE_INDEX).sum()
    for first, last in fixed_bounds(0, STEP_ROWS):
        per_token = token_losses(model, rows, slice(first, last))
        (per_token.sum() / generation_tokens).backward()
    first_step = slice(0, STEP_ROWS)
    reference_model = gpt()
    step_losses = token_losses(reference_model, rows, first_step)
    objective_from_definition("token-mean", step_losses, rows["labels"][first_step], None).backward()
    return objective_measurement(
        "29. RL token-mean over 2 steps' tokens (TRL #5619, pre-#6024)",
        gradient_of(model),
        correct_gradient("token-mean", bounds=fixed_bounds(0, STEP_ROWS), step_rows=first_step),
        gradient_of(reference_model),
        described=REFERENCE + " (the step's rows)",
    )


def prompt_mean_without_accumulation_normaliser() -> Measurement:
    """30. A new loss type, the mean over prompts of the mean over their completions of the token mean, taken in
    each micro-batch and backpropagated without the 1/A every other loss type of the trainer applies: with whole
    groups in equal micro-batches the gradient is A times the objective's (which, with equal groups, is the
    sequence mean of token means). Flagged in review of TRL's "dapo_prompt_mean"
    (https://github.com/huggingface/trl/pull/5828; the same missing normaliser in #4935)."""
    rows, model = rollout(), gpt()
    for first, last in fixed_bounds(0, len(COMPLETION_TOKENS)):
        per_token = token_losses(model, rows, slice(first, last))
        lengths = (rows["labels"][first:last] != IGNORE_INDEX).sum(dim=1)
        sequence_means = per_token.sum(dim=1) / lengths
        sequence_means.view(-1, GROUP_SIZE).mean(dim=1).mean().backward()
    return objective_measurement(
        "30. RL prompt mean per micro-batch, no 1/A (TRL #5828)",
        gradient_of(model),
        correct_gradient("seq-mean-token-mean"),
        reference_gradient("seq-mean-token-mean"),
    )


# ---------------------------------------------------------------------------------------------------------
# The buggy twin on 2 ranks: the distillation loss normalised per micro-batch and summed.
# ---------------------------------------------------------------------------------------------------------


def rank_bounds(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Rank r's consecutive share of the 8 rows, in micro-batches of m (A = 2 on 2 ranks)."""
    per_rank = len(COMPLETION_TOKENS) // world_size
    return fixed_bounds(rank * per_rank, (rank + 1) * per_rank)


def distillation_twins(rank: int, world_size: int) -> dict:
    """Runs on each rank: the correct step under DDP, then the buggy loop."""
    correct = correct_gradient(
        "token-mean", DistributedDataParallel(gpt()), rank_bounds(rank, world_size), "distillation"
    )
    # The engine backpropagates each micro-batch's loss as it is (the loss is meant to carry the global
    # normaliser); the distillation loss, called with no global batch information, divides by the micro-batch's
    # own tokens and does not multiply by D. DDP then averages the ranks.
    rows, model = rollout(), DistributedDataParallel(gpt())
    bounds = rank_bounds(rank, world_size)
    for k, (first, last) in enumerate(bounds):
        with model.no_sync() if k < len(bounds) - 1 else contextlib.nullcontext():
            per_token = token_losses(model, rows, slice(first, last), "distillation")
            (per_token.sum() / (rows["labels"][first:last] != IGNORE_INDEX).sum()).backward()
    return {"correct": correct, "buggy": gradient_of(model)}


def distillation_per_micro_batch_summed() -> Measurement:
    """31. A distillation loss (KL to a teacher per completion token, token-mean) normalised inside each
    micro-batch and summed over the A micro-batches with no 1/A, on D = 2 ranks: each micro-batch's token mean
    counts fully, so the gradient grows with A and short micro-batches weigh most. verl's distillation_loss
    before its global batch information was set (https://github.com/verl-project/verl/issues/7200, fixed by
    #7225)."""
    per_rank = run_on_ranks(distillation_twins, WORLD_SIZE)
    return objective_measurement(
        "31. distillation token-mean per micro-batch, summed (verl #7200)",
        per_rank[0]["buggy"],
        per_rank[0]["correct"],
        reference_gradient("token-mean", "distillation"),
    )


RL_PITFALLS = [
    token_mean_per_micro_batch_over_a,
    token_mean_scaled_by_row_share,
    dr_grpo_sum_over_c_per_micro_batch,
    token_mean_over_generation_batch,
    prompt_mean_without_accumulation_normaliser,
    distillation_per_micro_batch_summed,
]
