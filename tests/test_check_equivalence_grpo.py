"""The equivalence checker on a GRPO step of configs/grpo.toml (`--step`, after data.sft_steps): the loop's update
against the float64 gradient of the objective the source declares, from its definition, its N counted from that
definition and named in its unit on both sides, on rows sampled off-policy so that the clip binds; PASS on one
process and on two gloo ranks, for each objective setting; FAIL with a wrong normaliser (naming accumulation) and
with a wrong loss, max for min or a GSPO ratio without its 1/|y| (naming the loss). The promises of the loss are
checked on the surrogate the step trains (its rows' advantages and old log-probabilities handed to it), and FAIL for
a surrogate that is a mean or that pairs label j with another output."""

import dataclasses
import re
from pathlib import Path

import pytest

from accumulation import checker
from accumulation.batching import IGNORE_INDEX
from accumulation.config.registry import REGISTERED, lookup
from accumulation.rl.objective_check import WRONG_LOSSES
from accumulation.rl.on_policy import clipped_surrogate_sum
from testkit.ranks import run_main_on_ranks
from tests.test_check_equivalence import failing_lines

GRPO_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "grpo.toml")
# Step 300 is the first GRPO step (data.sft_steps = 300), round 0 sampled by a policy some way off the initial
# weights (objective_check.offset_policy), which the checker checks. Its untrained policy writes random bytes, which
# answer 'Q: a + b =' for a, b < 3 now and then: with run.seed 28 some of round 0's 4 groups of 8 have a rewarded
# completion, so their advantages (and the gradient) are not zero, the completions' lengths differ, so token,
# sequence and prompt means differ, and the clip binds on 14 of the 190 completion tokens.
GRPO_STEP = [
    "--config",
    GRPO_CONFIG,
    "--step",
    "300",
    "run.seed=28",
    "data.max_operand=3",
    "data.held_out=1",
    "data.prompts_per_round=4",
    "data.mini_batch_size=32",
    "batch.global_batch_size=32",
    "batch.micro_batch_size=8",
]


def run_checker(arguments: list[str], ranks: int, capsys) -> tuple[int, str]:
    """(exit status, rank 0's stdout) of the checker in this process, or on `ranks` forked gloo ranks."""
    if ranks == 1:
        status = checker.main(arguments)
        return status, capsys.readouterr().out
    per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=ranks)
    assert all(status == per_rank[0][0] for status, _, _ in per_rank), per_rank  # every rank shares the verdict
    return per_rank[0][0], per_rank[0][1]


def line(stdout: str, name: str) -> str:
    return re.search(rf"^{re.escape(name)}: (.*)$", stdout, re.MULTILINE).group(1)


def gradient_error(stdout: str) -> float:
    return float(re.search(r"^gradient: max relative error ([0-9.e+-]+)", stdout, re.MULTILINE).group(1))


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_grpo_step_passes_against_its_objectives_definition(capsys, ranks):
    status, stdout = run_checker(GRPO_STEP, ranks, capsys)
    assert status == 0, stdout
    assert f"x ranks {ranks}; step 300: 32 examples" in stdout
    # GRPO's sequence mean: N counts the step's 32 completions, on the loop's side as the source declares it and
    # on the reference's as the definition counts it.
    assert line(stdout, "normaliser").startswith("loop sequences = 32, reference sequences = 32 ")
    assert line(stdout, "extras of examples() vs the raw examples") == "ok"
    assert line(stdout, "loss_sum_fn is a sum") == "ok"
    assert line(stdout, "loss pairs label j with output j") == "ok"
    clipped = re.search(r"the clip binds on (\d+) of (\d+) completion tokens", line(stdout, "importance ratio"))
    assert int(clipped.group(1)) > 0, stdout  # off-policy: the ratio is checked where the clip binds
    # fp32 against float64: the checker's own tolerance (accumulation/checker/run.py, RELATIVE_TOLERANCE).
    assert gradient_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]
    assert stdout.splitlines()[-1] == "PASS"


def test_prompt_mean_counts_groups_and_passes(capsys):
    status, stdout = run_checker([*GRPO_STEP, 'data.loss_aggregation="prompt-mean"'], 1, capsys)
    assert status == 0, stdout
    assert line(stdout, "normaliser").startswith("loop groups = 4, reference groups = 4 ")
    assert gradient_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_wrong_normaliser_fails_on_a_grpo_step_naming_both_units(capsys, ranks):
    status, stdout = run_checker([*GRPO_STEP, "--inject-bug", "wrong-normaliser"], ranks, capsys)
    assert status == 1, stdout
    # The loop divides the sequence mean by the completion tokens (at most 6 per completion) instead of the 32
    # completions: the gradient is off by a factor of about 1/6, far beyond rounding.
    loop_tokens = int(re.search(r"supervised targets: loop ([0-9,]+),", stdout).group(1).replace(",", ""))
    assert line(stdout, "normaliser").startswith(f"loop targets = {loop_tokens}, reference sequences = 32 ")
    assert "FAIL: the loop's N is not the objective's" in line(stdout, "normaliser")
    assert gradient_error(stdout) > 0.5
    assert line(stdout, "gradient").endswith("accumulation, not rounding")
    assert stdout.splitlines()[-1] == "FAIL"


def test_a_wrong_normaliser_the_objective_cannot_show_is_refused(capsys):
    # token-mean's N is the supervised targets: dividing by them is no bug there, so the self-test is refused.
    status = checker.main([*GRPO_STEP, 'data.loss_aggregation="token-mean"', "--inject-bug", "wrong-normaliser"])
    assert status == 2
    assert (
        "--inject-bug wrong-normaliser needs a step whose objective counts N in another unit" in capsys.readouterr().err
    )


def test_a_grpo_step_without_gradient_is_refused(capsys):
    # The shipped config's first round at the initial weights: no completion is rewarded, every advantage is 0.
    status = checker.main(["--config", GRPO_CONFIG, "--step", "300"])
    assert status == 2
    assert "every advantage of its rows is 0 at the initial weights" in capsys.readouterr().err


def test_a_data_bug_that_would_hide_the_declared_objective_is_refused(capsys):
    # The data bugs wrap the rows in BuggyRows, which declares no objective: the loop would fall back to a token mean.
    status = checker.main([*GRPO_STEP, "--inject-bug", "count"])
    assert status == 2
    assert (
        "--inject-bug count wraps the data's rows, which would hide the objective step 300" in capsys.readouterr().err
    )


def surrogate_averaged_over_tokens(
    outputs, labels, *, policy_loss=None, advantages=None, old_log_probs=None, row_weights=None
):
    """A fork's planted fault: the clipped surrogate divided by the micro-batch's tokens (a mean, not a sum); the
    cross-entropy sum, as clipped_surrogate_sum, on rows without advantages."""
    total = clipped_surrogate_sum(
        outputs,
        labels,
        policy_loss=policy_loss,
        advantages=advantages,
        old_log_probs=old_log_probs,
        row_weights=row_weights,
    )
    return total if advantages is None else total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def surrogate_pairing_label_j_with_output_j_plus_1(
    outputs, labels, *, policy_loss=None, advantages=None, old_log_probs=None, row_weights=None
):
    """A fork's planted fault: the clipped surrogate of label j (and its old log-probability) read off output
    j + 1; the cross-entropy sum, rightly paired, on rows without advantages."""
    if advantages is None:
        return clipped_surrogate_sum(outputs, labels)
    return clipped_surrogate_sum(
        outputs[:, 1:],
        labels[:, :-1],
        policy_loss=policy_loss,
        advantages=advantages,
        old_log_probs=old_log_probs[:, :-1],
        row_weights=row_weights,
    )


def with_the_surrogate_replaced_by(planted, monkeypatch) -> None:
    """model.objective = "clipped-surrogate" names `planted` instead, for the loop and the checker alike, as a
    fork's own loss would be."""
    piece = lookup("loss", "clipped-surrogate")
    monkeypatch.setitem(REGISTERED["loss"], "clipped-surrogate", dataclasses.replace(piece, loss_sum_fn=planted))


def test_a_surrogate_averaged_over_the_micro_batch_s_tokens_fails_as_a_mean(capsys, monkeypatch):
    with_the_surrogate_replaced_by(surrogate_averaged_over_tokens, monkeypatch)
    status, stdout = run_checker(GRPO_STEP, 1, capsys)
    assert status == 1, stdout
    # The surrogate's value at the sampling weights is near 0, yet the halves' values times their tokens add up to
    # the whole's to rounding against the size of its terms, so the line names a mean over targets.
    assert line(stdout, "loss_sum_fn is a sum").endswith(
        "a mean over targets; return the SUM of the supervised targets' losses, never a mean"
    ), stdout
    assert line(stdout, "loss pairs label j with output j") == "ok"
    assert stdout.splitlines()[-1] == "FAIL"


def test_a_surrogate_that_pairs_label_j_with_output_j_plus_1_fails_on_its_own(capsys, monkeypatch):
    with_the_surrogate_replaced_by(surrogate_pairing_label_j_with_output_j_plus_1, monkeypatch)
    status, stdout = run_checker(GRPO_STEP, 1, capsys)
    assert status == 1, stdout
    # The reference is the objective's definition, which pairs label j with output j: the pairing probe, the loss
    # the gradient norm and the gradient fail, and the gradient's line names the loss, not accumulation.
    assert failing_lines(stdout) == ["loss pairs label j with output j", "loss", "gradient norm", "gradient"], stdout
    assert line(stdout, "gradient").endswith("the loss is not the objective it declares, not an accumulation bug")
    pairing = line(stdout, "loss pairs label j with output j")
    match = re.match(r"FAIL: the loss of label (\d+) \(row \d+ of the step\) reads outputs \[(\d+)\], not", pairing)
    assert match and int(match.group(2)) == int(match.group(1)) + 1, pairing
    assert line(stdout, "loss_sum_fn is a sum") == "ok"


# Each objective setting on the checked step: its update against its own definition (fp32 against float64).
OBJECTIVE_SETTINGS = {
    "clip-higher": ["data.clip_ratio_high=0.28"],
    "gspo": ['data.importance_level="sequence"', "data.clip_ratio=0.03", "data.clip_ratio_high=0.04"],
    "kl-k3": ["data.kl_coef=0.1"],
    "kl-k1": ["data.kl_coef=0.1", 'data.kl_estimator="k1"'],
    "entropy": ["data.entropy_coef=0.1"],
    "temperature": ["data.temperature=0.7", "data.top_p=0.9"],
    "token-sum": ['data.loss_aggregation="token-sum"'],
    "fork": ['data.policy_loss="forks.cispo:CISPO"', 'data.loss_aggregation="token-mean"'],
}


@pytest.mark.parametrize("setting", sorted(OBJECTIVE_SETTINGS))
def test_each_objective_setting_passes_against_its_definition(capsys, setting):
    status, stdout = run_checker([*GRPO_STEP, *OBJECTIVE_SETTINGS[setting]], 1, capsys)
    assert status == 0, stdout
    assert gradient_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


def test_the_objective_settings_pass_on_two_ranks(capsys):
    every = ['data.importance_level="sequence"', "data.clip_ratio=0.03", "data.kl_coef=0.1", "data.entropy_coef=0.1"]
    status, stdout = run_checker([*GRPO_STEP, *every], 2, capsys)
    assert status == 0, stdout


@pytest.mark.parametrize(
    ("plant", "settings"),
    [("max-for-min", []), ("gspo-without-length", ['data.importance_level="sequence"', "data.clip_ratio=0.03"])],
)
def test_a_loss_that_is_not_the_declared_objective_fails_naming_the_loss(capsys, monkeypatch, plant, settings):
    """A fork's loss with max in place of min, or GSPO's ratio without its 1/|y|: at ρ = 1 the first equals the
    right surrogate; off-policy both FAIL, and the line names the loss, not accumulation."""

    def planted(
        outputs, labels, *, policy_loss, advantages=None, old_log_probs=None, row_weights=None, ref_log_probs=None
    ):
        if advantages is None:
            return clipped_surrogate_sum(outputs, labels)
        planted_loss = WRONG_LOSSES[plant](policy_loss.objective)  # the run's declared objective, as handed in
        return planted_loss(
            outputs, labels, advantages=advantages, old_log_probs=old_log_probs, row_weights=row_weights
        )

    with_the_surrogate_replaced_by(planted, monkeypatch)
    status, stdout = run_checker([*GRPO_STEP, *settings], 1, capsys)
    assert status == 1, stdout
    assert line(stdout, "gradient").endswith("the loss is not the objective it declares, not an accumulation bug")
    assert line(stdout, "normaliser").endswith("ok")
