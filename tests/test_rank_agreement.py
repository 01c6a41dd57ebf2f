"""Ranks launched with different settings are refused before anything is written: one all-gather at start-up
compares every rank's resolved config and training data's fingerprint (accumulation/parallel/torchrun.py,
check_ranks_agree). Each case launches 2 ranks (forked with torchrun's environment, testkit/ranks.py), rank 1
with one setting changed, and expects exit 2 on both, one line naming the key and both values, and no run
directory or lock file left."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from testkit.ranks import run_main_on_ranks
from tests.test_train import REPO, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


def main_in_this_ranks_folder(argv: list[str]) -> int:
    """train.main run from the folder NODE_FOLDER_<rank> names: a relative data.source then reads that node's
    own copy of the data, as on nodes that each keep one on a local disk."""
    os.chdir(os.environ[f"NODE_FOLDER_{os.environ['RANK']}"])
    return train.main(argv)


def assert_refused_naming(results, tmp_path, named: list[str]) -> None:
    assert [status for status, _, _ in results] == [2, 2], results
    for _, _, error in results:  # every rank says it in one line: under torchrun, the first rank out ends the rest
        assert error.count("\n") == 1 and error.startswith("error: the ranks were launched with different"), error
        assert all(text in error for text in named), (named, error)
    assert not (tmp_path / "runs").exists()  # rank 0's lock (and the folders it made) undone


@pytest.mark.parametrize(
    "key, rank_0_value, rank_1_value",
    [
        ("run.seed", 1337, 7),
        ("optim.lr", 0.003, 0.01),
        ("model.dropout", 0.0, 0.1),
        ("optim.grad_clip", 1.0, 0.5),
        ("model.d_model", 16, 32),  # else DDP's own traceback about shapes
        ("batch.global_batch_size", 8, 16),  # else a hang: the ranks disagree on A
        ("run.max_steps", 4, 6),  # else "another rank stopped answering" after dist.timeout_s
        ("run.checkpoint_every", 200, 1),
    ],
)
def test_ranks_with_different_settings_are_refused(tmp_path, corpus, key, rank_0_value, rank_1_value):
    arguments = tiny_settings(tmp_path, corpus, **{"dist.timeout_s": 60})
    started = time.monotonic()
    results = run_main_on_ranks("train:main", arguments, rank_argv=[[], [f"{key}={rank_1_value}"]], timeout_s=100)
    assert_refused_naming(results, tmp_path, [f"{key} is {rank_0_value!r} on rank 0 and {rank_1_value!r} on rank 1"])
    assert time.monotonic() - started < 30  # seconds, not dist.timeout_s


def test_ranks_reading_different_data_sources_are_refused(tmp_path, corpus):
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    results = run_main_on_ranks(
        "train:main", tiny_settings(tmp_path, corpus), rank_argv=[[], [f"data.source={other}"]], timeout_s=100
    )
    assert_refused_naming(results, tmp_path, [f"data.source is '{corpus}' on rank 0 and '{other}' on rank 1"])


def test_ranks_reading_different_copies_of_the_data_are_refused(tmp_path, corpus, monkeypatch):
    """The same data.source on both ranks, a relative path to each node's own copy, one of them changed: only
    the fingerprint tells them apart."""
    for rank in range(2):
        shutil.copytree(corpus, tmp_path / f"node{rank}" / "corpus")
        monkeypatch.setenv(f"NODE_FOLDER_{rank}", str(tmp_path / f"node{rank}"))
    changed = tmp_path / "node1" / "corpus" / "doc05.txt"
    changed.write_text(changed.read_text()[::-1])  # the same bytes in another order: the same sizes, other rows
    arguments = tiny_settings(tmp_path, corpus, **{"data.source": "corpus"})
    results = run_main_on_ranks("tests.test_rank_agreement:main_in_this_ranks_folder", arguments, timeout_s=100)
    assert_refused_naming(results, tmp_path, ["the training data's fingerprint is '", "on rank 0 and '"])


def test_ranks_that_agree_but_for_their_own_keys_train(tmp_path, corpus):
    """run.out_dir is each node's own path to the shared storage: the same folder here, under two names."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "same_runs").symlink_to(tmp_path / "runs")
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 2, "run.sample_bytes": 0})
    results = run_main_on_ranks(
        "train:main", arguments, rank_argv=[[], [f"run.out_dir={tmp_path / 'same_runs'}"]], timeout_s=100
    )
    assert [status for status, _, _ in results] == [0, 0], results


@pytest.mark.integration
@pytest.mark.slow
def test_two_torchrun_nodes_with_different_config_files_are_refused(tmp_path, corpus):
    """Two torchrun agents, one rank each, as two nodes would run them: each reads config.toml from its own
    folder, and one of those files is stale (another run.seed). Both ranks exit 2 within seconds, one line each
    naming both seeds, and nothing is written. Which node becomes rank 0 is the rendezvous's choice."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    arguments = tiny_settings(tmp_path, corpus, **{"dist.timeout_s": 120})
    nodes = []
    started = time.monotonic()
    for node, seed in enumerate([1337, 99]):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        (folder / "config.toml").write_text(f"[run]\nseed = {seed}\n")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
        launcher += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=agreement"]
        command = [*launcher, str(REPO / "train.py"), "--config", "config.toml", *arguments]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        nodes.append(subprocess.Popen(command, cwd=folder, env=environment, stderr=subprocess.PIPE, text=True))
    errors = [node.communicate(timeout=120)[1] for node in nodes]
    assert all(node.returncode != 0 for node in nodes), errors
    for error in errors:
        refusal = [line for line in error.splitlines() if line.startswith("error: the ranks were launched")]
        assert len(refusal) == 1 and "run.seed is " in refusal[0], error
        assert "1337" in refusal[0] and "99" in refusal[0], error
        assert "accumulation/" not in error and 'train.py", line' not in error, error  # torchrun's own traceback only
    assert time.monotonic() - started < 90
    assert not (tmp_path / "runs").exists()
