"""The equivalence checker with a fork: its module found in the folder the checker is launched from, and the
promises that cannot apply to the fork's data said to be n/a, not ok. In-process, as the other checker tests."""

import runpy
import sys

import pytest
import torch

from accumulation import checker
from accumulation.checker.promises import NotApplicable, loss_alignment_message
from accumulation.checker.self_test import shifted_again_loss
from accumulation.parallel import distributed
from accumulation.step import token_cross_entropy_sum
from tests.test_disrupted_runs import REPO

CWD_FORK = """
from accumulation.config.registry import register_model
from accumulation.models.gpt import build_gpt

register_model("tiny", build_gpt)
"""
TINY_GPT = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.seq_len=16"]


def test_the_checker_imports_a_fork_from_the_folder_it_is_launched_in(tmp_path, monkeypatch, capsys):
    """As `cd my_fork && python path/to/check_equivalence.py model.name=cwd_fork:tiny`: Python puts only the
    script's own folder on sys.path, so without the launch folder the fork's module is not found."""
    (tmp_path / "cwd_fork.py").write_text(CWD_FORK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(REPO / "scripts" / "checks"), *sys.path])  # as Python sets it, restored
    arguments = ["model.name=cwd_fork:tiny", *TINY_GPT, "batch.global_batch_size=4", "batch.micro_batch_size=2"]
    monkeypatch.setattr(sys, "argv", ["check_equivalence.py", *arguments])
    # run_and_exit ends the process with os._exit: here, the status is raised instead
    monkeypatch.setattr(distributed, "run_and_exit", lambda main, argv: sys.exit(main(argv)))
    try:
        with pytest.raises(SystemExit) as exit:
            runpy.run_path(str(REPO / "scripts" / "checks" / "check_equivalence.py"), run_name="__main__")
    finally:
        sys.modules.pop("cwd_fork", None)
    captured = capsys.readouterr()
    assert exit.value.code == 0 and captured.out.splitlines()[-1] == "PASS", captured.err


def test_the_label_pairing_check_says_n_a_for_one_label_per_example(capsys):
    """The image classifier's labels are [rows], one class per example: there is no position j to pair, so the
    check cannot apply; it says so with the reason instead of ok, and the verdict does not count it."""
    status = checker.main(["--config", str(REPO / "configs" / "image_classifier.toml")])
    lines = capsys.readouterr().out.splitlines()
    pairing = [line for line in lines if line.startswith("loss pairs label j with output j: ")]
    assert pairing == [
        "loss pairs label j with output j: n/a: one label per example (labels [32]), no positions to pair"
    ]
    assert status == 0 and lines[-1] == "PASS"


def test_the_label_pairing_check_still_fails_a_loss_that_shifts_the_labels_again():
    outputs = torch.randn(2, 6, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 6))
    message = loss_alignment_message(shifted_again_loss(token_cross_entropy_sum), outputs, labels)
    assert not isinstance(message, NotApplicable) and "reads output" in message
    assert loss_alignment_message(token_cross_entropy_sum, outputs, labels) is None
