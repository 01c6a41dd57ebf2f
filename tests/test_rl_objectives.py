"""GRPO-family objectives (accumulation/rl/objectives.py) against their definitions, through the real step.

Each aggregation's update, accumulated by optimizer_step over several micro-batch sizes (and over two gloo ranks),
must be the float64 gradient of the objective written from its definition (accumulation/rl/objective_check.py);
each mode's wrong normaliser must fail that check and be named."""

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.rl.objective_check import (
    RELATIVE_TOLERANCE,
    WRONG_NORMALISERS,
    StepRows,
    accumulated_gradient,
    check_objective,
    declared_by_the_library,
    judge,
    reference_gradient,
    relative_error,
)
from accumulation.rl.objectives import NORMALISER_UNITS, aggregation, completion_lengths, group_relative_advantages
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
    return StepRows(tokens, labels, old_log_probs, group_relative_advantages(rewards, group_ids), group_ids)


def test_the_normaliser_of_each_mode_is_counted_in_its_unit():
    rows = step_rows(tiny_policy())
    lengths, groups = completion_lengths(rows.labels), rows.group_ids
    assert aggregation("token-mean", lengths, groups).normaliser == 57  # Σ of the lengths above
    assert aggregation("seq-mean-token-mean", lengths, groups).normaliser == 12
    assert aggregation("seq-mean-token-sum", lengths, groups).normaliser == 12
    assert aggregation("seq-mean-token-sum-norm", lengths, groups, CONSTANT).normaliser == 12 * CONSTANT
    assert aggregation("prompt-mean", lengths, groups).normaliser == 3


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_exact_for_every_micro_batch_size(mode):
    model = tiny_policy()
    rows = step_rows(model)
    result = check_objective(model, mode, rows, SPLITS, constant=CONSTANT)
    assert result.passed, result.line()
    assert result.worst_error <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("mode", MODES)
def test_each_modes_wrong_normaliser_fails_and_is_named(mode):
    model = tiny_policy()
    rows = step_rows(model)
    result = check_objective(model, mode, rows, SPLITS, WRONG_NORMALISERS[mode], CONSTANT)
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
    whole = check_objective(model, "token-mean", rows, [12], WRONG_NORMALISERS["token-mean"])
    split = check_objective(model, "token-mean", rows, [12, 4], WRONG_NORMALISERS["token-mean"])
    assert whole.passed and not split.passed


def two_rank_errors(rank: int, ranks: int, modes: list[str], micro_batch: int) -> dict:
    model = torch.nn.parallel.DistributedDataParallel(tiny_policy())
    rows = step_rows(model.module)
    errors = {}
    for mode in modes:
        reference = reference_gradient(model.module, mode, rows, CONSTANT, 0.2)
        for name, declare in (("library", declared_by_the_library), ("wrong", WRONG_NORMALISERS[mode])):
            update = accumulated_gradient(model, mode, rows, CONSTANT, 0.2, micro_batch, declare, rank, ranks)
            errors[(mode, name)] = relative_error(update, reference)
    return errors


def test_two_ranks_are_exact_and_the_wrong_normalisers_fail_there_too():
    micro_batch = 3  # 6 rows per rank: A = 2, D = 2
    per_rank = run_on_ranks(two_rank_errors, 2, (MODES, micro_batch))
    assert per_rank[0] == per_rank[1]  # every rank applies the same update
    for mode in MODES:
        assert per_rank[0][(mode, "library")] <= RELATIVE_TOLERANCE, mode
        assert per_rank[0][(mode, "wrong")] > 1e-2, mode
    model = tiny_policy()
    rows = step_rows(model)
    verdict = judge(
        "token-mean", rows, 0.0, {(3, 2, 2): per_rank[0][("token-mean", "wrong")]}, WRONG_NORMALISERS["token-mean"]
    )
    assert "at m=3 A=2 D=2" in verdict.line()
