"""Bad input of every kind (settings, data, checkpoints, metrics lines, checkpoints that differ between
ranks): one line naming what is wrong, a non-zero exit, and nothing written. Most cases call train.main in
this process (fast); a few go through the real entry point."""

import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from accumulation.config.config import load_config
from accumulation.run.sample import run_tokenizer
from testkit.ranks import run_main_on_ranks
from tests.test_checkpoints import garbage, run_in_process, snapshot
from tests.test_disrupted_runs import REPO, free_port
from tests.test_train import read_metrics, run_train, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


# ---------------------------------------------------------------------------------------------------------
# Bad input, systematically
# ---------------------------------------------------------------------------------------------------------

BAD_SETTINGS = [
    # types
    ({"run.max_steps": "abc"}, "run.max_steps"),
    ({"run.seed": "true"}, "run.seed"),
    ({"model.dropout": "yes"}, "model.dropout"),
    ({"precision.grad_scaler": 1}, "precision.grad_scaler"),
    ({"optim.lr": "nan"}, "optim.lr"),
    # zero
    ({"batch.global_batch_size": 0}, "batch.global_batch_size"),
    ({"data.seq_len": 0}, "data.seq_len"),
    ({"optim.lr": 0}, "optim.lr"),
    ({"run.checkpoint_every": 0}, "run.checkpoint_every"),
    # negative
    ({"optim.lr": -1}, "optim.lr"),
    ({"model.n_layer": -2}, "model.n_layer"),
    ({"dist.timeout_s": -5}, "dist.timeout_s"),
    # huge
    ({"run.seed": 2**70}, "run.seed"),
    ({"model.d_model": 65536}, "model.d_model"),
    ({"model.n_layer": 10**9}, "model.n_layer"),
    ({"data.seq_len": 10**9}, "data.seq_len"),
    ({"batch.global_batch_size": 10**12}, "fewer than one global batch of 1000000000000"),
    # contradictory
    ({"model.d_model": 30, "model.n_head": 4}, "model.d_model"),
    ({"batch.micro_batch_size": 16}, "batch.micro_batch_size"),
    (
        {"batch.global_batch_size": 12, "batch.micro_batch_size": 8},
        "micro_batch_size must be one of [1, 2, 3, 4, 6, 12]",
    ),
    ({"schedule.warmup_updates": 10, "schedule.decay_updates": 5}, "schedule.warmup_updates"),
    ({"device": "cuda"} if not torch.cuda.is_available() else {"device": "tpu"}, "device"),
    ({"optim.adam": 1}, "optim.adam"),
]


@pytest.mark.parametrize(
    "change, named",
    BAD_SETTINGS,
    ids=[" ".join(f"{key}={value}" for key, value in change.items()) for change, _ in BAD_SETTINGS],
)
def test_a_bad_setting_is_one_line_and_nothing_written(tmp_path, corpus, capsys, change, named):
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **change), capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key", ["run.name", "data.source"])
def test_a_setting_of_bytes_that_are_not_utf8_is_one_line_and_nothing_written(tmp_path, corpus, capsys, key):
    """A name typed with a Latin-1 byte arrives escaped (os.fsdecode of b"run\\xff"): before, an 18-line
    UnicodeEncodeError and an empty config.toml left behind. config.toml could never record the name."""
    name = os.fsdecode(b"run\xff")
    value = name if key == "run.name" else str(tmp_path / name)
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{key: value}), capsys)
    assert status == 2 and error.count("\n") == 1, error
    assert error.startswith(f"error: {key}: ") and "holds bytes that are not UTF-8" in error and "\\xff" in error
    assert not (tmp_path / "runs").exists()


def bad_data(folder: Path, kind: str) -> Path:
    """A data.source of the given kind, created under `folder`."""
    folder.mkdir()
    if kind == "empty folder":
        return folder
    if kind == "binary files only":
        (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10)
        return folder
    if kind == "invalid UTF-8 file":
        (folder / "latin1.txt").write_bytes("déjà vu, ça va".encode("latin-1"))
        return folder / "latin1.txt"
    if kind == "one byte":
        (folder / "tiny.txt").write_text("x")
        return folder
    if kind == "nanoGPT's train.bin itself":  # the folder is the data.source, not the file
        (folder / "train.bin").write_bytes(np.arange(3000, dtype="<u2").tobytes())
        return folder / "train.bin"
    if kind == "more text than memory":  # a sparse file: 2^40 bytes (1 TiB) announced, none written
        with open(folder / "huge.txt", "wb") as file:
            file.truncate(2**40)
        return folder / "huge.txt"
    assert kind == "less than one global batch"  # 3 rows of seq_len 16, global batch 8
    (folder / "short.txt").write_text("a" * 40)
    return folder


@pytest.mark.parametrize(
    "kind, named",
    [
        ("empty folder", "has no usable text"),
        ("binary files only", "has no usable text"),
        ("invalid UTF-8 file", "is not a text file"),
        ("one byte", "has no usable text"),
        (
            "nanoGPT's train.bin itself",
            "but a token file (it holds binary token ids); token files are read as their folder: set data.source=",
        ),
        ("more text than memory", "1,024.00 GiB of text, read whole, needs about 16,384.0 GiB"),
        ("less than one global batch", "the training data has 3 rows, fewer than one global batch of 8"),
    ],
)
def test_bad_data_is_one_line_and_nothing_written(tmp_path, capsys, kind, named):
    source = bad_data(tmp_path / "data", kind)
    status, _, error = run_in_process(tiny_settings(tmp_path, source, **{"data.val_fraction": 0.0}), capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    if kind == "nanoGPT's train.bin itself":
        assert error.endswith(f"set data.source={str(tmp_path / 'data')!r}\n"), error
    if kind == "more text than memory":
        assert "python scripts/operations/prepare_data.py INPUT OUT_DIR" in error
    assert not (tmp_path / "runs").exists()


def damage(payload: dict, kind: str) -> dict:
    """A checkpoint payload damaged in the given way."""
    if kind == "wrong keys":
        return {"weights": payload["model"], "step": 0}
    if kind == "not a dict":
        return [payload["model"]]
    if kind == "counters":
        return {**payload, "counters": {"steps": -1}}
    if kind == "config":
        return {**payload, "config": {**payload["config"], "optim": {**payload["config"]["optim"], "name": "adam"}}}
    if kind == "optimizer":
        return {
            **payload,
            "optimizer": {**payload["optimizer"], "param_groups": payload["optimizer"]["param_groups"][:1]},
        }
    if kind == "optimizer state shape":  # the step-0 checkpoint has no state yet: parameter 0 gets a wrong one
        moments = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        return {**payload, "optimizer": {**payload["optimizer"], "state": {0: moments}}}
    if kind == "file stamps":
        return {**payload, "data": {**payload["data"], "files": [None]}}
    if kind == "non-finite weights":
        return {**payload, "model": {**payload["model"], "lm_head.weight": torch.full((256, 16), math.nan)}}
    if kind == "infinite weights":  # inf alone, without NaN: a check for NaN only would pass it
        return {**payload, "model": {**payload["model"], "lm_head.weight": torch.full((256, 16), -math.inf)}}
    if kind == "missing parameter":
        return {**payload, "model": {key: value for key, value in payload["model"].items() if key != "lm_head.weight"}}
    if kind == "wrong shape":  # the config matches; the tensor does not
        return {**payload, "model": {**payload["model"], "lm_head.weight": torch.zeros(256, 8)}}
    if kind in ("weight fp16", "weight int64"):  # the right shape, values rounded or cut to integers
        dtype = torch.float16 if kind == "weight fp16" else torch.int64
        return {
            **payload,
            "model": {**payload["model"], "lm_head.weight": payload["model"]["lm_head.weight"].to(dtype)},
        }
    if kind == "rng size":
        return {**payload, "rng": {"per_rank": [{"cpu": torch.zeros(100, dtype=torch.uint8)}]}}
    if kind == "scheduler value":
        return {**payload, "scheduler": {**payload["scheduler"], "last_epoch": "0"}}
    if kind == "scheduler position":  # a number, but not the applied updates the counters hold
        return {**payload, "scheduler": {**payload["scheduler"], "last_epoch": 7}}
    if kind == "optimizer value":
        groups = payload["optimizer"]["param_groups"]
        return {
            **payload,
            "optimizer": {**payload["optimizer"], "param_groups": [{**groups[0], "eps": None}, groups[1]]},
        }
    if kind == "scaler value":
        scaler = {"scale": float("inf"), "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
        return {**payload, "scaler": {**scaler, "_growth_tracker": 0}}
    assert kind == "config without optim"  # config_from_dict would fill in the defaults, and compare with them
    return {**payload, "config": {key: value for key, value in payload["config"].items() if key != "optim"}}


@pytest.mark.parametrize(
    "kind, named",
    [
        ("random bytes", "cannot be read"),
        ("not a dict", "holds a list, not a checkpoint dict"),
        ("wrong keys", "lacks the keys ['model', 'optimizer'"),
        ("counters", "counters should be the non-negative integers"),
        ("config", "holds a config this program does not accept (optim.name:"),
        ("optimizer", "its optimizer has parameter groups of [7] parameters, this run's [7, 10]"),
        # was: "resuming ...", then a RuntimeError traceback at the first update
        ("optimizer state shape", "optimizer state exp_avg of parameter 0 has shape [3], its parameter [256, 16]"),
        ("file stamps", "data.files should be a list of the token files' stamps"),
        # was: every update skipped, exit 0
        ("non-finite weights", "the weights lm_head.weight hold NaN or inf"),
        ("infinite weights", "the weights lm_head.weight hold NaN or inf"),
        ("missing parameter", "its model does not fit the configured model: missing lm_head.weight"),
        ("wrong shape", "lm_head.weight has shape [256, 8], the configured model [256, 16]"),
        # was: each accepted, exit 0 (the weights silently rounded, or the stored config's defaults compared)
        ("weight fp16", "lm_head.weight is stored as torch.float16, the configured model's is torch.float32"),
        ("weight int64", "lm_head.weight is stored as torch.int64, the configured model's is torch.float32"),
        ("config without optim", "its config lacks optim.name, optim.lr, optim.weight_decay and 2 more"),
        # was: a traceback after "resuming from"
        ("rng size", "the random-number-generator state of rank 0 has 100 bytes, a CPU generator's 5056"),
        # was: a line naming neither the file nor what to do
        ("scheduler value", "its scheduler state's last_epoch is the text '0', expected a number"),
        ("scheduler position", "its scheduler is at 7 applied updates, its counters at 0"),
        ("optimizer value", "its optimizer state's param_groups[0].eps is None, expected a number"),
        ("scaler value", "its GradScaler state's scale is inf, expected a finite number above 0"),
    ],
)
def test_a_damaged_checkpoint_is_one_line_and_the_run_directory_untouched(tmp_path, capsys, started_run, kind, named):
    arguments, run_dir = started_run
    checkpoints = run_dir / "checkpoints"
    payload = torch.load(checkpoints / "latest.pt", weights_only=True)
    for path in checkpoints.iterdir():  # no older checkpoint to fall back on
        path.unlink()
    if kind == "random bytes":
        (checkpoints / "latest.pt").write_bytes(garbage(3000))
    else:
        torch.save(damage(payload, kind), checkpoints / "latest.pt")
    before = snapshot(run_dir)
    status, output, error = run_in_process(arguments, capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    assert f"checkpoint {checkpoints / 'latest.pt'}" in error, error
    assert "resuming" not in output  # every check comes before "resuming from"
    assert snapshot(run_dir) == before


def at_most_3_gib() -> None:
    """A child's address space capped at 3 GiB (the tiny run needs under 2): a reader of /dev/zero then fails
    in the child instead of filling the shared machine's memory until the kernel kills some process."""
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.parametrize(
    "name, kind, named",
    [
        ("latest.pt", "named pipe", "is a named pipe (FIFO), not a file this program wrote"),  # was: no output, forever
        # was: memory filled until the kernel killed the job
        ("latest.pt", "link to /dev/zero", "is a symbolic link to /dev/zero, which is a character device, not a"),
        ("step_000000.pt", "directory", "is a directory, not a file this program wrote"),  # was: resumed from latest.pt
        # refused before, by the run directory's own check (accumulation/run/run_dir.py)
        ("latest.pt", "directory", "is a folder, where this program keeps the newest checkpoint"),
    ],
)
def test_a_checkpoint_name_that_is_not_a_regular_file_is_refused_before_it_is_read(started_run, name, kind, named):
    """Through the real entry point, with a timeout: a run that hangs on a FIFO fails the test, not the suite."""
    arguments, run_dir = started_run
    path = run_dir / "checkpoints" / name
    path.unlink()  # the other checkpoint name stays: a regular file to resume from
    if kind == "named pipe":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    names_before, files_before = sorted(run_dir.rglob("*")), snapshot(run_dir)  # snapshot opens regular files only
    completed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        preexec_fn=at_most_3_gib,
    )
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.startswith("error: ") and completed.stderr.count("\n") == 1, completed.stderr
    assert f"{path} {named}" in completed.stderr, completed.stderr
    assert "resuming" not in completed.stdout
    assert sorted(run_dir.rglob("*")) == names_before and snapshot(run_dir) == files_before


def test_a_checkpoint_whose_optimizer_lost_its_moments_is_refused(tmp_path, corpus, capsys):
    """After 2 applied updates AdamW holds two moments per parameter. A checkpoint whose optimizer state is
    empty (the moments would restart from zero, exit 0 before), or holds a moment without its partner, or a
    moment stored in fp16 (rounded when loaded back into fp32): one line each, before "resuming"."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 2, "run.sample_bytes": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    latest = tmp_path / "runs" / "default" / "checkpoints" / "latest.pt"
    payload = torch.load(latest, weights_only=True)
    for path in latest.parent.iterdir():
        path.unlink()
    state = payload["optimizer"]["state"]
    damaged = [
        ({}, "its optimizer state is empty after 2 applied updates: AdamW's moments would restart from zero"),
        ({**state, 3: {"step": state[3]["step"], "exp_avg": state[3]["exp_avg"]}}, "parameter 3 lacks exp_avg_sq"),
        (
            {**state, 0: {**state[0], "exp_avg": state[0]["exp_avg"].half()}},
            "optimizer state exp_avg of parameter 0 is stored as torch.float16, its parameter's torch.float32",
        ),
        # was: a line naming no file, quoting a "<generator object ...>"
        ({**state, 2: {**state[2], "step": "x"}}, "optimizer state step of parameter 2 is 'x', not a count of updates"),
        ({**state, 2: {**state[2], "step": torch.tensor(-1.0)}}, "optimizer state step of parameter 2 is -1.0"),
        ({**state, 1: {**state[1], "exp_avg": "x"}}, "optimizer state exp_avg of parameter 1 is 'x', not a tensor"),
    ]
    for optimizer_state, named in damaged:
        torch.save({**payload, "optimizer": {**payload["optimizer"], "state": optimizer_state}}, latest)
        status, output, error = run_in_process(arguments + ["run.max_steps=3"], capsys)
        assert status == 2 and error.count("\n") == 1 and named in error, error
        assert f"checkpoint {latest}" in error and "resuming" not in output


def test_a_checkpoint_after_one_update_is_checked_like_any_other(tmp_path, corpus, capsys):
    """After a single applied update: an emptied optimizer state (AdamW's moments would restart from zero) and
    a scheduler left behind the counters (the learning rate of step 1 again) are each one line, before
    "resuming"."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 1, "run.sample_bytes": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    latest = tmp_path / "runs" / "default" / "checkpoints" / "latest.pt"
    payload = torch.load(latest, weights_only=True)
    assert payload["counters"]["updates"] == 1
    for path in latest.parent.iterdir():
        path.unlink()
    damaged = [
        (
            {**payload, "optimizer": {**payload["optimizer"], "state": {}}},
            "its optimizer state is empty after 1 applied updates",
        ),
        (
            {**payload, "scheduler": {**payload["scheduler"], "last_epoch": 0}},
            "its scheduler is at 0 applied updates, its counters at 1",
        ),
    ]
    for damaged_payload, named in damaged:
        torch.save(damaged_payload, latest)
        status, output, error = run_in_process(arguments + ["run.max_steps=2"], capsys)
        assert status == 2 and error.count("\n") == 1 and named in error, error
        assert f"checkpoint {latest}" in error and "resuming" not in output


@pytest.mark.parametrize(
    "line, named",
    [
        ('{"steps": 1, "loss": 5.2\n', "line 1 is not JSON"),
        ('{"loss": 5.2}\n', 'line 1 is not an object with "steps"'),
        # was: both lines kept by the resume, the file no longer one line per step
        ('{"steps": 1}\n{"steps": 1}\n', "line 2 is of step 1, after line 1 of step 1"),
    ],
    ids=["not-json", "no-steps", "repeated-step"],
)
def test_a_damaged_metrics_line_is_one_line_and_the_run_directory_untouched(tmp_path, capsys, started_run, line, named):
    """A complete line of metrics.jsonl that is not a record (a half last line is what a kill leaves, and is
    dropped): the resume cannot tell its step, so it says which line and stops, before anything is written.
    It was a JSONDecodeError or KeyError traceback on every retry."""
    arguments, run_dir = started_run
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write(line)
    before = snapshot(run_dir)
    status, output, error = run_in_process(arguments + ["run.max_steps=1"], capsys)
    assert status == 2
    assert error.startswith(f"error: {run_dir / 'metrics.jsonl'} {named}") and error.count("\n") == 1, error
    assert "resuming" not in output  # was printed before the refusal
    assert "repair or delete that line" in error
    assert snapshot(run_dir) == before


def test_documented_fallbacks_train_instead_of_failing(tmp_path, capsys, started_run):
    """Input that is odd but has a documented meaning: a folder with binary files among the text (they are
    skipped and counted), a corpus smaller than one global batch with batch.tail = "partial" (every step
    is one partial batch), and a GradScaler switched on when resuming a run that had none (it starts afresh)."""
    arguments, _ = started_run
    status, _, error = run_in_process(arguments + ["run.max_steps=1", "precision.grad_scaler=true"], capsys)
    assert status == 0, error

    source = bad_data(tmp_path / "data", "less than one global batch")
    (source / "image.png").write_bytes(b"\x00\x01\x02" * 100)
    small = tiny_settings(
        tmp_path, source, **{"data.val_fraction": 0.0, "batch.tail": "partial", "run.max_steps": 1, "run.name": "small"}
    )
    status, output, error = run_in_process(small, capsys)
    assert status == 0, error
    assert "(1 non-text skipped)" in output
    assert read_metrics(tmp_path / "runs" / "small")[0]["examples"] == 3


@pytest.mark.parametrize("launched", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_bad_input_through_the_real_entry_point(tmp_path, corpus, launched):
    """The exit status and stderr a shell sees: exit 2, one line, no traceback, for a checkpoint of random
    bytes and for a data file that is not UTF-8. In a process forked as `python train.py` (testkit/ranks.py:
    train.main, then run_and_exit's exit), or launched as one."""
    settings = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    checkpoints = tmp_path / "runs" / "default" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest.pt").write_bytes(garbage(3000))
    source = bad_data(tmp_path / "data", "invalid UTF-8 file")
    for arguments, named in [
        (settings, "latest.pt cannot be read"),
        (settings + [f"data.source={source}"], "is not a text file"),
    ]:
        if launched:
            completed = run_train(arguments)
            status, stderr = completed.returncode, completed.stderr
        else:
            [(status, _, stderr)] = run_main_on_ranks("train:main", arguments, world_size=1)
        assert status == 2
        assert stderr.count("\n") == 1 and named in stderr and "Traceback" not in stderr, stderr


def test_ranks_that_see_different_checkpoints_are_refused_on_forked_ranks(tmp_path, corpus, capsys):
    """As below, on 2 ranks forked with torchrun's environment (testkit/ranks.py) instead of 2 interpreters."""
    shared = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(shared, capsys)[0] == 0
    out_dirs = [[f"run.out_dir={tmp_path / 'runs'}"], [f"run.out_dir={tmp_path / 'other_node_runs'}"]]
    results = run_main_on_ranks("train:main", [*shared, "run.max_steps=2"], world_size=2, rank_argv=out_dirs)
    assert [status for status, _, _ in results] == [2, 2], results
    error = results[0][2]
    assert error.count("\n") == 1 and "rank 0 step 0, rank 1 none" in error and "every node shares" in error, error
    assert not (tmp_path / "other_node_runs").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_are_refused(tmp_path, corpus, capsys):
    """Two nodes without a shared run.out_dir: rank 0 finds the checkpoint, rank 1 (another folder here)
    finds none. Both are started by hand, as a launcher without torchrun's agent would (rank 0 hosts the
    store); both exit 2 and rank 0 says which rank saw what."""
    shared = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    assert run_in_process(shared, capsys)[0] == 0
    port = free_port()
    ranks = []
    for rank, out_dir in [(0, tmp_path / "runs"), (1, tmp_path / "other_node_runs")]:
        environment = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        command = [sys.executable, str(REPO / "train.py"), *shared, "run.max_steps=2", f"run.out_dir={out_dir}"]
        ranks.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=REPO
            )
        )
    deadline = time.monotonic() + 240  # a hang's bound; wide for the pytest-xdist worker running beside them
    results = []
    for process in ranks:
        try:
            results.append(process.communicate(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for each in ranks:
                each.kill()
            pytest.fail("the ranks did not finish in time (a hang?)")
    assert [process.returncode for process in ranks] == [2, 2], results
    error = results[0][1]
    assert error.count("\n") == 1 and "rank 0 step 0, rank 1 none" in error and "every node shares" in error, error
    assert not (tmp_path / "other_node_runs").exists()


LAUNCH = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "environment, named",
    [
        # set by hand without torchrun: the batch was checked for 2 ranks, then 1 trained
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not set, though WORLD_SIZE='2' is; torchrun sets"),
        ({**LAUNCH, "RANK": "abc"}, "RANK='abc' is not a non-negative integer"),  # was a ValueError traceback
        ({**LAUNCH, "MASTER_ADDR": ""}, "MASTER_ADDR not set, though RANK='0', WORLD_SIZE='2', MASTER_PORT"),
        ({**LAUNCH, "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({**LAUNCH, "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a non-negative integer"),
    ],
    ids=["world-size-alone", "rank-abc", "no-master-addr", "rank-too-large", "negative-local-rank"],
)
def test_half_a_launch_environment_is_one_line_and_nothing_written(
    tmp_path, corpus, capsys, monkeypatch, environment, named
):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"run.max_steps": 1}), capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    assert "torchrun --standalone --nproc_per_node=N train.py" in error
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_while_torch_is_imported_is_one_line_and_exit_130():
    """The first seconds of every start are `import torch`; a Ctrl-C there printed a KeyboardInterrupt traceback
    from inside torch. The signal is sent once torch's library is mapped, so it lands inside the import."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "--help"], stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    maps = Path(f"/proc/{process.pid}/maps")
    deadline = time.monotonic() + 60
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, error = process.communicate(timeout=60)
    assert process.returncode == 130
    assert error == "interrupted (Ctrl-C) while starting, before anything was written\n", error


def test_a_micro_batch_too_large_for_memory_is_refused_before_anything_is_written(tmp_path, capsys):
    """2,048 rows of 1,024 tokens in one micro-batch with a 50,304-token output: the logits alone are 422 GB.
    The first forward ended in the allocator's traceback after the step-0 checkpoint was written (without a
    ulimit the kernel's OOM killer ends such a run silently). Refused at start-up now, from a lower bound
    of the activations, the way the model's own size is."""
    folder = tmp_path / "tokens"
    folder.mkdir()
    (folder / "train.bin").write_bytes((np.arange(2048 * 1024 + 1) % 64).astype("<u2").tobytes())
    (folder / "meta.json").write_text('{"vocab_size": 64}')
    huge = {"data.seq_len": 1024, "batch.global_batch_size": 2048, "batch.micro_batch_size": 2048}
    settings = tiny_settings(tmp_path, folder, **{**huge, "model.vocab_size": 50304, "data.val_fraction": 0.0})
    status, _, error = run_in_process(settings, capsys)
    assert status == 2
    assert error.startswith("error: batch.micro_batch_size: a micro-batch of 2048 rows of 1024 tokens keeps at least")
    assert error.count("\n") == 1 and "choose a smaller batch.micro_batch_size" in error, error
    assert not (tmp_path / "runs").exists()


def test_a_data_source_and_tokenizer_under_the_home_directory_are_found(tmp_path, corpus, capsys, monkeypatch):
    """`~` in data.source and data.tokenizer is the home directory, as in run.out_dir and in a shell."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(corpus, tmp_path / "corpus")
    status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"data.source": "~/corpus"}), capsys)
    assert status == 0, error
    tokenizers = pytest.importorskip("tokenizers")
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    word_level.save(str(tmp_path / "tokenizer.json"))
    tokenizer, _ = run_tokenizer(load_config(["data.tokenizer=~/tokenizer.json"]))
    assert tokenizer.decode([0]) == "a"
