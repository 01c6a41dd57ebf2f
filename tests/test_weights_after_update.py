"""Weights after an update: an update that leaves inf or nan in the weights stops the run before any checkpoint
holds them (accumulation/run/checkpoint.py, check_weights_finite), and learning rates or weight decays so large
that an update erases or overflows the weights are refused at start-up (accumulation/config/config.py)."""

import math
import os
from pathlib import Path

import pytest
import torch

import train
from accumulation.run import build
from testkit.ranks import run_main_on_ranks
from tests.test_checkpoints import run_in_process
from tests.test_train import read_metrics, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.mark.parametrize(
    "change, named",
    [
        ({"optim.lr": 1e308}, "optim.lr: expected a number <= 100, got 1e+308 (a minus sign"),
        ({"optim.lr": 3e3}, "optim.lr"),  # 3e-3 without its minus sign
        ({"optim.weight_decay": 1e308}, "optim.lr x optim.weight_decay < 1, got 0.003 x 1e+308"),
        ({"optim.lr": 0.5, "optim.weight_decay": 2.0, "optim.name": "sgd"}, "got 0.5 x 2"),
    ],
)
def test_an_absurd_learning_rate_or_weight_decay_is_refused_at_start_up(tmp_path, corpus, capsys, change, named):
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **change), capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "change", [{"optim.lr": 100.0, "optim.weight_decay": 0.0}, {"optim.lr": 0.99, "optim.weight_decay": 1.0}]
)
def test_the_largest_allowed_learning_rate_and_decay_start(tmp_path, corpus, capsys, change):
    """The bounds refuse only the absurd: lr = 100 without decay, and lr x weight_decay just below 1, start."""
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **change, **{"run.max_steps": 1}), capsys)
    assert status == 0, error


def overflow_after_update(monkeypatch, update: int) -> None:
    """The optimizer's `update`-th update (counted from 1) leaves inf in one weight of the first matrix, as an
    update that overflows does; every other update is the real one."""
    real_build_optimizer = build.build_optimizer

    def build_optimizer(optim, model, device):
        optimizer = real_build_optimizer(optim, model, device)
        updates = []

        def after_step(optimizer, args, kwargs):
            updates.append(1)
            if len(updates) == update:
                with torch.no_grad():
                    optimizer.param_groups[0]["params"][0].view(-1)[0] = math.inf

        optimizer.register_step_post_hook(after_step)
        return optimizer

    monkeypatch.setattr(build, "build_optimizer", build_optimizer)


def assert_stopped_before_checkpointing(status, error, run_dir: Path, last_checkpoint: int) -> None:
    assert status == 2, error
    assert error.count("\n") == 1 and error.startswith("error: an update left inf or nan in the weights (first "), error
    assert "no checkpoint was written with them" in error and "lower optim.lr (now 0.003)" in error, error
    latest = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert latest["counters"]["steps"] == last_checkpoint
    for name, saved in latest["model"].items():
        assert torch.isfinite(saved).all(), name


@pytest.mark.parametrize(
    "settings, last_checkpoint, last_step_run",
    [
        # the update of step 2 overflows; step 2's own checkpoint is refused (its loss was finite: the guard
        # before the checkpoint finds it)
        ({"run.checkpoint_every": 1}, 1, 2),
        # checkpoints every 3 steps: step 3's forward from inf weights is non-finite, and the check after a
        # non-finite step finds it there under either optim.on_nonfinite (no 20 skipped steps first)
        ({"run.checkpoint_every": 3, "run.max_steps": 8}, 0, 3),
        ({"run.checkpoint_every": 3, "run.max_steps": 8, "optim.on_nonfinite": "stop"}, 0, 3),
    ],
)
def test_an_update_that_leaves_non_finite_weights_stops_before_they_are_checkpointed(
    tmp_path, corpus, capsys, monkeypatch, settings, last_checkpoint, last_step_run
):
    overflow_after_update(monkeypatch, update=2)
    arguments = tiny_settings(tmp_path, corpus, **settings, **{"run.sample_bytes": 0, "run.keep_checkpoints": 9})
    status, _, error = run_in_process(arguments, capsys)
    run_dir = tmp_path / "runs" / "default"
    assert_stopped_before_checkpointing(status, error, run_dir, last_checkpoint)
    assert [line["steps"] for line in read_metrics(run_dir)][-1] == last_step_run


def main_with_an_overflow_on_rank_1(argv: list[str]) -> int:
    """train.main where rank 1's second update leaves inf in one weight (rank 0's weights stay finite)."""
    if os.environ["RANK"] == "1":
        overflow_after_update(pytest.MonkeyPatch(), update=2)
    return train.main(argv)


def test_non_finite_weights_on_one_rank_stop_every_rank(tmp_path, corpus):
    """The check is one all-reduce: rank 1's overflow stops rank 0 too, at the same step, before the checkpoint
    that rank 0 alone writes (and whose weights, rank 0's own, are finite)."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.checkpoint_every": 1, "run.sample_bytes": 0})
    results = run_main_on_ranks("tests.test_weights_after_update:main_with_an_overflow_on_rank_1", arguments)
    assert [status for status, _, _ in results] == [2, 2], results
    assert "on another rank" in results[0][2], results[0][2]
    assert "first " in results[1][2], results[1][2]
    latest = torch.load(tmp_path / "runs" / "default" / "checkpoints" / "latest.pt", weights_only=True)
    assert latest["counters"]["steps"] == 1
