"""The two worked forks of docs/forking.md, through the real entry point: supervised fine-tuning on
prompt/response JSONL (configs/sft.toml) and a model of another family (model.name = "gru"). Through train.main
here or on forked ranks by default, launched as a user does in the integration tier (tests/test_train.py)."""

import pytest
import torch

import train
from accumulation.config.config import load_config
from accumulation.data.masked_lm import MaskedTokenRows
from accumulation.data.sources import build_data, step_row_ids
from tests.conformance.tokens import write_token_folder
from tests.test_train import LAUNCHES, REPO, final_weights, read_metrics, train_as

SFT_CONFIG = str(REPO / "configs" / "sft.toml")


def small_sft(tmp_path, **overrides) -> list[str]:
    """configs/sft.toml cut down to a few steps of a one-layer model."""
    settings = {
        "run.out_dir": str(tmp_path / "runs"),
        "run.max_steps": 4,
        "run.log_every": 2,
        "run.eval_every": 2,
        "run.checkpoint_every": 2,
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.n_head": 2,
        "model.dropout": 0.1,  # so that exact resume has random state to restore
        "batch.global_batch_size": 8,
        "batch.micro_batch_size": 2,
    }
    settings.update(overrides)
    return ["--config", SFT_CONFIG, *[f"{key}={value}" for key, value in settings.items()]]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("ranks", [1, 2])
def test_sft_counts_only_response_tokens_on_1_and_2_ranks(tmp_path, capsys, launch, ranks):
    status, _, stderr = train_as(launch, small_sft(tmp_path), ranks, capsys)
    assert status == 0, stderr
    metrics = read_metrics(tmp_path / "runs" / "sft")
    assert [line["steps"] for line in metrics] == [1, 2, 3, 4]
    # Counted independently from the raw examples: every response byte is one supervised target (the
    # prompt, at least one byte, is never supervised; no example of this file is truncated at seq_len 100).
    config = load_config(["--config", SFT_CONFIG])
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    expected_tokens = 0
    for line in metrics:
        row_ids = step_row_ids(data.train.num_rows, 8, 1337, line["steps"] - 1, "drop")
        expected_tokens += sum(len(data.train.raw_example(row_id, 0).targets) for row_id in row_ids.tolist())
        assert line["tokens"] == expected_tokens
        assert line["examples"] == 8 * line["steps"]
    assert metrics[1]["val_loss"] is not None


@pytest.mark.parametrize("launch", LAUNCHES)
def test_sft_resume_is_bit_identical(tmp_path, capsys, launch):
    status, _, stderr = train_as(launch, small_sft(tmp_path / "straight"), 1, capsys)
    assert status == 0, stderr
    status, _, stderr = train_as(launch, small_sft(tmp_path / "resumed", **{"run.max_steps": 2}), 1, capsys)
    assert status == 0, stderr
    status, stdout, stderr = train_as(launch, small_sft(tmp_path / "resumed"), 1, capsys)
    assert status == 0, stderr
    assert "resuming from" in stdout
    expected = final_weights(tmp_path / "straight" / "runs" / "sft")
    resumed = final_weights(tmp_path / "resumed" / "runs" / "sft")
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    # The metrics too, one line per step, except the measured timings.
    timing = ("tokens_per_s", "peak_mem_bytes", "time_s")
    for run in (tmp_path / "straight", tmp_path / "resumed"):
        lines = read_metrics(run / "runs" / "sft")
        assert [line["steps"] for line in lines] == [1, 2, 3, 4]
    straight_lines, resumed_lines = (
        read_metrics(run / "runs" / "sft") for run in (tmp_path / "straight", tmp_path / "resumed")
    )
    for a, b in zip(straight_lines, resumed_lines, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_gru_trains_through_the_entry_point_and_gets_its_sample(tmp_path, capsys, launch):
    arguments = small_sft(tmp_path, **{"model.name": "gru", "model.dropout": 0.0, "run.sample_bytes": 8})
    status, stdout, stderr = train_as(launch, arguments, 1, capsys)
    assert status == 0, stderr
    assert "model: gru:" in stdout
    assert "sample:\n" in stdout  # its logits predict the next token: sampled like the GPT (accumulation/run/sample.py)
    metrics = read_metrics(tmp_path / "runs" / "sft")
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learns
    weights = final_weights(tmp_path / "runs" / "sft")
    assert any(name.startswith("gru.") for name in weights)


MLM_CONFIG = str(REPO / "configs" / "mlm.toml")


def small_mlm(tmp_path, **overrides) -> list[str]:
    """configs/mlm.toml cut down to a one-layer encoder on token files written here."""
    settings = {
        "run.out_dir": str(tmp_path / "runs"),
        "run.max_steps": 2,
        "data.source": str(write_token_folder(tmp_path)),
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.n_head": 2,
        "batch.global_batch_size": 8,
        "batch.micro_batch_size": 2,
    }
    settings.update(overrides)
    return ["--config", MLM_CONFIG, *[f"{key}={value}" for key, value in settings.items()]]


def test_mlm_counts_only_the_masked_positions(tmp_path, capsys):
    """The tokens counter of the masked-LM fork is the masked positions of the consumed rows, counted from their
    raw examples at each step (about 15% of 64 per row, different in every step)."""
    assert train.main(small_mlm(tmp_path, **{"run.max_steps": 3})) == 0
    metrics = read_metrics(tmp_path / "runs" / "mlm")
    config = load_config(small_mlm(tmp_path))
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    expected_tokens, per_step = 0, []
    for line in metrics:
        step = line["steps"] - 1
        row_ids = step_row_ids(data.train.num_rows, 8, 1337, step, "drop")
        per_step.append(sum(len(data.train.raw_example(row_id, step).targets) for row_id in row_ids.tolist()))
        expected_tokens += per_step[-1]
        assert line["tokens"] == expected_tokens
    assert all(0.05 * 8 * 64 < tokens < 0.25 * 8 * 64 for tokens in per_step), per_step  # 15% of 512, about 77
    assert "vocabulary 257 (meta.json + [MASK])" in capsys.readouterr().out


def test_train_stops_with_one_line_when_supervised_counts_disagree_with_the_labels(tmp_path, capsys, monkeypatch):
    """A fork whose supervised_counts counts every position (the unmasked rows) while its labels hold the masked
    ones: train.py refuses the first step with one line naming the row and both counts, before anything is
    written (step 0's rows are built and checked before the step-0 checkpoint, for the probe)."""

    def every_position(self, row_ids, step):
        return torch.full((len(row_ids),), self.seq_len)

    monkeypatch.setattr(MaskedTokenRows, "supervised_counts", every_position)
    assert train.main(small_mlm(tmp_path)) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and error.startswith("error: step 0: the labels of row ")
    assert "supervised_counts promised 64" in error
    run_dir = tmp_path / "runs" / "mlm"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
