"""Run-side settings that the suite did not vary before (issue 42): a finished run started again, a resume of a
run with a GradScaler, FSDP2 with clipping on, the change-of-D resume with dropout, non-finite stops with
checkpoints every few steps, and partial tails whose row count the global batch divides. Each test fails when the
code behind its setting is broken (the break planted by hand to check it, then restored)."""

from pathlib import Path

import pytest
import torch

import train
from tests.test_checkpoints import run_in_process
from tests.test_train import comparable, final_weights, read_metrics, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


def test_a_finished_run_started_again_says_so_in_one_line(tmp_path, corpus, capsys):
    """Before: the header and "training steps 2..2", exit 0, having trained nothing."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 2, "run.sample_bytes": 0, "run.name": "twice"})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "twice"

    def written():  # every file but run.lock, which each job takes (and writes its holder into)
        return {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.name != "run.lock"}

    files_before = written()
    status, out, error = run_in_process(arguments, capsys)
    assert status == 0 and error == "", error
    resuming, finished = out.splitlines()  # find_resume_point's line, then the one that says it is finished
    assert resuming.startswith("resuming from ") and finished.startswith("run.name='twice' already finished"), out
    assert "run.max_steps=2" in out and "raise run.max_steps" in out, out
    assert written() == files_before
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2]
    # ... and a larger run.max_steps goes on from there
    status, out, error = run_in_process([*arguments, "run.max_steps=3"], capsys)
    assert status == 0, error
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2, 3]


def weights_close(found: dict, expected: dict, initial: dict, relative: float) -> None:
    """Each tensor within `relative` of its largest change over the run (plus a floor for tensors that barely
    move), so the bound scales with the update rather than with the weights."""
    for key, value in expected.items():
        tolerance = relative * (value - initial[key]).abs().max().item() + 1e-8
        assert (found[key] - value).abs().max().item() <= tolerance, key


def test_fsdp2_with_clipping_on_follows_ddp(tmp_path, corpus):
    """Clipping scales every gradient by grad_clip / ‖g‖, so under FSDP2 the norm assembled from the shards must
    be the whole gradient's: 0.05 is far below the tiny model's norms (about 1 to 3), so every step clips.
    Before, FSDP2 ran only with clipping off, where a wrong norm changed nothing but the log."""
    from tests.test_train import train_forked

    common = {"run.max_steps": 3, "run.sample_bytes": 0, "run.eval_every": 0, "optim.grad_clip": 0.05}
    common |= {"optim.name": "sgd", "optim.lr": 0.5, "optim.momentum": 0.0, "optim.weight_decay": 0.0}
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        arguments = tiny_settings(tmp_path, corpus, **common, **{"dist.strategy": strategy, "run.name": strategy})
        status, _, error = train_forked(arguments, ranks=2)
        assert status == 0, error
        runs[strategy] = tmp_path / "runs" / strategy
    ddp, fsdp2 = (read_metrics(runs[name]) for name in ("ddp", "fsdp2"))
    assert all(line["grad_norm"] > 0.05 for line in ddp)  # every step clipped
    for ddp_line, fsdp2_line in zip(ddp, fsdp2, strict=True):
        # the same D = 2 terms per entry in another collective: rounding only (tests/test_fsdp.py's FP32_RTOL)
        assert fsdp2_line["grad_norm"] == pytest.approx(ddp_line["grad_norm"], rel=1e-5)
        assert fsdp2_line["loss"] == pytest.approx(ddp_line["loss"], rel=1e-6)
    initial = torch.load(runs["ddp"] / "checkpoints" / "step_000000.pt", weights_only=True)["model"]
    weights_close(final_weights(runs["fsdp2"]), final_weights(runs["ddp"]), initial, relative=1e-4)


def test_a_resume_keeps_the_grad_scalers_state(tmp_path, corpus, capsys, monkeypatch):
    """A skipped step (its loss made nan) halves the GradScaler's scale at step 2; the run stopped at step 2 and
    resumed must go on from the halved scale, as the uninterrupted run does: the logged scale of every step and
    the checkpoint's scaler state equal. Before, no test resumed a run that had a GradScaler (its scale differing
    from the initial one), so a resume that dropped the scaler's state passed."""
    from tests.test_nonfinite_steps import make_loss_nan_at

    make_loss_nan_at(monkeypatch, {2})
    common = {"precision.grad_scaler": "true", "run.sample_bytes": 0, "run.checkpoint_every": 2}
    straight = tiny_settings(tmp_path, corpus, **common, **{"run.name": "straight"})
    assert run_in_process(straight, capsys)[0] == 0
    resumed = tiny_settings(tmp_path, corpus, **common, **{"run.name": "resumed"})
    assert run_in_process([*resumed, "run.max_steps=2"], capsys)[0] == 0
    assert run_in_process(resumed, capsys)[0] == 0
    expected, found = (read_metrics(tmp_path / "runs" / name) for name in ("straight", "resumed"))
    assert expected[2]["scale"] == expected[0]["scale"] / 2  # the skip at step 2 halved it
    assert comparable(found) == comparable(expected)
    straight_state, resumed_state = (
        torch.load(tmp_path / "runs" / name / "checkpoints" / "latest.pt", weights_only=True)
        for name in ("straight", "resumed")
    )
    assert resumed_state["scaler"] == straight_state["scaler"]


def test_a_non_finite_stop_writes_its_checkpoint_between_the_regular_ones(tmp_path, corpus, capsys, monkeypatch):
    """optim.on_nonfinite = "stop" at step 2 with checkpoints every 5 steps: the stop writes step 2's checkpoint
    itself (the last good weights, those of step 1's update). Before, every stop test checkpointed every step,
    so a stop that wrote nothing of its own passed."""
    from tests.test_nonfinite_steps import make_loss_nan_at

    make_loss_nan_at(monkeypatch, {2})
    settings = {"optim.on_nonfinite": "stop", "run.checkpoint_every": 5, "run.sample_bytes": 0, "run.max_steps": 8}
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **settings), capsys)
    assert status == 1 and "stopping at step 2" in error, error
    run_dir = tmp_path / "runs" / "default"
    latest = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert latest["counters"]["steps"] == 2 and latest["counters"]["updates"] == 1
    assert (run_dir / "STOPPED").is_file()


def test_a_partial_tail_that_the_global_batch_divides_adds_no_step(tmp_path, capsys):
    """16 one-row documents and G = 8: every epoch is exactly 2 full steps, so batch.tail = "partial" must run
    the same steps as "drop" (no empty or short third step). Before, every partial-tail test had a row count
    the global batch does not divide."""
    corpus = tmp_path / "sixteen"
    corpus.mkdir()
    for index in range(16):
        (corpus / f"doc{index:02d}.txt").write_text("abcdefghij"[: 4 + index % 6])
    runs = {}
    for tail in ("drop", "partial"):
        change = {"batch.tail": tail, "run.name": tail, "data.val_fraction": 0.0, "data.layout": "documents"}
        arguments = tiny_settings(tmp_path, corpus, **change, **{"run.max_steps": 5, "run.sample_bytes": 0})
        status, out, error = run_in_process(arguments, capsys)
        assert status == 0, error
        runs[tail] = read_metrics(tmp_path / "runs" / tail)
    assert [line["examples"] for line in runs["partial"]] == [8, 16, 24, 32, 40]  # 5 full steps over 2.5 epochs
    assert comparable(runs["partial"]) == comparable(runs["drop"])


def test_a_resume_on_another_number_of_ranks_with_dropout_starts_the_promised_streams(
    tmp_path, corpus, capsys, monkeypatch
):
    """2 ranks for steps 1-2 with dropout, then 1 rank (A = 4) from the step-2 checkpoint: the saved per-rank
    streams no longer fit, so the rank must start the fresh stream of (run.seed, step 2, rank 0), and with the
    same number of ranks the saved one. The generator is read as the resume hands over to the training section,
    and compared with seed_dropout's stream computed here. Before, the change-of-D resume ran without dropout,
    where any stream (the build's of step 0, the saved rank 0's) gave the same bits."""
    from accumulation.run.checkpoint import seed_dropout
    from tests.test_train import train_forked

    common = {"model.dropout": 0.2, "run.sample_bytes": 0, "run.checkpoint_every": 2}
    arguments = tiny_settings(tmp_path, corpus, **common, **{"run.max_steps": 2})
    status, _, error = train_forked(arguments, ranks=2)
    assert status == 0, error
    saved = torch.load(tmp_path / "runs" / "default" / "checkpoints" / "latest.pt", weights_only=True)["rng"]
    handed_over = []
    real_restore = train.restore_training_state

    def restore_and_read_the_generator(*args, **kwargs):
        result = real_restore(*args, **kwargs)
        handed_over.append(torch.get_rng_state())
        return result

    monkeypatch.setattr(train, "restore_training_state", restore_and_read_the_generator)
    status, out, error = run_in_process(tiny_settings(tmp_path, corpus, **common, **{"run.max_steps": 3}), capsys)
    assert status == 0 and "x accum 4 x ranks 1" in out, error
    seed_dropout(1337, rank=0, steps=2)  # tiny_settings' run.seed (the default)
    assert torch.equal(handed_over[0], torch.get_rng_state())
    assert not torch.equal(handed_over[0], saved["per_rank"][0]["cpu"])
    # One rank again, from the 1-rank checkpoint of step 3: the saved stream goes on.
    saved = torch.load(tmp_path / "runs" / "default" / "checkpoints" / "latest.pt", weights_only=True)["rng"]
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **common, **{"run.max_steps": 4}), capsys)
    assert status == 0, error
    assert torch.equal(handed_over[1], saved["per_rank"][0]["cpu"])
