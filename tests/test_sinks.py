"""The step records' sinks (accumulation/run/sinks.py): every numeric field of metrics.jsonl reaches TensorBoard
under a tag grouped by unit, after a default run and a GRPO run; the final validation loss is logged like the
others; log.sinks chooses the sinks (a fork's own by name, on rank 0 only), and a bad or missing one is refused in
one line before anything is written."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import train
from accumulation.config.config import load_config
from accumulation.config.registry import register_sink
from accumulation.models.factory import build_model
from accumulation.run.sinks import TOKEN_AXIS_TAGS, tagged
from tests.test_logs import tensorboard_points
from tests.test_train import read_metrics, tiny_settings, train_forked, uneven_corpus


def assert_every_numeric_field_has_its_tag(run_dir: Path, source_group: str = "data") -> set[str]:
    """Each numeric field of each metrics.jsonl line is one TensorBoard point at x = its step, under its tag, equal
    to the value stored as float32 (TensorBoard's simple_value); the losses again at x = supervised tokens. Returns
    the tags on the steps axis."""
    metrics = read_metrics(run_dir)
    by_steps, by_tokens = tensorboard_points(run_dir, "by_steps"), tensorboard_points(run_dir, "by_tokens")
    expected = {}
    for line in metrics:
        for tag, value in tagged(line, source_group).items():
            expected.setdefault(tag, []).append((line["steps"], float(np.float32(value))))
    assert by_steps == expected
    numeric = {name for line in metrics for name, value in line.items() if type(value) in (int, float)}
    assert len(expected) == len(numeric)  # one tag per field, none shared
    for name, tag in TOKEN_AXIS_TAGS.items():
        points = [(line["tokens"], float(np.float32(line[name]))) for line in metrics if line.get(name) is not None]
        assert by_tokens.get(tag, []) == points, tag
    return set(by_steps)


def test_a_default_run_puts_every_numeric_field_in_tensorboard_and_the_final_validation_loss_too(tmp_path, capsys):
    """5 steps with validation every 2: steps 2 and 4, and step 5, the last, whose loss the summary prints (issue
    42: it was printed but neither in metrics.jsonl nor in TensorBoard). log.peak_tflops gives the CPU a peak,
    so MFU is computed from the GPT's declared FLOPs."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.max_steps": 5, "run.sample_bytes": 0, "log.peak_tflops": 0.5}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 0
    run_dir = tmp_path / "runs" / "default"
    metrics = read_metrics(run_dir)
    assert [line["steps"] for line in metrics if "val_loss" in line] == [2, 4, 5]
    printed = float(capsys.readouterr().out.split("validation loss ")[1].split()[0])
    assert printed == pytest.approx(metrics[-1]["val_loss"], abs=5e-5)  # the summary prints it to 4 decimals
    tags = assert_every_numeric_field_has_its_tag(run_dir)
    assert {"loss/train", "loss/validation", "lr/learning_rate", "time/step_seconds", "memory/peak_bytes"} <= tags
    assert {"throughput/tokens_per_s", "throughput/mfu", "counters/tokens", "counters/skipped"} <= tags
    # MFU from its definition: the step's positions (rows x seq_len) x the GPT's FLOPs per position, per second,
    # over the peak; the record's seconds are the ones it divides by, so only rounding separates the two.
    model = build_model(load_config(tiny_settings(tmp_path, corpus)).model, 256, seq_len=16, seed=0)
    for line in metrics:
        assert line["mfu"] == pytest.approx(8 * 16 * model.flops_per_token() / line["time_s"] / 0.5e12, rel=1e-12)


def test_a_grpo_run_puts_its_rewards_kl_and_clip_fraction_in_tensorboard(tmp_path):
    """configs/grpo.toml, tiny: 2 SFT steps, then rounds of GRPO; the source's own fields under rl/."""
    from tests.test_rl_train import arguments

    settings = ["run.max_steps=12", "data.sft_steps=8", "run.eval_every=4", "run.sample_bytes=0"]
    assert train.main(arguments(tmp_path / "runs", *settings)) == 0
    tags = assert_every_numeric_field_has_its_tag(tmp_path / "runs" / "grpo", source_group="rl")
    expected = {"rl/mean_reward", "rl/held_out_reward", "rl/approx_kl", "rl/clip_fraction", "rl/rounds"}
    assert expected <= tags


def test_the_final_validation_loss_of_an_uneven_run_is_in_metrics_and_tensorboard(tmp_path):
    """run.max_steps = 3 is no multiple of run.eval_every = 2: the last step is validated as well."""
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"run.max_steps": 3, "run.sample_bytes": 0})) == 0
    run_dir = tmp_path / "runs" / "default"
    assert [line["steps"] for line in read_metrics(run_dir) if "val_loss" in line] == [2, 3]
    assert [step for step, _ in tensorboard_points(run_dir, "by_steps")["loss/validation"]] == [2, 3]


def test_a_run_extended_past_its_validated_last_step_logs_what_an_uninterrupted_run_logs(tmp_path):
    """3 steps (validated at 2, and at 3 as the last), then extended to 5: step 3 is no longer the last, so its
    validation leaves metrics.jsonl and TensorBoard, and both equal a 5-step run's (timings aside)."""
    from tests.test_logs import assert_tensorboard_matches_metrics
    from tests.test_train import comparable

    corpus = uneven_corpus(tmp_path / "corpus")
    common = {"run.sample_bytes": 0, "schedule.decay_updates": 5, "run.checkpoint_every": 100}
    assert train.main(tiny_settings(tmp_path, corpus, **common, **{"run.max_steps": 5, "run.name": "whole"})) == 0
    for max_steps in (3, 5):
        settings = {**common, "run.max_steps": max_steps, "run.name": "extended"}
        assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 0
        # TensorBoard reads a folder's event files in the order of their names, which start with the second they
        # were created in (then host, pid, a counter): two sessions of one process in one second could swap.
        time.sleep(1.1)
    whole, extended = tmp_path / "runs" / "whole", tmp_path / "runs" / "extended"
    assert [line["steps"] for line in read_metrics(extended) if "val_loss" in line] == [2, 4, 5]
    assert comparable(read_metrics(extended)) == comparable(read_metrics(whole))
    assert_tensorboard_matches_metrics(extended)
    validation = tensorboard_points(extended, "by_steps")["loss/validation"]
    assert validation == tensorboard_points(whole, "by_steps")["loss/validation"]


# ------------------------------------------------------------------------------------------ choosing the sinks

RECORDS_FOLDER = "ECO44_SINK_TEST_FOLDER"  # where the fork's sink below writes: the test's temporary folder


class RecordsPerRank:
    """A fork's sink: every record it gets as a JSON line, in a file named for the rank that opened it."""

    def __init__(self, session):
        self.path = Path(os.environ[RECORDS_FOLDER]) / f"records_rank{os.environ.get('RANK', '0')}.jsonl"
        self.file = self.path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


register_sink("records-per-rank", RecordsPerRank)


def test_a_forks_sink_gets_every_record_on_rank_0_only_and_the_defaults_can_be_left_out(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORDS_FOLDER, str(tmp_path))
    corpus = uneven_corpus(tmp_path / "corpus")
    sinks = "jsonl,tests.test_sinks:records-per-rank"  # no TensorBoard
    status, _, stderr = train_forked(tiny_settings(tmp_path, corpus, **{"log.sinks": sinks}), ranks=2)
    assert status == 0, stderr
    run_dir = tmp_path / "runs" / "default"
    assert not (run_dir / "tensorboard").exists()
    assert sorted(path.name for path in tmp_path.glob("records_rank*")) == ["records_rank0.jsonl"]
    forked = [json.loads(line) for line in (tmp_path / "records_rank0.jsonl").read_text().splitlines()]
    assert forked == read_metrics(run_dir) and len(forked) == 4


@pytest.mark.parametrize(
    ("sinks", "message"),
    [
        ("tensorboard,csv", 'log.sinks: expected one of "tensorboard", "jsonl", "wandb", "mlflow"'),
        ("jsonl,no_such_module:sink", "log.sinks: "),
    ],
)
def test_an_unknown_sink_is_one_line_exit_2_nothing_written(tmp_path, capsys, sinks, message):
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"log.sinks": sinks})) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_sink_whose_package_is_missing_names_the_requirements_file(tmp_path, capsys, monkeypatch, package):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"log.sinks": f"jsonl,{package}"})) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install -r requirements-loggers.txt" in error, error
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------ W&B and MLflow, nothing uploaded


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file (run-ID.wandb), once it holds the run's exit record: W&B's service
    process writes the file, and can still be writing it when finish() has returned."""
    for _ in range(150):
        rows, finished = wandb_records(run_file)
        if finished:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"{run_file} holds no exit record after 30 s")


def wandb_records(run_file: Path) -> tuple[list[dict], bool]:
    """(history rows, whether the exit record is there) of a run file: a 7-byte header (":W&B", magic, version),
    then records in the LevelDB log format (32 KiB blocks; each chunk: CRC-32 (4 bytes), length (2, little-endian),
    kind (1: whole, 2 first, 3 middle, 4 last)), each record a protobuf wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block_bytes, offset, pending, rows, finished = run_file.read_bytes(), 32 * 1024, 7, b"", [], False
    while offset + 7 <= len(data):
        room = block_bytes - offset % block_bytes
        if room < 7:  # a block's tail too short for a chunk header is padding
            offset += room
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            finished = finished or record.HasField("exit")
            if record.HasField("history"):
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                rows.append({key: value for key, value in items.items() if not key.startswith("_")})
    return rows, finished


def test_weights_and_biases_offline_gets_every_tagged_field_of_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # also the sink's default: nothing is uploaded
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"log.sinks": "jsonl,wandb", "run.sample_bytes": 0})) == 0
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    metrics = read_metrics(tmp_path / "runs" / "default")
    assert wandb_history(run_file) == [tagged(line, "data") for line in metrics]


def test_mlflow_to_a_local_folder_gets_every_tagged_field_of_every_step(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    tracking_uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny has no database backend
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"log.sinks": "mlflow,jsonl", "run.sample_bytes": 0})) == 0
    client = MlflowClient(tracking_uri)
    [run] = client.search_runs(["0"])
    metrics = read_metrics(tmp_path / "runs" / "default")
    expected = {}
    for line in metrics:
        for tag, value in tagged(line, "data").items():
            expected.setdefault(tag, []).append((line["steps"], float(value)))
    got = {tag: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)] for tag in expected}
    assert got == expected and set(run.data.metrics) == set(expected)


def test_mlflow_without_a_tracking_uri_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"log.sinks": "mlflow"})) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: log.sinks: mlflow writes where MLFLOW_TRACKING_URI points, and it is not set")
    assert error.count("\n") == 1 and not (tmp_path / "runs").exists()
