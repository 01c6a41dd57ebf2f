"""GRPO-family objectives (accumulation/rl/objectives.py) against their definitions, through the real step.

Each aggregation's update, and each objective setting's (asymmetric clip, GSPO's sequence ratio, a KL penalty with
k1 or k3, an entropy bonus), accumulated by optimizer_step over several micro-batch sizes (and over two gloo
ranks), must be the float64 gradient of the objective written from its definition at the level it is defined
(accumulation/rl/objective_check.py), on rows whose ratios are off 1 so that the clip binds; each mode's wrong
normaliser must fail that check and be named, and each planted wrong loss must fail naming the loss."""

import dataclasses

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.rl.objective_check import (
    RELATIVE_TOLERANCE,
    WRONG_LOSSES,
    WRONG_NORMALISERS,
    StepRows,
    accumulated_gradient,
    check_objective,
    declared_by_the_library,
    judge,
    reference_gradient,
    relative_error,
    surrogate_token_losses,
)
from accumulation.rl.objectives import (
    NORMALISER_UNITS,
    PolicyLoss,
    PolicyObjective,
    aggregation,
    completion_lengths,
    group_relative_advantages,
)
from forks.cispo import CISPO
from testkit.ranks import run_on_ranks

MODES = sorted(NORMALISER_UNITS)
CONSTANT = 9.0  # Dr. GRPO's C: the longest completion these rows could hold
ROWS, SEQ_LEN, VOCAB = 12, 12, 16
SPLITS = [3, 4, 12]  # micro-batch sizes: groups cut across micro-batches (3, 4) and the whole step at once (12)


def tiny_policy() -> torch.nn.Module:
    config = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=16, vocab_size=VOCAB)
    return GPT(config, seed=3).double()


def step_rows(model: torch.nn.Module) -> StepRows:
    """12 completions of 3 prompts (4 each), 1 to 9 completion tokens long, with old log-probabilities off the
    current policy's by up to ±0.4 so that some ratios fall outside 1 ± 0.2 and are clipped. The groups are
    interleaved in the row order, so that a micro-batch holds parts of several."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=generator)
    prompt_tokens = 3
    lengths = torch.tensor([1, 9, 4, 2, 7, 3, 8, 5, 2, 6, 1, 9])
    positions = torch.arange(SEQ_LEN)
    completion = (positions >= prompt_tokens - 1) & (positions < prompt_tokens - 1 + lengths[:, None])
    labels = torch.where(completion, tokens.roll(-1, dims=1), IGNORE_INDEX)
    group_ids = torch.arange(ROWS) % 3
    rewards = torch.rand(ROWS, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        logits = model(tokens)
        current = torch.gather(torch.log_softmax(logits, -1), -1, labels.clamp(min=0)[..., None])[..., 0]
    noise = (torch.rand(ROWS, SEQ_LEN, generator=generator, dtype=torch.float64) - 0.5) * 0.8
    old_log_probs = torch.where(completion, current + noise, 0.0)
    ref_noise = (torch.rand(ROWS, SEQ_LEN, generator=generator, dtype=torch.float64) - 0.5) * 0.8
    ref_log_probs = torch.where(completion, current + ref_noise, 0.0)
    advantages = group_relative_advantages(rewards, group_ids)
    return StepRows(tokens, labels, old_log_probs, advantages, group_ids, ref_log_probs)


def objective(mode: str, **settings) -> PolicyObjective:
    return PolicyObjective(aggregation=mode, constant=CONSTANT, **settings)


# The objective settings beside the aggregation, each checked under every mode's splits.
SETTINGS = {
    "clip-higher": dict(clip_low=0.2, clip_high=0.28),
    "gspo": dict(level="sequence", clip_low=3e-2, clip_high=4e-2),
    "kl-k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl-k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "entropy": dict(entropy_coef=0.1),
    "all": dict(level="sequence", clip_low=3e-2, clip_high=4e-2, kl_coef=0.1, entropy_coef=0.1),
}


def test_the_normaliser_of_each_mode_is_counted_in_its_unit():
    rows = step_rows(tiny_policy())
    lengths, groups = completion_lengths(rows.labels), rows.group_ids
    assert aggregation("token-mean", lengths, groups).normaliser == 57  # Σ of the lengths above
    assert aggregation("seq-mean-token-mean", lengths, groups).normaliser == 12
    assert aggregation("seq-mean-token-sum", lengths, groups).normaliser == 12
    assert aggregation("seq-mean-token-sum-norm", lengths, groups, CONSTANT).normaliser == 12 * CONSTANT
    assert aggregation("prompt-mean", lengths, groups).normaliser == 3
    assert aggregation("token-sum", lengths, groups).normaliser == 1


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_exact_for_every_micro_batch_size(mode):
    model = tiny_policy()
    rows = step_rows(model)
    result = check_objective(model, rows, SPLITS, objective(mode))
    assert result.passed, result.line()
    assert result.worst_error <= RELATIVE_TOLERANCE
    assert result.clipped_fraction > 0.05  # off-policy rows: the check sees the clip


@pytest.mark.parametrize("mode", MODES)
def test_each_modes_wrong_normaliser_fails_and_is_named(mode):
    model = tiny_policy()
    rows = step_rows(model)
    result = check_objective(model, rows, SPLITS, objective(mode), WRONG_NORMALISERS[mode])
    assert not result.passed
    assert result.worst_error > 1e-2  # off by a factor of order one, not by rounding
    line = result.line()
    assert line.startswith(f"FAIL {mode}:")
    assert f"the objective's: {NORMALISER_UNITS[mode]}" in line
    assert f"normaliser declared: {result.declared_unit} = " in line


def test_a_per_micro_batch_mean_is_right_only_where_every_micro_batch_weighs_the_same():
    """The check needs more than one split: with the whole step as one micro-batch the per-micro-batch token mean
    is the token mean, and only the smaller micro-batches show it is not."""
    model = tiny_policy()
    rows = step_rows(model)
    whole = check_objective(model, rows, [12], objective("token-mean"), WRONG_NORMALISERS["token-mean"])
    split = check_objective(model, rows, [12, 4], objective("token-mean"), WRONG_NORMALISERS["token-mean"])
    assert whole.passed and not split.passed


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_each_objective_setting_is_exact_for_every_micro_batch_size(mode, setting):
    model = tiny_policy()
    rows = step_rows(model)
    result = check_objective(model, rows, SPLITS, objective(mode, **SETTINGS[setting]))
    assert result.passed, result.line()
    assert result.clipped_fraction > 0.05, result.line()  # the ratio is off 1 where it is checked


def test_the_settings_change_the_objective():
    """Each setting moves the gradient (so a loss that ignored it would fail the check): against plain GRPO's."""
    model = tiny_policy()
    rows = step_rows(model)
    plain = reference_gradient(model, rows, objective("seq-mean-token-mean"))
    for name, settings in SETTINGS.items():
        moved = reference_gradient(model, rows, objective("seq-mean-token-mean", **settings))
        assert relative_error(moved, plain) > 1e-3, name


def test_the_gspo_ratio_is_one_per_sequence_the_geometric_mean_of_its_tokens():
    """The definition's sequence ratio, against exp of the mean log-ratio computed here by hand: every token of a
    row gets -min(s·A, clip(s)·A) with the same s."""
    model = tiny_policy()
    rows = step_rows(model)
    gspo = objective("seq-mean-token-mean", level="sequence", clip_low=10.0 - 1, clip_high=10.0)  # clip never binds
    losses, _ = surrogate_token_losses(model, rows, gspo)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(rows.tokens).double(), -1)
    for i, row_losses in enumerate(losses):
        supervised = rows.labels[i] != IGNORE_INDEX
        picked = log_probs[i][supervised].gather(-1, rows.labels[i][supervised][:, None])[:, 0]
        s = (picked - rows.old_log_probs[i][supervised]).mean().exp()
        torch.testing.assert_close(row_losses.detach(), (-s * rows.advantages[i]).expand(len(row_losses)))


@pytest.mark.parametrize("plant", sorted(WRONG_LOSSES))
def test_a_wrong_loss_fails_naming_the_loss_off_policy_and_a_max_for_min_passes_at_ratio_one(plant):
    model = tiny_policy()
    rows = step_rows(model)
    declared = objective("seq-mean-token-mean", level="sequence" if plant == "gspo-without-length" else "token")
    result = check_objective(model, rows, SPLITS, declared, loss_sum_fn=WRONG_LOSSES[plant](declared))
    assert not result.passed and result.whole_step_error > 1e-2, result.line()
    assert result.line().endswith("the loss, not accumulation")
    if plant == "max-for-min":
        # Sampled by the policy itself (ρ = 1): max and min agree, the clip never binds, and the wrong loss passes.
        on_policy = dataclasses.replace(rows, old_log_probs=step_rows_on_policy(model, rows))
        blind = check_objective(model, on_policy, SPLITS, declared, loss_sum_fn=WRONG_LOSSES[plant](declared))
        assert blind.passed and blind.clipped_fraction == 0, blind.line()


def step_rows_on_policy(model: torch.nn.Module, rows: StepRows) -> torch.Tensor:
    """The rows' old log-probabilities had the checked policy sampled them: ρ = 1 everywhere."""
    with torch.no_grad():
        log_probs = torch.log_softmax(model(rows.tokens).double(), -1)
        picked = log_probs.gather(-1, rows.labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(rows.labels != IGNORE_INDEX, picked, 0.0)


def two_rank_errors(rank: int, ranks: int, modes: list[str], micro_batch: int) -> dict:
    model = torch.nn.parallel.DistributedDataParallel(tiny_policy())
    rows = step_rows(model.module)
    errors = {}
    for mode in modes:
        for setting in ("plain", *SETTINGS):
            declared = objective(mode, **SETTINGS.get(setting, {}))
            reference = reference_gradient(model.module, rows, declared)
            declarations = [("library", declared_by_the_library)]
            if setting == "plain":
                declarations.append(("wrong", WRONG_NORMALISERS[mode]))
            for name, declare in declarations:
                update = accumulated_gradient(model, rows, declared, micro_batch, declare, rank, ranks)
                errors[(mode, setting, name)] = relative_error(update, reference)
    return errors


def test_two_ranks_are_exact_and_the_wrong_normalisers_fail_there_too():
    micro_batch = 3  # 6 rows per rank: A = 2, D = 2
    per_rank = run_on_ranks(two_rank_errors, 2, (MODES, micro_batch))
    assert per_rank[0] == per_rank[1]  # every rank applies the same update
    for (mode, setting, name), error in per_rank[0].items():
        if name == "library":
            assert error <= RELATIVE_TOLERANCE, (mode, setting)
        else:
            assert error > 1e-2, mode
    model = tiny_policy()
    rows = step_rows(model)
    verdict = judge(
        objective("token-mean"),
        rows,
        {(3, 2, 2): per_rank[0][("token-mean", "plain", "wrong")]},
        WRONG_NORMALISERS["token-mean"],
        0.0,
        0.1,
    )
    assert "at m=3 A=2 D=2" in verdict.line()


class CISPOWithoutStopGradient(CISPO):
    """A planted fork bug: CISPO's truncated weight left in the graph (no sg), so its gradient adds ∂w/∂θ·A·log π."""

    def policy_terms(self, log_probs, log_ratio, advantage, **extras):
        cap = 1 + self.objective.clip_high
        return -log_ratio.exp().clamp(max=cap) * advantage * log_probs, log_ratio.exp() > cap


def test_a_forks_objective_is_checked_against_its_own_definition():
    """forks/cispo.py declares CISPO (its loss and its definition) on the shipped source: its update is exact for every
    split; the clipped surrogate's loss in its place, or CISPO without its stop-gradient, FAILs naming the loss."""
    model = tiny_policy()
    rows = step_rows(model)
    cispo = objective("token-mean", clip_high=0.2, loss_class=CISPO)
    assert check_objective(model, rows, SPLITS, cispo).passed
    for wrong in (PolicyLoss(cispo), CISPOWithoutStopGradient(cispo)):
        result = check_objective(model, rows, SPLITS, cispo, loss_sum_fn=wrong)
        assert not result.passed and result.line().endswith("the loss, not accumulation"), result.line()


@pytest.mark.parametrize("scale_by_std", [True, False], ids=["grpo", "dr-grpo"])
def test_group_relative_advantages_follow_their_definition(scale_by_std):
    """A_i = r_i − the mean reward of i's group, divided by that group's unbiased standard deviation + 1e-6 when
    scaled (GRPO; Dr. GRPO leaves the division out): written here group by group with torch.mean and torch.std,
    on groups of 4, 3 and 1 rows listed out of order, so that a mean over the whole batch, a biased std or rows
    read in the wrong group each give other numbers."""
    rewards = torch.tensor([0.5, 1.0, 0.0, 2.0, 0.25, 1.5, 3.0, -1.0], dtype=torch.float64)
    group_ids = torch.tensor([7, 2, 7, 2, 2, 9, 7, 7])
    expected = torch.empty_like(rewards)
    for group in group_ids.unique():
        members = group_ids == group
        group_rewards = rewards[members]
        centred = group_rewards - group_rewards.mean()
        if scale_by_std:
            std = group_rewards.std() if len(group_rewards) > 1 else torch.zeros((), dtype=torch.float64)
            centred = centred / (std + 1e-6)
        expected[members] = centred
    # Both sides are a few float64 operations on numbers of order 1: they agree to rounding (~1e-16).
    torch.testing.assert_close(
        group_relative_advantages(rewards, group_ids, scale_by_std), expected, rtol=0, atol=1e-12
    )
