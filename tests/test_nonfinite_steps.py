"""Non-finite steps: a NaN loss is skipped or stops the run (optim.on_nonfinite), and a streak of skipped
steps carries across a resume. train.main runs in this process with the loss of chosen steps made NaN."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from accumulation.run import batches, build
from tests.test_checkpoints import run_in_process
from tests.test_train import final_weights, read_metrics, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


# ---------------------------------------------------------------------------------------------------------
# Non-finite steps
# ---------------------------------------------------------------------------------------------------------


def make_loss_nan_at(monkeypatch, bad_steps: set[int]) -> None:
    """The loss of each step in bad_steps (counted from 1) is multiplied by nan, and so is every gradient."""
    real_optimizer_step, real_step_batch = build.optimizer_step, batches.step_batch
    step_running = []  # the step whose examples were fetched last, counted from 1

    def step_batch(rows, step, **layout):
        step_running.append(step + 1)
        return real_step_batch(rows, step, **layout)

    def optimizer_step(setup, micro_batches, optimizer, **options):
        if step_running[-1] in bad_steps:
            nan_loss = dataclasses.replace(setup, loss_sum_fn=lambda *args: setup.loss_sum_fn(*args) * math.nan)
            return real_optimizer_step(nan_loss, micro_batches, optimizer, **options)
        return real_optimizer_step(setup, micro_batches, optimizer, **options)

    monkeypatch.setattr(batches, "step_batch", step_batch)
    monkeypatch.setattr(build, "optimizer_step", optimizer_step)


@pytest.mark.parametrize(
    "on_nonfinite, grad_scaler, bad_steps, stops_at, stop_reason",
    [
        ("skip", False, {2}, None, None),
        ("skip", True, {2}, None, None),
        ("stop", False, {2}, 2, "non-finite loss nan (optim.on_nonfinite=stop)"),
        ("stop", True, {2}, 2, "non-finite loss nan (optim.on_nonfinite=stop)"),
        ("skip", False, {2, 3}, 3, "2 skipped updates in a row (optim.max_consecutive_skips=2)"),
    ],
)
def test_a_non_finite_step_is_skipped_or_stops_the_run(
    tmp_path, corpus, capsys, monkeypatch, on_nonfinite, grad_scaler, bad_steps, stops_at, stop_reason
):
    make_loss_nan_at(monkeypatch, bad_steps)
    arguments = tiny_settings(
        tmp_path,
        corpus,
        **{
            "optim.on_nonfinite": on_nonfinite,
            "precision.grad_scaler": str(grad_scaler).lower(),
            "optim.max_consecutive_skips": 2,
            "run.checkpoint_every": 1,
            "run.keep_checkpoints": 5,
            "run.sample_bytes": 0,
        },
    )
    status, _, error = run_in_process(arguments, capsys)
    run_dir = tmp_path / "runs" / "default"
    metrics = read_metrics(run_dir)
    skipped_line = metrics[1]  # step 2
    assert skipped_line["skipped"] == 1 and skipped_line["updates"] == 1 and skipped_line["loss"] is None
    expected_reason = "non-finite gradient (GradScaler lowered its scale)" if grad_scaler else "non-finite gradient"
    assert skipped_line["skip_reason"] == expected_reason
    step_1, step_2 = (torch.load(run_dir / "checkpoints" / f"step_00000{s}.pt", weights_only=True) for s in (1, 2))
    if grad_scaler:  # the logged scale is the one the step's loss was multiplied by; the skip then halves it
        assert skipped_line["scale"] == metrics[0]["scale"] == step_1["scaler"]["scale"]
        assert step_2["scaler"]["scale"] == skipped_line["scale"] / 2
    for key, value in step_1["model"].items():
        assert torch.equal(step_2["model"][key], value), key  # the skipped update left the weights alone
    if stops_at is None:
        assert status == 0, error
        assert [line["steps"] for line in metrics] == [1, 2, 3, 4]
        assert metrics[2]["lr"] == metrics[1]["lr"]  # the schedule counts applied updates only
        # ... and validation counts steps (run.eval_every = 2): at steps 2 and 4, not at update 2 (step 3)
        assert [line["steps"] for line in metrics if "val_loss" in line] == [2, 4]
        assert all(torch.isfinite(value).all() for value in final_weights(run_dir).values())
    else:
        assert status == 1
        assert error == f"error: stopping at step {stops_at}: {stop_reason}; checkpoint written\n"
        assert [line["steps"] for line in metrics] == list(range(1, stops_at + 1))
        latest = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
        assert latest["counters"]["steps"] == stops_at and latest["counters"]["updates"] == 1
        for key, value in step_1["model"].items():
            assert torch.equal(latest["model"][key], value), key  # the last good weights: those of step 1
        # A restart (as torchrun --max-restarts would do) refuses to continue past the stop ...
        status, _, error = run_in_process(arguments, capsys)
        assert status == 2 and "was stopped at step" in error and "STOPPED" in error
        # ... until a person has looked and removed the marker.
        (run_dir / "STOPPED").unlink()
        status, _, error = run_in_process(arguments, capsys)
        assert status == 0, error
        assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_a_streak_of_skipped_steps_goes_on_across_a_resume(tmp_path, corpus, capsys, monkeypatch):
    """Steps 2 and 3 skipped with optim.max_consecutive_skips = 2: the run stops at step 3 whether or not it
    was interrupted between them, because the checkpoint of step 2 holds the streak (skips_in_a_row = 1)."""
    make_loss_nan_at(monkeypatch, {2, 3})
    settings = {"optim.max_consecutive_skips": 2, "run.checkpoint_every": 1, "run.sample_bytes": 0}
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **settings, **{"run.max_steps": 2}), capsys)
    assert status == 0, error
    latest = torch.load(tmp_path / "runs" / "default" / "checkpoints" / "latest.pt", weights_only=True)
    assert latest["skips_in_a_row"] == 1
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **settings), capsys)
    assert status == 1 and "stopping at step 3: 2 skipped updates in a row" in error, error
