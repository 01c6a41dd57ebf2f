"""The checker's detectors one at a time (accumulation/checker/run.py): the line for the step's supervised
targets N, the comparison of initial weights across ranks, and every rank's exit status on a verdict. Each test
breaks one thing the check must see and asserts that this line, and only what follows from it, says FAIL. Also:
outputs that do not fit the loss (one line, exit 2) and the pipelined step checked twice on a 2 x 2 mesh."""

import dataclasses
import os
import re
import sys

import pytest
import torch

from accumulation import checker
from accumulation.checker import run as checker_run
from accumulation.run import build
from testkit.ranks import run_main_on_ranks
from tests.test_check_equivalence import (
    TINY_CONFIG,
    checker_line,
    failing_lines,
    run_on_mlm,
    short_documents_corpus,
)
from tests.test_train import uneven_corpus

# Step 0 of TINY_CONFIG's data order on short_documents_corpus holds 221 supervised targets (the mean-of-means
# test of tests/test_check_equivalence.py reads the same figure off the self-test's refusal line).
STEP_0_TARGETS = 221


def tiny_arguments(tmp_path) -> list[str]:
    return [*TINY_CONFIG, f"data.source={short_documents_corpus(tmp_path / 'corpus')}"]


def test_the_loop_s_n_is_compared_with_the_raw_examples_count_and_an_n_off_by_one_fails_that_line(
    tmp_path, capsys, monkeypatch
):
    """The loop's reported N (StepResult.tokens) against the raw examples' count: equal on the loop, and one more
    or one fewer fails the "supervised targets" line alone (the loss and the gradient do not depend on the
    reported count, so nothing else sees it)."""
    arguments = tiny_arguments(tmp_path)
    assert checker.main(arguments) == 0
    stdout = capsys.readouterr().out
    assert checker_line(stdout, "supervised targets") == f"loop {STEP_0_TARGETS}, reference {STEP_0_TARGETS}: ok"
    real_optimizer_step = build.optimizer_step  # the step build_training hands the checker, as train.py
    for offset in (1, -1):

        def optimizer_step_with_n_off(*args, offset=offset, **kwargs):
            result = real_optimizer_step(*args, **kwargs)
            return dataclasses.replace(result, tokens=result.tokens + offset)

        monkeypatch.setattr(build, "optimizer_step", optimizer_step_with_n_off)
        assert checker.main(arguments) == 1
        stdout = capsys.readouterr().out
        assert failing_lines(stdout) == ["supervised targets"], stdout
        assert checker_line(stdout, "supervised targets").startswith(
            f"loop {STEP_0_TARGETS + offset}, reference {STEP_0_TARGETS}: FAIL: "
        )


def test_a_count_bug_that_scales_every_update_fails_the_supervised_targets_line(tmp_path, capsys):
    """supervised_counts one too high on every row (--inject-bug count): the loop divides by that N, as train.py
    does; the reference counts the raw examples' targets, so the N line must FAIL beside the gradient. (A
    reference that took N from supervised_counts would agree with the loop and pass it.)"""
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "count"], 1, capsys)
    assert status == 1, stdout
    loop, reference = re.search(r"supervised targets: loop ([0-9,]+), reference ([0-9,]+)", stdout).groups()
    assert int(loop.replace(",", "")) > int(reference.replace(",", ""))
    assert "supervised targets" in failing_lines(stdout)


def main_with_a_rank_dependent_init(argv: list[str]) -> int:
    """The checker's main on a fork whose model initialises from seed + rank: two builds on one rank are
    bit-identical, but the ranks start apart. DDP broadcasts rank 0's weights, so the gradients agree anyway."""
    real_build_model = checker_run.build_model

    def build_model(model_config, vocab_size, *, seq_len, seed):
        model = real_build_model(model_config, vocab_size, seq_len=seq_len, seed=seed)
        generator = torch.Generator().manual_seed(seed + int(os.environ.get("RANK", "0")))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.02, generator=generator)
        return model

    checker_run.build_model = build_model  # this forked rank's own module, gone with the rank
    return checker.main(argv)


RANK_DEPENDENT_MAIN = "tests.test_checker_verdicts:main_with_a_rank_dependent_init"


def test_a_model_whose_init_depends_on_the_rank_fails_the_initial_weights_line_on_every_rank(tmp_path):
    arguments = tiny_arguments(tmp_path)
    ((status, stdout, stderr),) = run_main_on_ranks(RANK_DEPENDENT_MAIN, arguments, world_size=1)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout + stderr  # one rank: seed + 0, a good model
    per_rank = run_main_on_ranks(RANK_DEPENDENT_MAIN, arguments, world_size=2)
    assert [status for status, _, _ in per_rank] == [1, 1], per_rank
    stdout = per_rank[0][1]
    assert stdout.splitlines()[-2:] == [
        "initial weights: FAIL: two builds from the same seed, or two ranks, differ: initialise from config.run.seed",
        "FAIL",
    ], stdout
    assert per_rank[1][1] == ""  # rank 1 prints nothing: one verdict, rank 0's


def test_every_rank_exits_with_the_verdict(tmp_path):
    """Rank 0 alone compares; each rank must still end with its verdict: 0 on PASS, 1 on FAIL on both ranks (a
    rank that returned 0 on a FAIL would make torchrun report the job as partly successful)."""
    arguments = tiny_arguments(tmp_path)
    passed = run_main_on_ranks("accumulation.checker:main", arguments, world_size=2)
    assert [status for status, _, _ in passed] == [0, 0], passed
    assert passed[0][1].splitlines()[-1] == "PASS"
    failed = run_main_on_ranks("accumulation.checker:main", [*arguments, "--inject-bug", "mean-of-means"], world_size=2)
    assert [status for status, _, _ in failed] == [1, 1], failed
    assert failed[0][1].splitlines()[-1] == "FAIL"


# ------------------------------------------------------------------ The checker: outputs that do not fit the loss

SEVEN_LOGITS = """
import torch
from accumulation.config.registry import register_model


class SevenLogits(torch.nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 7)

    def forward(self, inputs):
        return self.embed(inputs)  # 7 logits per position for a vocabulary of 256


register_model("seven-logits", lambda model_config, vocab_size, *, seq_len, seed: SevenLogits(vocab_size))
"""
UNFIT_LINE = (
    "error: step 0: the loss raised on the model's outputs float32 [2, 16, 7] and the labels int64 [2, 16]: IndexError"
)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_checker_refuses_outputs_that_do_not_fit_the_loss_in_one_line(tmp_path, capsys, monkeypatch, ranks):
    """Before: a 30-line IndexError traceback from inside the loop's step, exit 1 (a FAIL's status). Now every
    rank finds it before any collective and says so in one line, exit 2, as train.py's step 0 does."""
    (tmp_path / "unfit_fork.py").write_text(SEVEN_LOGITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = [
        "model.name=unfit_fork:seven-logits",
        f"data.source={corpus}",
        "data.seq_len=16",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
    ]
    try:
        if ranks == 1:
            per_rank = [(checker.main(arguments), *capsys.readouterr())]
        else:
            per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=ranks)
    finally:
        sys.modules.pop("unfit_fork", None)
    for status, stdout, stderr in per_rank:
        assert status == 2 and stdout == "", (stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith(UNFIT_LINE), stderr


def test_the_checker_runs_the_pipelined_step_twice_and_compares_both(tmp_path):
    """On a 2 × 2 mesh (D = 2 replicas of 2 stages): DDP rebuilds each stage's gradient buckets at the second
    step's first forward, where a reducer armed by the schedule's shape inference died; a one-step check passed
    such a loop. Both steps' gradients are compared with the float64 reference."""
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = [
        f"data.source={corpus}",
        "data.seq_len=16",
        "model.n_layer=2",
        "model.n_head=2",
        "model.d_model=16",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
        "dist.pipeline_stages=2",
    ]
    per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=4)
    assert [status for status, _, _ in per_rank] == [0] * 4, per_rank[0][2]
    stdout = per_rank[0][1]
    assert "2 pipeline stages (1f1b), 4 ranks" in stdout and stdout.splitlines()[-1] == "PASS", stdout
    assert "eager, 2 steps on the same rows;" in stdout, stdout
