"""The checker's reference for a step whose objective declares its own normaliser: the RL modes
(accumulation/rl/objectives.py), whose N counts sequences, groups or a constant instead of supervised targets.

The loop's side takes N as train.py does (StepBatch.global_counts): the source's normaliser(row_ids, step), in
the unit it declares, beside the row weights its examples() hand the loss. The reference reads neither, nor the
configured loss: it compares the loop with the objective the source DECLARES (Rollouts.objective(step), a
PolicyObjective: aggregation, clip, ratio level, KL and entropy terms). From each row's raw example (RawExample: its
inputs, its targets, its extras: the advantage, the old and reference log-probabilities and the prompt's group)
and the float64 model's outputs it writes every completion token's ℓ_it from the objective's definition at the
level the objective is defined (objective_check.definition_token_losses: a GSPO ratio over the whole sequence),
and aggregates them by the mode's definition over the whole step at once (objective_from_definition). Its N is
counted from the same definition over the raw rows, in the mode's unit.

The rows are sampled off-policy (objective_check.offset_policy): the sampling policy is the checked weights moved
a little along a seeded random direction, a policy some updates away, so that the ratio differs from 1 and the
clip binds on some tokens, as in a later step of a round; at ρ = 1 a surrogate with max in place of min, or a GSPO
ratio without its 1/|y|, would equal the right one.
"""

import types
from dataclasses import dataclass

import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.checker.promises import NotApplicable
from accumulation.checker.reference import (
    as_float64,
    float64_full_batch,
    gradients,
    map_tensors,
    one_batch_baseline,
    trainable_parameters,
)
from accumulation.data.rows import DataError, Rows, row_hooks
from accumulation.models.factory import build_model
from accumulation.rl.objective_check import (
    RELATIVE_TOLERANCE,
    SAMPLING_POLICY_OFFSET,
    RowTerms,
    definition_token_losses,
    objective_from_definition,
    offset_policy,
    relative_error,
)
from accumulation.rl.objectives import NORMALISER_UNITS, PolicyObjective, aggregation, completion_lengths
from accumulation.run.build import autocast_dtype_for

# The raw extra that the objective's definition reads and the loss does not: the prompt each row answers.
GROUP = "group"
# The loss's keyword for the aggregation's per-row weight (1 / L_i, 1 / T_g): the reference takes each target's
# loss with weight 1 and lets the definition's means do the weighting.
ROW_WEIGHTS = "row_weights"


def bind_initial_policy(rows: Rows, config, vocab_size: int, rank: int, step: int) -> None:
    """For a step whose rows are sampled from the model being trained (RowHooks.sampled_at, RL rollouts): the
    policy they are sampled from, the checked model's initial weights (build_model from run.seed) moved off them
    (offset_policy), on the host. Every rank samples the step's whole round itself, as one replica would: the rows
    are then a function of (seed, step, row id) and those weights, whichever rank asks."""
    if not row_hooks(rows).sampled_at(step):
        return
    policy = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    offset_policy(policy, config.run.seed)
    one_replica = types.SimpleNamespace(replicas=1, replica=0, device=torch.device("cpu"), is_main=rank == 0)
    row_hooks(rows).bind_policy(policy, one_replica, None)


def declared_objective(rows: Rows, step: int) -> PolicyObjective | None:
    """The objective step `step` declares (RowHooks.objective; accumulation/rl/on_policy.py's Rollouts.objective),
    or None: the mean over supervised targets."""
    return row_hooks(rows).objective(step)


def raw_extras(rows: Rows, row_ids: torch.Tensor, step: int) -> list[dict]:
    """Each row's extras as its raw example states them."""
    return [rows.raw_example(row_id, step).extras for row_id in row_ids.tolist()]


def refuse_a_step_without_gradient(rows: Rows, row_ids: torch.Tensor, step: int) -> None:
    """A DataError for a step of a declared objective whose every advantage is 0: the surrogate's gradient is
    then exactly 0 and no normaliser, right or wrong, changes it, so a PASS would mean nothing."""
    if declared_objective(rows, step) is None:
        return
    if all(extras.get("advantages", 1.0) == 0 for extras in raw_extras(rows, row_ids, step)):
        raise DataError(
            f"step {step}: every advantage of its rows is 0 at the initial weights (no group's rewards differ), so "
            "its gradient is 0 and there is nothing to check; give the untrained policy problems it sometimes "
            "solves, e.g. data.max_operand=3"
        )


def normaliser_from_definition(mode: str, labels: torch.Tensor, extras: list[dict], constant: float):
    """(N, its unit) of `mode` counted over the step's raw rows: supervised targets, rows, distinct groups, or
    C times the rows."""
    unit = NORMALISER_UNITS[mode]
    if unit == "targets":
        return float((labels != IGNORE_INDEX).sum()), unit
    if unit == "sequences":
        return float(len(labels)), unit
    if unit == "groups":
        return float(len({row[GROUP] for row in extras})), unit
    if mode == "token-sum":
        return 1.0, unit
    return constant * len(labels), unit


def loss_keywords(extras: list[dict]) -> dict[str, torch.Tensor]:
    """What the loss reads of these rows besides their labels, as the loop hands it (MicroBatch.extras): each raw
    extra the loss reads stacked over the rows ([rows, ...]), and row weight 1, the definition weighting the rows
    itself. A Python float (an advantage) stays float64, as the source holds it."""
    names = [name for name in (extras[0] if extras else {}) if name != GROUP]
    keywords = {
        name: torch.stack(
            [
                torch.as_tensor(row[name], dtype=torch.float64 if isinstance(row[name], float) else None)
                for row in extras
            ]
        )
        for name in names
    }
    keywords[ROW_WEIGHTS] = torch.ones(len(extras), dtype=torch.float64)
    return keywords


def promise_keywords(rows: Rows, step: int, extras: list[dict]) -> dict[str, torch.Tensor]:
    """What the checks of the loss's promises (promises.py) hand the loss besides outputs and labels: on a step
    that declares its objective, the step's rows' keywords (loss_keywords), so that they test the loss the step
    trains (a GRPO step's surrogate, not the cross-entropy its loss falls back to without advantages); else none,
    the loss reading the labels alone as the reference calls it."""
    return {} if declared_objective(rows, step) is None else loss_keywords(extras)


def definition_losses(
    outputs: torch.Tensor, labels: torch.Tensor, extras: list[dict], objective: PolicyObjective
) -> tuple[list[torch.Tensor], int, int]:
    """ℓ_it of every supervised target t of every row i, from the objective's definition over the row's whole
    completion (objective_check.definition_token_losses), its raw extras and the model's outputs; one 1-D tensor per
    row, in position order; and the completion tokens where the clip binds, and all of them."""
    logits = outputs.to(torch.promote_types(outputs.dtype, torch.float32)) / objective.temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    losses, clipped, tokens = [], 0, 0
    for row, (row_log_softmax, row_labels) in enumerate(zip(log_softmax.unbind(0), labels, strict=True)):
        supervised = row_labels != IGNORE_INDEX
        distributions = row_log_softmax[supervised]
        picked = distributions.gather(-1, row_labels[supervised][:, None])[:, 0]
        advantage = torch.as_tensor(extras[row]["advantages"], dtype=picked.dtype, device=picked.device)
        old, ref = (stated(extras[row], name, supervised, picked) for name in ("old_log_probs", "ref_log_probs"))
        terms = RowTerms(picked, distributions, old, advantage, ref)
        row_losses, row_clipped = definition_token_losses(objective, terms)
        losses.append(row_losses)
        clipped, tokens = clipped + int(row_clipped.sum()), tokens + len(row_losses)
    return losses, clipped, tokens


def stated(extras: dict, name: str, supervised: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """A row's raw per-position extra `name` at its completion positions, as `like`'s dtype and device; None when
    the row states none."""
    if extras.get(name) is None:
        return None
    return torch.as_tensor(extras[name]).to(like)[supervised.to(like.device)]


def objective_step(
    model: torch.nn.Module,
    inputs,
    labels: torch.Tensor,
    extras: list[dict],
    objective: PolicyObjective,
    device: torch.device,
    autocast_dtype=None,
) -> tuple[list[torch.Tensor], float, float, tuple[int, int]]:
    """∇ of the objective from its definition over all of the step's rows at once, its value, the same means over
    |ℓ_it| (the size of its terms), and (clipped tokens, completion tokens): one forward (in the model's dtype,
    under autocast when asked, as the loop's forward runs), the token losses, the mode's means."""
    model.train()
    model.zero_grad(set_to_none=True)  # the promises' probes may have left gradients on it
    inputs, labels = map_tensors(lambda tensor: tensor.to(device), inputs), labels.to(device)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        losses, clipped, tokens = definition_losses(model(inputs), labels, extras, objective)
        groups = [row[GROUP] for row in extras]
        value = objective_from_definition(objective.aggregation, losses, groups, objective.constant)
        size = objective_from_definition(
            objective.aggregation, [row.detach().abs() for row in losses], groups, objective.constant
        )
    value.backward()
    return gradients(trainable_parameters(model)), value.item(), size.item(), (clipped, tokens)


def loss_alone_message(
    model: torch.nn.Module, inputs, labels: torch.Tensor, extras: list[dict], loss_sum_fn, objective, definition
) -> str | None:
    """Where the configured loss is not the declared objective, in words: the loss called once on the whole step
    in float64, with the definition's row weights and divided by its N, against the definition's gradient
    `definition` (both
    float64: only their order of sums differs, far below RELATIVE_TOLERANCE). A wrong loss then FAILs naming the
    loss, not accumulation. None when they agree."""
    lengths = completion_lengths(labels)
    groups = torch.tensor([row[GROUP] for row in extras])
    declared = aggregation(objective.aggregation, lengths, groups, objective.constant)
    keywords = loss_keywords(extras)
    keywords[ROW_WEIGHTS] = declared.row_weights
    model.zero_grad(set_to_none=True)
    (loss_sum_fn(model(inputs), labels, **keywords) / declared.normaliser).backward()
    alone = [gradient.detach().clone() for gradient in gradients(trainable_parameters(model))]
    model.zero_grad(set_to_none=True)
    error = relative_error(alone, definition)
    if error <= RELATIVE_TOLERANCE:
        return None
    return (
        f"the loss itself, called once on the whole step in float64, is {error:.1e} off the declared objective's "
        f"gradient ({objective.describe()}): the loss is not the objective it declares, not an accumulation bug"
    )


def extras_message(example_extras: dict, extras: list[dict], row_ids: torch.Tensor):
    """Where the extras examples() hands the loss differ from those the raw examples state, in words; None when
    they agree. An extra only one side holds is named: the reference hands the loss what the raw examples state,
    so an extra they leave out makes the reference another objective than the loop's. The row weights are the
    aggregation's, which no raw example states, and the group is the definition's, which the loss never reads."""
    if not example_extras and not any(extras):
        return NotApplicable("the rows carry no extras: the loss reads the labels alone")
    stated_names = set().union(*(row.keys() for row in extras)) if extras else set()
    unstated = sorted(set(example_extras) - stated_names - {ROW_WEIGHTS})
    if unstated:
        return (
            f"examples() hands the loss {', '.join(unstated)}, which no raw example states: the reference's loss would "
            "run without it; state it in raw_example's extras"
        )
    unhanded = sorted(stated_names - set(example_extras) - {GROUP})
    if unhanded:
        return f"the raw examples state {', '.join(unhanded)}, which examples() does not hand the loss"
    for name in sorted(set(example_extras) & stated_names):
        stated = torch.stack([torch.as_tensor(row[name], dtype=example_extras[name].dtype) for row in extras])
        differs = (example_extras[name] != stated).reshape(len(row_ids), -1).any(dim=1)
        if differs.any():
            row = int(differs.nonzero()[0])
            return f"row {int(row_ids[row])}: examples() hands the loss another {name} than its raw example states"
    return None


@dataclass
class StepReference:
    """The float64 reference of one step and, beside it, the same step at A = 1, D = 1 in the loop's precision."""

    gradients: list[torch.Tensor]
    loss: float
    loss_scale: float  # what the loss's error is relative to: the objective's means taken over |ℓ_it|
    baseline_gradients: list[torch.Tensor]
    baseline_loss: float
    normaliser: float  # N, counted from the objective's definition over the raw rows
    unit: str
    loss_alone: str | None = None  # why the configured loss is not the declared objective, or None
    ratio_figure: str | None = None  # where the clip binds, for an off-policy step
    clipped_tokens: int = 0


def step_reference(
    rows: Rows,
    step: int,
    inputs,
    labels: torch.Tensor,
    extras: list[dict],
    loss_sum_fn,
    reference_model: torch.nn.Module,
    baseline_model: torch.nn.Module,
    config,
    context,
) -> StepReference:
    """The reference of step `step`, whose rows are `inputs` and `labels` with their raw `extras`: the mean over
    supervised targets (reference.float64_full_batch), or the declared objective from its definition.

    The loss's error is measured against the size of its terms, not of its value: a surrogate's terms cancel
    (its group-centred advantages sum to 0, and ρ = 1 at the sampling weights), leaving a value near 0 that
    rounding alone would put far off in relative terms. For a loss of non-negative terms (cross-entropy) the two
    are the same."""
    autocast_dtype = autocast_dtype_for(config.precision)
    objective = declared_objective(rows, step)
    if objective is None:
        gradients, loss = float64_full_batch(reference_model, inputs, labels, loss_sum_fn)
        baseline_gradients, baseline_loss = one_batch_baseline(
            baseline_model, inputs, labels, loss_sum_fn, autocast_dtype, context.device
        )
        tokens = float((labels != IGNORE_INDEX).sum())
        return StepReference(gradients, loss, abs(loss), baseline_gradients, baseline_loss, tokens, "targets")
    float_inputs = as_float64(inputs)
    gradients, loss, loss_scale, (clipped, tokens) = objective_step(
        reference_model, float_inputs, labels, extras, objective, torch.device("cpu")
    )
    gradients = [gradient.detach().clone() for gradient in gradients]
    baseline_gradients, baseline_loss, _, _ = objective_step(
        baseline_model, inputs, labels, extras, objective, context.device, autocast_dtype
    )
    loss_alone = loss_alone_message(reference_model, float_inputs, labels, extras, loss_sum_fn, objective, gradients)
    normaliser, unit = normaliser_from_definition(objective.aggregation, labels, extras, objective.constant)
    ratio_figure = (
        f"sampled by a policy {SAMPLING_POLICY_OFFSET:g} RMS away from the checked weights; the clip binds on "
        f"{clipped:,} of {tokens:,} completion tokens ({clipped / max(tokens, 1):.1%})"
    )
    return StepReference(
        gradients,
        loss,
        loss_scale,
        baseline_gradients,
        baseline_loss,
        normaliser,
        unit,
        loss_alone,
        ratio_figure,
        clipped,
    )
