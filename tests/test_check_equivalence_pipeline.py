"""scripts/checks/check_equivalence.py with pipeline stages on forked gloo ranks (and under torchrun in the
integration tier): PASS on 2 ranks (P = 2) and on 4 (a 2 × 2 mesh) against the float64 full batch; FAIL with the
schedule's scale_grads default injected."""

import re

import pytest

from accumulation import checker as check_equivalence
from testkit.ranks import pretend_launched
from tests.test_check_equivalence import (
    TINY_CONFIG,
    checker_line,
    reported_relative_error,
    run_checker,
    run_checker_with_stderr,
    short_documents_corpus,
)

STAGES = ["model.n_layer=2", "dist.pipeline_stages=2"]


@pytest.mark.parametrize("launched", [False, pytest.param(True, marks=pytest.mark.integration)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_pipelined_loop_passes(tmp_path, capsys, ranks, launched):
    status, stdout, _ = run_checker_with_stderr(tmp_path, STAGES, ranks, capsys, launched)
    assert status == 0, stdout
    assert f"x replicas {ranks // 2}; 2 pipeline stages (1f1b), {ranks} ranks;" in stdout
    assert stdout.splitlines()[-1] == "PASS"
    assert reported_relative_error(stdout) < check_equivalence.RELATIVE_TOLERANCE["fp32"]


def test_the_schedules_scale_grads_default_fails(tmp_path, capsys):
    status, stdout = run_checker(tmp_path, [*STAGES, "--inject-bug", "scale-grads"], 2, capsys)
    assert status == 1, stdout
    assert stdout.splitlines()[-1] == "FAIL"
    # scale_grads divides the accumulated gradient by A = 4 once more: its norm before clipping is 1 - 1/4 off.
    # (Clipped at optim.grad_clip = 1, which binds here, the gradient itself is off by less.)
    norm_line = checker_line(stdout, "gradient norm")
    assert abs(float(re.search(r"relative error ([0-9.e+-]+)", norm_line).group(1)) - 0.75) < 0.01, norm_line
    assert reported_relative_error(stdout) > 100 * check_equivalence.RELATIVE_TOLERANCE["fp32"]


def test_the_pipeline_bug_needs_pipeline_stages(tmp_path, capsys):
    corpus = short_documents_corpus(tmp_path / "corpus")
    assert check_equivalence.main([*TINY_CONFIG, f"data.source={corpus}", "--inject-bug", "scale-grads"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: --inject-bug scale-grads") and "\n" not in line


@pytest.mark.parametrize("model", [["model.n_layer=1"], ["model.name=gru"]], ids=["one-block", "no-seam"])
def test_a_model_that_does_not_split_is_one_line_exit_2(tmp_path, capsys, monkeypatch, model):
    pretend_launched(monkeypatch, world_size=2)  # read before any process group: nothing is launched
    corpus = short_documents_corpus(tmp_path / "corpus")
    arguments = [*TINY_CONFIG, f"data.source={corpus}", *model, "dist.pipeline_stages=2"]
    assert check_equivalence.main(arguments) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: dist.pipeline_stages") and "\n" not in line
