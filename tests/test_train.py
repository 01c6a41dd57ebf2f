"""train.py end to end: the real entry point, on one process and under torchrun with 2 gloo ranks (the integration
tier), and the same tests through train.main in this process or on 2 forked gloo ranks (the default tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from accumulation.batching import accumulation_steps
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_row_ids
from accumulation.run.checkpoint_checks import REQUIRED_KEYS
from testkit.ranks import run_main_on_ranks

REPO = Path(__file__).resolve().parent.parent
CONTRACT_METRICS = {
    "micro_batches",
    "steps",
    "updates",
    "skipped",
    "examples",
    "tokens",
    "loss",
    "lr",
    "grad_norm",
    "scale",
    "tokens_per_s",
    "peak_mem_bytes",
    "time_s",
}
TIMING_KEYS = {"tokens_per_s", "peak_mem_bytes", "time_s"}  # measured, so never bit-identical between runs


def uneven_corpus(folder: Path) -> Path:
    """Documents from 3 bytes to several rows long, so rows, micro-batches and ranks get very different
    supervised-token counts (the case token weighting exists for)."""
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    for index, length in enumerate([3, 5, 9, 17, 40, 70, 150, 300, 700, 1500, 2500, 4000]):
        text = bytes((torch.randint(97, 123, (length,), generator=generator)).tolist())
        (folder / f"doc{index:02d}.txt").write_bytes(text)
    return folder


def tiny_settings(tmp_path: Path, corpus: Path, **overrides) -> list[str]:
    settings = {
        "run.out_dir": str(tmp_path / "runs"),
        "run.max_steps": 4,
        "run.log_every": 2,
        "run.eval_every": 2,
        "run.sample_bytes": 8,
        "data.source": str(corpus),
        "data.seq_len": 16,
        "data.val_fraction": 0.1,
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 16,
        "batch.global_batch_size": 8,
        "batch.micro_batch_size": 2,
        "schedule.warmup_updates": 1,
    }
    settings.update(overrides)
    return [f"{key}={value}" for key, value in settings.items()]


def run_train(arguments: list[str], ranks: int = 1, timeout_s: float = 180) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        launcher + [str(REPO / "train.py")] + arguments,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=environment,
        cwd=REPO,
    )
    return completed


# How a test starts train.py: "in-process" calls train.main in this process (1 rank) or on ranks forked from the
# forkserver with torchrun's environment (testkit/ranks.py), the same code from main on without interpreters that
# import torch again; "launched" runs `python train.py` or torchrun, as a user does (the integration tier).
LAUNCHES = ["in-process", pytest.param("launched", marks=pytest.mark.integration)]


def train_as(launch: str, arguments: list[str], ranks: int, capsys) -> tuple[int, str, str]:
    """(exit status, rank 0's stdout, every rank's stderr) of train.py with `arguments` on `ranks` ranks."""
    if launch == "launched":
        completed = run_train(arguments, ranks=ranks)
        return completed.returncode, completed.stdout, completed.stderr
    if ranks == 1:
        status = train.main(arguments)
        captured = capsys.readouterr()
        return status, captured.out, captured.err
    return train_forked(arguments, ranks)


def train_forked(arguments: list[str], ranks: int, timeout_s: float = 120) -> tuple[int, str, str]:
    """(exit status, rank 0's stdout, every rank's stderr) of train.main on `ranks` ranks forked from the
    forkserver (one rank: a process of its own, as `python train.py`; for fixtures that outlive capsys)."""
    per_rank = run_main_on_ranks("train:main", arguments, world_size=ranks, timeout_s=timeout_s)
    status = next((status for status, _, _ in per_rank if status != 0), 0)  # as torchrun: the first failure
    return status, per_rank[0][1], "".join(err for _, _, err in per_rank)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    """The newest checkpoint's weights: latest.pt, or a dist.strategy = "fsdp2" run's newest folder of shards."""
    folders = sorted((run_dir / "checkpoints").glob("step_*.dcp"))
    if folders:
        from accumulation.run.sharded_checkpoint import whole_state  # only fsdp2 runs write folders

        return whole_state(folders[-1])["model"]
    return torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)["model"]


@pytest.fixture
def corpus(tmp_path):
    return uneven_corpus(tmp_path / "corpus")


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("ranks", [1, 2])
def test_entry_point_writes_the_contracted_run_directory(tmp_path, corpus, capsys, launch, ranks):
    status, stdout, stderr = train_as(launch, tiny_settings(tmp_path, corpus), ranks, capsys)
    assert status == 0, stderr
    run_dir = tmp_path / "runs" / "default"
    metrics = read_metrics(run_dir)
    assert [m["steps"] for m in metrics] == [1, 2, 3, 4]
    accum = accumulation_steps(8, 2, ranks)
    config = load_config([f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.1"])
    loaded = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    consumed_tokens = 0
    for line in metrics:
        assert CONTRACT_METRICS <= line.keys()
        assert line["micro_batches"] == line["steps"] * accum
        assert line["updates"] + line["skipped"] == line["steps"]
        ids = step_row_ids(loaded.train.num_rows, 8, 1337, line["steps"] - 1, "drop")
        consumed_tokens += int((loaded.train.lengths[ids].long() - 1).sum())
        assert line["tokens"] == consumed_tokens  # exactly the supervised tokens of the rows consumed
        assert line["examples"] == 8 * line["steps"]
    assert "val_loss" in metrics[1] and "val_loss" in metrics[3] and "val_loss" not in metrics[0]
    checkpoint = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert set(REQUIRED_KEYS) <= checkpoint.keys()
    assert checkpoint["counters"] == {key: metrics[-1][key] for key in checkpoint["counters"]}
    assert (run_dir / "checkpoints" / "step_000000.pt").exists()  # the initial checkpoint
    assert (run_dir / "config.toml").exists()
    for axis in ("by_steps", "by_tokens"):
        assert any((run_dir / "tensorboard" / axis).glob("events.out.tfevents.*"))
    assert f"global 8 = micro 2 x accum {accum} x ranks {ranks}" in stdout
    assert "sample:" in stdout
    assert stdout.splitlines()[-1].startswith("speed: ")  # the last line is the speed a user gets


# Plain SGD at lr 1 (no momentum, decay, clipping or warm-up): one update is minus the gradient, so comparing
# the weights after one step compares the gradients.
PLAIN_SGD = {
    "optim.name": "sgd",
    "optim.momentum": 0.0,
    "optim.weight_decay": 0.0,
    "optim.grad_clip": 0.0,
    "optim.lr": 1.0,
    "schedule.name": "constant",
    "schedule.warmup_updates": 0,
}
ONE_PLAIN_SGD_STEP = {**PLAIN_SGD, "run.max_steps": 1, "run.eval_every": 0, "run.sample_bytes": 0}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_one_sgd_step_is_the_same_for_every_split_of_the_global_batch(tmp_path, corpus, capsys, launch):
    """(m, A, D) in (8,1,1), (2,4,1), (4,1,2), (1,4,2): the same 8 examples of step 0, so the same update."""
    weights = {}
    for micro, ranks in [(8, 1), (2, 1), (4, 2), (1, 2)]:
        name = f"m{micro}_D{ranks}"
        arguments = tiny_settings(
            tmp_path, corpus, **ONE_PLAIN_SGD_STEP, **{"batch.micro_batch_size": micro, "run.name": name}
        )
        status, _, stderr = train_as(launch, arguments, ranks, capsys)
        assert status == 0, stderr
        weights[name] = final_weights(tmp_path / "runs" / name)
    initial = torch.load(tmp_path / "runs" / "m8_D1" / "checkpoints" / "step_000000.pt", weights_only=True)["model"]
    reference = weights["m8_D1"]
    for name, state in weights.items():
        for key in reference:
            update = reference[key] - initial[key]
            # fp32: the same sums taken in another order (per micro-batch, per rank) differ by a few ulps of
            # the gradient entries; 1e-5 of the largest update entry is ~100 ulps, yet far below the 1e-2
            # relative differences a wrong weighting gives on this corpus.
            tolerance = 1e-5 * update.abs().max().item() + 1e-7
            assert (state[key] - reference[key]).abs().max().item() <= tolerance, (name, key)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_max_steps_zero_writes_the_initial_checkpoint_and_exits(tmp_path, corpus, capsys, launch):
    status, _, stderr = train_as(launch, tiny_settings(tmp_path, corpus, **{"run.max_steps": 0}), 1, capsys)
    assert status == 0, stderr
    checkpoints = tmp_path / "runs" / "default" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest.pt", "step_000000.pt"]
    assert torch.load(checkpoints / "latest.pt", weights_only=True)["counters"]["steps"] == 0


def comparable(metrics: list[dict]) -> list[dict]:
    return [{key: value for key, value in line.items() if key not in TIMING_KEYS} for line in metrics]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_is_bit_exact_with_dropout(tmp_path, corpus, capsys, launch, ranks):
    """N steps straight equal N/2 steps, a restart, and N/2 more: weights, counters and metrics lines."""
    common = {"model.dropout": 0.2, "schedule.decay_updates": 6, "run.max_steps": 6, "run.checkpoint_every": 3}
    status, _, stderr = train_as(
        launch, tiny_settings(tmp_path, corpus, **common, **{"run.name": "straight"}), ranks, capsys
    )
    assert status == 0, stderr
    # The interrupted run: stop after step 3, then continue with the same config.
    first = tiny_settings(tmp_path, corpus, **{**common, "run.max_steps": 3, "run.name": "resumed"})
    status, _, stderr = train_as(launch, first, ranks, capsys)
    assert status == 0, stderr
    status, stdout, stderr = train_as(
        launch, tiny_settings(tmp_path, corpus, **common, **{"run.name": "resumed"}), ranks, capsys
    )
    assert status == 0, stderr
    assert "resuming from" in stdout
    a, b = tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed"
    for key, value in final_weights(a).items():
        assert torch.equal(value, final_weights(b)[key]), key
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))


@pytest.mark.parametrize("launch", LAUNCHES)
def test_resume_discards_metric_lines_after_the_checkpoint(tmp_path, corpus, capsys, launch):
    """A run killed after step 5 with its last checkpoint at step 4: the lines of step 5 are run again, once."""
    arguments = tiny_settings(
        tmp_path, corpus, **{"run.max_steps": 5, "run.checkpoint_every": 4, "run.keep_checkpoints": 5}
    )
    assert train_as(launch, arguments, 1, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step_000005.pt").unlink()  # as if the process died before its final checkpoint
    os.replace(checkpoints / "step_000004.pt", checkpoints / "latest.pt")
    status, _, stderr = train_as(launch, arguments, 1, capsys)
    assert status == 0, stderr
    assert [m["steps"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]


BAD_CONFIGS = [
    (["run.max_steps=-1"], "run.max_steps"),
    (["optim.name=adam"], "optim.name"),
    (["model.d_modle=3"], "model.d_modle"),
    (["batch.global_batch_size=30", "batch.micro_batch_size=4"], "batch.micro_batch_size"),
    (["data.source=/does/not/exist"], "/does/not/exist"),
    (["--config", "/no/such/file.toml"], "/no/such/file.toml"),
    (["run.max_steps=2.5"], "run.max_steps"),
    (["device=tpu"], "device"),
    (["model.name=gru", "model.loss=chunked"], "model.loss"),  # the GRU has no output head to chunk
]


@pytest.mark.parametrize("arguments, named", BAD_CONFIGS)
def test_bad_configuration_is_one_line_exit_2_nothing_written(tmp_path, capsys, arguments, named):
    out_dir = tmp_path / "runs"
    status = train.main(arguments + [f"run.out_dir={out_dir}"] if arguments[0] != "--config" else arguments)
    captured = capsys.readouterr()
    assert status == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and lines[0].startswith("error: ")
    assert not out_dir.exists()


@pytest.mark.parametrize("launch", LAUNCHES)
def test_bad_configuration_exit_status_from_the_real_entry_point(tmp_path, launch):
    """The exit status a shell sees: in a process forked as `python train.py` (train.main, then run_and_exit's
    exit), or launched as one."""
    arguments = [f"run.out_dir={tmp_path / 'runs'}", "batch.tail=sometimes"]
    if launch == "launched":
        completed = run_train(arguments)
        status, stderr = completed.returncode, completed.stderr
    else:
        status, _, stderr = train_forked(arguments, 1)
    assert status == 2
    assert stderr.strip().count("\n") == 0 and "batch.tail" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "runs").exists()


def test_a_fresh_run_never_mixes_into_an_existing_run_directory(tmp_path, corpus, capsys):
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 1, "run.sample_bytes": 0})
    assert train.main(arguments) == 0
    metrics_before = (tmp_path / "runs" / "default" / "metrics.jsonl").read_text()
    status = train.main(arguments + ["run.resume=never"])
    assert status == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "runs" / "default" / "metrics.jsonl").read_text() == metrics_before


def test_help_exits_0_and_names_keys_of_every_section(capsys):
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in ("run.max_steps", "batch.micro_batch_size", "precision.grad_scaler", "schedule.decay_updates", "device"):
        assert key in text


@pytest.mark.parametrize("launch", LAUNCHES)
def test_extending_a_run_applies_the_new_schedule_from_the_first_resumed_step(tmp_path, corpus, capsys, launch):
    """schedule.decay_updates = 0 ties the cosine horizon to run.max_steps: 4 steps, then extended to 8.
    The optimizer's state brings back the lr of the old horizon; step 5 must already use the new one."""
    from accumulation.schedule import lr_multiplier

    settings = {"run.eval_every": 0, "run.sample_bytes": 0, "schedule.warmup_updates": 1}
    assert train_as(launch, tiny_settings(tmp_path, corpus, **settings, **{"run.max_steps": 4}), 1, capsys)[0] == 0
    status, _, stderr = train_as(launch, tiny_settings(tmp_path, corpus, **settings, **{"run.max_steps": 8}), 1, capsys)
    assert status == 0, stderr
    lines = read_metrics(tmp_path / "runs" / "default")
    base_lr = 3e-3  # optim.lr's default
    for line in lines[4:]:
        updates_before = line["updates"] - 1
        assert line["lr"] == pytest.approx(base_lr * lr_multiplier(updates_before, "cosine", 1, 8, 0.1), rel=1e-12)
    assert lines[4]["lr"] != pytest.approx(base_lr * lr_multiplier(4, "cosine", 1, 4, 0.1), rel=1e-6)
