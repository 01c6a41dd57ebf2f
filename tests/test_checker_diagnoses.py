"""The checker names the cause it finds, not the accumulation: a pipeline stage that computes another function
than the model's forward, an extra of a new objective that its raw examples do not state, and the self-test's
loss bugs at a GRPO step (whose loss reads extras). A failing promise explains the gradient line that follows it."""

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn as nn

from accumulation import checker
from accumulation.batching import IGNORE_INDEX
from accumulation.checker import run as checker_run
from accumulation.checker.promises import loss_alignment_message
from accumulation.config.registry import register_model
from accumulation.data.rows import RowHooks
from accumulation.models.gpt import build_gpt
from accumulation.rl.objectives import PolicyLoss, target_log_probs
from accumulation.rl.on_policy import clipped_surrogate_sum
from accumulation.step import token_cross_entropy_sum
from tests.test_check_equivalence import checker_line, failing_lines
from tests.test_check_equivalence import run_checker as run_checker_on_short_documents
from tests.test_check_equivalence_grpo import (
    GRPO_STEP,
    line,
    run_checker,
    surrogate_pairing_label_j_with_output_j_plus_1,
)


class StageWithoutCausalMask(nn.Module):
    """A fork's pipeline stage that runs its blocks without the causal mask's direction: on the reversed sequence,
    so each position attends to the positions after it. Every position-wise layer gives the same as before."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x.flip(1)).flip(1)


def build_gpt_whose_last_stage_drops_the_mask(model_config, vocab_size: int, *, seq_len: int, seed: int):
    model = build_gpt(model_config, vocab_size, seq_len=seq_len, seed=seed)
    split = model.pipeline_split

    def pipeline_split(num_stages: int) -> list[nn.Module]:
        *first, last = split(num_stages)
        return [*first, StageWithoutCausalMask(last)]

    model.pipeline_split = pipeline_split
    return model


register_model("gpt-stage-without-mask", build_gpt_whose_last_stage_drops_the_mask)
STAGE_WITHOUT_MASK = "model.name=tests.test_checker_diagnoses:gpt-stage-without-mask"


def build_gpt_with_a_frozen_embedding(model_config, vocab_size: int, *, seq_len: int, seed: int):
    model = build_gpt(model_config, vocab_size, seq_len=seq_len, seed=seed)
    model.token_embedding.weight.requires_grad_(False)
    return model


register_model("gpt-frozen-embedding", build_gpt_with_a_frozen_embedding)


@pytest.mark.parametrize(
    "ranks, layout",
    [(1, []), (2, []), (2, ["dist.strategy=fsdp2"]), (2, ["dist.pipeline_stages=2", "model.n_layer=2"])],
    ids=["1-rank", "ddp", "fsdp2", "pipeline"],
)
def test_a_frozen_embedding_is_left_out_of_the_comparison_and_said_so(tmp_path, capsys, ranks, layout):
    """Without PEFT: a parameter with requires_grad off has no gradient (the checker crashed on its None); on 2
    ranks DDP, FSDP2's reduce-scatter or the pipeline's stages reduce the trainable parameters' gradients only."""
    arguments = ["model.name=tests.test_checker_diagnoses:gpt-frozen-embedding", *layout]
    status, stdout = run_checker_on_short_documents(tmp_path, arguments, ranks, capsys)
    assert f"x ranks {ranks};" in stdout or "2 pipeline stages" in stdout
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    match = re.search(r"([\d,]+) parameters \(([\d,]+) train and are compared, ([\d,]+) frozen\)", stdout)
    total, trainable, frozen = (int(group.replace(",", "")) for group in match.groups())
    assert total == trainable + frozen and frozen == 256 * 32, stdout  # the byte vocabulary x TINY_CONFIG's d_model


def test_a_stage_that_computes_another_function_is_named_not_the_accumulation(tmp_path, capsys):
    """The loop trains the stages, the reference and the A = 1, D = 1 baseline the model's forward: the gradient
    line blamed 'accumulation, not rounding'."""
    arguments = [STAGE_WITHOUT_MASK, "model.n_layer=2", "dist.pipeline_stages=2"]
    status, stdout = run_checker_on_short_documents(tmp_path, arguments, 2, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    stages = checker_line(stdout, "pipeline stages compute the forward")
    assert stages.startswith(
        "FAIL: the 2 pipeline stages of the model's pipeline_split, run one after another, "
        "compute another function than its forward (relative"
    ), stdout
    gradient = checker_line(stdout, "gradient")
    assert "accumulation, not rounding" not in gradient
    assert "explained by 'pipeline stages compute the forward' above" in gradient, gradient


def test_a_loss_that_supervises_the_padding_fails_naming_the_positions_labelled_100(tmp_path, capsys, monkeypatch):
    """labels.clamp(min=0) then a sum: every padding position is trained as token 0. Loop and reference call the
    same loss (their gradients agree) and each half of the rows keeps its own padding (the loss is a sum over rows),
    so only the check that moves the outputs at the positions labelled -100 sees it."""

    def clamped_loss_sum_fn_for(model_config):
        return lambda outputs, labels: token_cross_entropy_sum(outputs, labels.clamp(min=0))

    monkeypatch.setattr(checker_run, "loss_sum_fn_for", clamped_loss_sum_fn_for)
    status, stdout = run_checker_on_short_documents(tmp_path, [], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failing_lines(stdout)[0] == "loss leaves the positions labelled -100 out", stdout
    line = checker_line(stdout, "loss leaves the positions labelled -100 out")
    assert "it trains them as targets (labels.clamp(min=0) makes each a target 0)" in line, line
    # The loop's micro-batches hold other padding than the reference's rows, so their gradients differ too: that
    # line names the promise as the cause, not the accumulation.
    gradient = checker_line(stdout, "gradient")
    assert gradient.endswith(": ok") or "explained by 'loss leaves the positions labelled -100 out' above" in gradient


def test_a_loss_that_shifts_again_is_named_by_the_pairing_line_not_as_supervised_padding(capsys):
    """On prompt/response rows a loss that shifts again reads the output of each response's first label at the
    prompt's last position, labelled -100: that is the pairing line's fault, which names it."""
    status = checker.main(["--config", "configs/sft.toml", "model.n_layer=1", "--inject-bug", "double-shift"])
    stdout = capsys.readouterr().out
    assert status == 1 and failing_lines(stdout) == ["loss pairs label j with output j"], stdout
    line = checker_line(stdout, "loss leaves the positions labelled -100 out")
    assert line.startswith("n/a: it reads the outputs beside its targets, as the pairing line's fault does"), line


# ---------------------------------------------------------------------------------------------------
# A GRPO step: its loss reads extras (advantages, old log-probabilities, row weights)
# ---------------------------------------------------------------------------------------------------


class RolloutsAltered(RowHooks):
    """A fork's rows: the GRPO rollouts, with either an extra left out of their raw examples (`unstated`) or an
    extra that examples() hands the loss taken from the next row (`moved`). Everything else is the rollouts',
    the optional hooks handed on as a fork's wrapper must declare them (subclassing RowHooks)."""

    def __init__(self, rows, *, unstated: str | None = None, moved: str | None = None):
        self.rows, self.unstated, self.moved = rows, unstated, moved

    def __getattr__(self, name):
        return getattr(self.rows, name)

    def bind_policy(self, model, context, resume):
        self.rows.bind_policy(model, context, resume)

    def loss_sum_fn(self, configured):
        return self.rows.loss_sum_fn(configured)

    def sampled_at(self, step):
        return self.rows.sampled_at(step)

    def normaliser(self, row_ids, step):
        return self.rows.normaliser(row_ids, step)

    def objective(self, step):
        return self.rows.objective(step)

    def examples(self, row_ids, step):
        inputs, labels, *extras = self.rows.examples(row_ids, step)
        if extras and self.moved:
            extras = [{**extras[0], self.moved: extras[0][self.moved].roll(1, dims=0)}]
        return inputs, labels, *extras

    def raw_example(self, row_id, step):
        example = self.rows.raw_example(row_id, step)
        extras = {name: value for name, value in example.extras.items() if name != self.unstated}
        return dataclasses.replace(example, extras=extras)


def with_rollouts_altered(monkeypatch, **alteration) -> None:
    real_build_data = checker_run.build_data

    def build_data(*args, **kwargs):
        data = real_build_data(*args, **kwargs)
        return dataclasses.replace(data, train=RolloutsAltered(data.train, **alteration))

    monkeypatch.setattr(checker_run, "build_data", build_data)


def test_an_extra_the_raw_examples_do_not_state_is_named(capsys, monkeypatch):
    """The reference hands the loss what the raw examples state: without old_log_probs it ran another objective,
    and the checker said 'ok' for the extras and blamed the gradient on the accumulation."""
    with_rollouts_altered(monkeypatch, unstated="old_log_probs")
    status, stdout = run_checker(GRPO_STEP, 1, capsys)
    assert status == 1, stdout
    extras = line(stdout, "extras of examples() vs the raw examples")
    assert (
        extras == "FAIL: examples() hands the loss old_log_probs, which no raw example states: the reference's "
        "loss would run without it; state it in raw_example's extras"
    ), stdout
    # The reference would run another objective: the loss's checks and the figures are not judged on it.
    assert line(stdout, "loss_sum_fn is a sum").startswith("n/a: the raw examples' extras disagree"), stdout
    assert "accumulation, not rounding" not in stdout and not re.search("^gradient:", stdout, re.MULTILINE)
    assert [text for text in stdout.splitlines() if "FAIL: " in text] == [
        f"extras of examples() vs the raw examples: {extras}"
    ]


def test_an_extra_handed_to_another_row_is_named(capsys, monkeypatch):
    """The extras detector's own self-test: examples() hands each row the advantage of the row before it."""
    with_rollouts_altered(monkeypatch, moved="advantages")
    status, stdout = run_checker(GRPO_STEP, 1, capsys)
    assert status == 1, stdout
    extras = line(stdout, "extras of examples() vs the raw examples")
    assert re.fullmatch(
        r"FAIL: row \d+: examples\(\) hands the loss another advantages than its raw example states", extras
    ), stdout


@pytest.mark.parametrize(
    "bug, failing",
    [
        ("mean-of-means", "loss"),  # a bug of the loop: the loss and the gradient off, the accumulation named
        ("mean-loss", "loss_sum_fn is a sum"),
        ("double-shift", "loss pairs label j with output j"),
        ("in-batch-negatives", "loss_sum_fn is a sum"),
    ],
)
def test_the_self_tests_loss_bugs_apply_at_a_grpo_step(capsys, bug, failing):
    """They wrapped a loss of the labels alone: mean-of-means was a traceback at a GRPO step, the others 'the loss
    raised ... unexpected keyword argument advantages'. Each hands the surrogate its extras and FAILs where it
    should."""
    status, stdout = run_checker([*GRPO_STEP, "--inject-bug", bug], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failing_lines(stdout)[0] == failing, stdout
    if bug == "mean-of-means":
        assert line(stdout, "gradient").endswith("accumulation, not rounding"), stdout


def surrogate_rows(advantages: list[float]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fixed outputs [rows, 8, 5] and labels supervising positions 2..5 of each row, with the surrogate's extras:
    the given advantages, old log-probabilities sampled from these outputs (every ratio 1), row weights 1."""
    rows = len(advantages)
    generator = torch.Generator().manual_seed(0)
    outputs = torch.randn(rows, 8, 5, generator=generator, dtype=torch.float64)
    labels = torch.full((rows, 8), IGNORE_INDEX)
    labels[:, 2:6] = torch.randint(0, 5, (rows, 4), generator=generator)
    keywords = {
        "advantages": torch.tensor(advantages, dtype=torch.float64),
        "old_log_probs": target_log_probs(outputs, labels),
        "row_weights": torch.ones(rows, dtype=torch.float64),
    }
    return outputs, labels, keywords


# The clipped surrogate of the default objective (ε = 0.2, the sequence-mean of token-means), as rollouts hand it.
SURROGATE = functools.partial(clipped_surrogate_sum, policy_loss=PolicyLoss())


def test_the_pairing_detector_judges_a_row_with_gradient_when_the_middle_rows_have_advantage_0():
    """A surrogate's row of advantage 0 reads its outputs with weight 0: a label there shows no pairing at all
    ('reads outputs []'). Rows 2 to 6 of 8 have advantage 0: the 20 labels around the middle, more than the
    detector tries one by one, so only its choice of rows with a gradient finds a label to judge."""
    outputs, labels, keywords = surrogate_rows([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert loss_alignment_message(SURROGATE, outputs, labels, keywords) is None
    shifted_surrogate = functools.partial(surrogate_pairing_label_j_with_output_j_plus_1, policy_loss=PolicyLoss())
    shifted = loss_alignment_message(shifted_surrogate, outputs, labels, keywords)
    assert shifted is not None and re.match(
        r"the loss of label \d+ \(row [017] of the step\) reads outputs \[", shifted
    )


def test_the_pairing_detector_passes_over_a_label_whose_ratio_is_clipped():
    """A label whose ratio the clip holds has no gradient of its own, in a row that has one: the detector judges
    the next label instead of reporting that the middle one reads no output."""
    outputs, labels, keywords = surrogate_rows([1.0, -1.0, 1.0, -1.0])
    keywords["old_log_probs"][2, 2] -= 5.0  # row 2's first label, the middle of 16: ratio e^5 > 1 + ε, A > 0
    assert loss_alignment_message(SURROGATE, outputs, labels, keywords) is None
