"""Reliability: killed and hanging ranks, damaged and foreign checkpoints, non-finite steps, a changed number
of ranks, two torchrun agents, and bad input of every kind.

Runs that must be disrupted go through tests/faulty_train.py: train.py itself, with a SIGKILL or a stall
injected at a chosen point of a chosen torchrun attempt. Most bad-input cases call train.main in this
process (fast); a few go through the real entry point. Every launch has a time limit.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from accumulation.config import load_config
from accumulation.distributed import DistributedContext
from accumulation.resume import restore_rng_states, seed_dropout
from accumulation.run_dir import LOCK_FILE
from testkit.disk import fill_disk, small_disk
from tests.test_logs import assert_tensorboard_matches_metrics
from tests.test_train import comparable, final_weights, read_metrics, run_train, tiny_settings, uneven_corpus

REPO = Path(__file__).resolve().parent.parent

# The run every disrupted 2-rank run must reproduce: six steps, a checkpoint every two (all four kept), a
# cosine horizon that does not move when a shorter session stops early, and no dropout (a change in the
# number of ranks reseeds the dropout streams, see train.restore_rng_states).
SETTINGS = {
    "run.max_steps": 6,
    "run.checkpoint_every": 2,
    "run.keep_checkpoints": 4,
    "schedule.decay_updates": 6,
    "run.sample_bytes": 0,
    "model.dropout": 0.0,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    """The run directory of SETTINGS run straight through on 2 ranks (torchrun --standalone)."""
    out = tmp_path_factory.mktemp("reference")
    completed = run_train(tiny_settings(out, corpus, **SETTINGS), ranks=2)
    assert completed.returncode == 0, completed.stderr
    return out / "runs" / "default"


# ---------------------------------------------------------------------------------------------------------
# Launching torchrun with a time limit
# ---------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_torchrun(
    launcher_options: list[str], program: list[str], arguments: list[str], faults=(), fault_log=None
) -> subprocess.Popen:
    """torchrun in the background, stdout and stderr together. `program` is ["train.py"] or, with faults,
    ["-m", "tests.faulty_train"]."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "ACCUMULATION_FAULTS": json.dumps(list(faults))}
    if fault_log is not None:
        environment["ACCUMULATION_FAULT_LOG"] = str(fault_log)
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_options, *program, *arguments]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, cwd=REPO
    )


def finish(process: subprocess.Popen, deadline: float) -> tuple[int, str]:
    """Exit status and output of a torchrun started by start_torchrun, by time.monotonic() `deadline`. A
    job still running then is a hang: torchrun's agent gets SIGTERM, which it passes on to its workers
    (they run in sessions of their own, out of reach of a signal to the agent's group)."""
    try:
        output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in time (a hang?); its output:\n{output[-4000:]}")
    return process.returncode, output


def read_fault_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Bit-identical weights, counters and metrics lines (timings aside)."""
    weights, expected = final_weights(run_dir), final_weights(reference)
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key
    latest = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert latest["counters"] == torch.load(reference / "checkpoints" / "latest.pt", weights_only=True)["counters"]
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(reference))


# ---------------------------------------------------------------------------------------------------------
# Faults under torchrun
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_killed_ranks_are_restarted_and_the_run_ends_bit_identical(tmp_path, corpus, reference):
    """One job, three SIGKILLs on three attempts, each followed by torchrun's restart of all workers:
    rank 0 while writing the step-0 checkpoint (nothing to resume yet), rank 1 in the middle of step 3's
    accumulation group (resume from step 2), rank 0 while writing the step-4 checkpoint (resume from step
    2 again, discarding the metrics lines of steps 3 and 4 that the killed attempt wrote)."""
    faults = [
        {"attempt": 0, "rank": 0, "kill_before_rename": 0},
        {"attempt": 1, "rank": 1, "kill_before_micro_batch": [3, 1]},
        {"attempt": 2, "rank": 0, "kill_before_rename": 4},
    ]
    fault_log = tmp_path / "faults.jsonl"
    job = start_torchrun(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=3"],
        ["-m", "tests.faulty_train"],
        tiny_settings(tmp_path, corpus, **SETTINGS),
        faults,
        fault_log,
    )
    status, output = finish(job, time.monotonic() + 240)
    assert status == 0, output[-4000:]

    fired = read_fault_log(fault_log)
    assert [{key: entry[key] for key in fault} for entry, fault in zip(fired, faults, strict=True)] == faults and len(
        fired
    ) == 3
    # The saves were killed with their temporary file complete on disk and not yet renamed into place.
    assert fired[0]["unpublished"] == ".step_000000.pt.tmp" and fired[0]["unpublished_bytes"] > 0
    assert fired[2]["unpublished"] == ".step_000004.pt.tmp" and fired[2]["unpublished_bytes"] > 0
    assert output.count("resuming from") == 2  # attempts 2 and 3; attempt 1 had nothing to resume
    run_dir = tmp_path / "runs" / "default"
    assert_same_run(run_dir, reference)
    assert_tensorboard_matches_metrics(run_dir)  # one point per step on each axis, despite the repeated steps
    assert not [path.name for path in (run_dir / "checkpoints").iterdir() if path.name.startswith(".")]


@pytest.mark.slow
def test_a_hanging_rank_makes_the_others_fail_within_the_timeout(tmp_path, corpus):
    """Rank 1 stalls before step 2; rank 0 waits in step 2's first collective for dist.timeout_s = 5 s, then
    says so in one line and exits non-zero, and torchrun ends the job. (train.py would take the agent's
    SIGTERM as a request to stop at a step boundary the stalled rank never reaches, so the agent would
    SIGKILL it 30 s later; the injected stall keeps SIGTERM's default action to spare the test that wait.)"""
    fault_log = tmp_path / "faults.jsonl"
    started = time.monotonic()
    job = start_torchrun(
        ["--standalone", "--nproc_per_node=2"],
        ["-m", "tests.faulty_train"],
        tiny_settings(tmp_path, corpus, **{"dist.timeout_s": 5, "run.sample_bytes": 0}),
        [{"attempt": 0, "rank": 1, "hang_at_step": 2}],
        fault_log,
    )
    status, output = finish(job, started + 150)
    assert [
        {key: entry[key] for key in ("attempt", "rank", "hang_at_step")} for entry in read_fault_log(fault_log)
    ] == [{"attempt": 0, "rank": 1, "hang_at_step": 2}]
    assert status != 0
    assert "error: rank 0: another rank stopped answering, so a collective failed (Timed out" in output
    assert "dist.timeout_s=5 s" in output
    assert "step 2/" not in output  # rank 0 never finished step 2
    assert time.monotonic() - started < 60  # start-up and 5 s of waiting; not a hang


# ---------------------------------------------------------------------------------------------------------
# Preemption, fail-fast and a full disk under torchrun
# ---------------------------------------------------------------------------------------------------------


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_stops_both_at_one_step_and_max_restarts_resumes(tmp_path, corpus, reference):
    """SIGUSR1 reaches rank 1 only, during step 3: that step's boundary carries the flag through its loss
    all-reduce, both ranks take part in the step-3 checkpoint and exit 143; torchrun counts
    that as a failure and restarts both, which resume at step 3 and end with the reference's bits."""
    fault_log = tmp_path / "faults.jsonl"
    job = start_torchrun(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
        ["-m", "tests.faulty_train"],
        tiny_settings(tmp_path, corpus, **SETTINGS),
        [{"attempt": 0, "rank": 1, "signal_before_micro_batch": [3, 1, "SIGUSR1", "self"]}],
        fault_log,
    )
    status, output = finish(job, time.monotonic() + 240)
    assert status == 0, output[-4000:]
    assert len(read_fault_log(fault_log)) == 1
    assert "stopped at step 3: another rank got a stop signal; checkpoint written; exit status 143" in output
    assert output.count("resuming from") == 1 and "at step 3" in output
    run_dir = tmp_path / "runs" / "default"
    assert "step_000003.pt" in checkpoint_names(run_dir)  # the stop's own checkpoint, off the 2-step cadence
    assert_same_run(run_dir, reference)


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_agent_checkpoints_within_its_grace_and_a_new_launch_resumes(
    tmp_path, corpus, reference, signal_name
):
    """SIGTERM to torchrun's agent (what SLURM or Kubernetes sends), during step 3: the agent passes it on to
    both workers and waits --shutdown-timeout (30 s) before SIGKILL; the workers finish step 3, write
    the step-3 checkpoint and exit well inside it. The agent then exits 1 (it re-raises the signal as an
    error and never restarts workers after its own signal), and a second launch, as a requeued job, resumes.
    SIGUSR1 takes the same path when the agent is told to handle it (--signals-to-handle); with SIGTERM, a
    second SIGTERM reaches rank 0 in the middle of writing the step-3 checkpoint and changes nothing."""
    fault_log = tmp_path / "faults.jsonl"
    arguments = tiny_settings(tmp_path, corpus, **SETTINGS)
    faults = [{"attempt": 0, "rank": 0, "signal_before_micro_batch": [3, 1, signal_name, "agent"]}]
    launcher = ["--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    if signal_name == "SIGUSR1":
        launcher.append("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    else:
        faults.append({"attempt": 0, "rank": 0, "signal_during_save": [3, "SIGTERM"]})
    job = start_torchrun(launcher, ["-m", "tests.faulty_train"], arguments, faults, fault_log)
    status, output = finish(job, time.monotonic() + 240)
    fired = read_fault_log(fault_log)
    signal_to_exit_s = time.time() - fired[0]["unix_time"]
    assert status == 1 and len(fired) == len(faults), output[-4000:]
    assert f"stopped at step 3: {signal_name} received; checkpoint written" in output
    assert "Unable to shutdown process" not in output  # no worker needed the agent's SIGKILL
    assert signal_to_exit_s < 30
    run_dir = tmp_path / "runs" / "default"
    assert checkpoint_names(run_dir)[-1] == "step_000003.pt"  # no temporary file after the second signal
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2, 3]

    completed = run_train(arguments, ranks=2)
    assert completed.returncode == 0, completed.stderr
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_within_seconds(tmp_path, corpus):
    """Fail fast: rank 1 raises (a bug) before step 2. It prints its traceback and leaves without tearing
    down the process group; rank 0's next collective fails at once and torchrun ends the job."""
    fault_log = tmp_path / "faults.jsonl"
    job = start_torchrun(
        ["--standalone", "--nproc_per_node=2"],
        ["-m", "tests.faulty_train"],
        tiny_settings(tmp_path, corpus, **{**SETTINGS, "dist.timeout_s": 300}),
        [{"attempt": 0, "rank": 1, "raise_at_step": 2}],
        fault_log,
    )
    status, output = finish(job, time.monotonic() + 120)
    [fired] = read_fault_log(fault_log)
    assert status != 0
    assert "RuntimeError: injected failure at step 2" in output and output.count("Traceback") >= 1
    assert "step 2/" not in output  # rank 0 never finished step 2
    assert time.time() - fired["unix_time"] < 30  # not dist.timeout_s (300 s)


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_loses_nothing_and_resumes(tmp_path, corpus, reference):
    """A real full disk (a tmpfs) under 2 ranks: the step-4 save fails. One line names the file, the space
    needed and free, and that the disk is full; the temporary file is gone; the older checkpoints and the
    metrics lines are intact; every rank is out within seconds. With space freed, a restart resumes from
    the step-2 checkpoint and ends with the reference's bits."""
    with small_disk(tmp_path / "disk", 4 * 2**20) as disk:
        arguments = tiny_settings(disk, corpus, **SETTINGS)
        first = run_train(tiny_settings(disk, corpus, **{**SETTINGS, "run.max_steps": 2}), ranks=2)
        assert first.returncode == 0, first.stderr
        run_dir = disk / "runs" / "default"
        checkpoints = run_dir / "checkpoints"
        before = {name: (checkpoints / name).read_bytes() for name in checkpoint_names(run_dir)}
        checkpoint_bytes = len(before["step_000002.pt"])
        filler = fill_disk(disk, leave_free_bytes=checkpoint_bytes // 2)  # room for metrics lines, not a checkpoint

        started = time.monotonic()
        full = run_train(arguments, ranks=2)
        exit_s = time.monotonic() - started
        assert full.returncode == 1, full.stderr[-3000:]
        [line] = [line for line in full.stderr.splitlines() if line.startswith("error: checkpoint")]
        assert f"{checkpoints / 'step_000004.pt'} could not be written: the disk is full (it needs about" in line
        assert "MB free" in line and "the newest complete checkpoint is step_000002.pt" in line
        # No traceback of ours (torchrun's agent prints its own ChildFailedError summary after any failure).
        assert 'train.py", line' not in full.stderr and "OSError" not in full.stderr
        assert exit_s < 60  # start-up, two steps, and seconds to end both ranks
        assert checkpoint_names(run_dir) == sorted(before)  # no temporary file left behind
        assert {name: (checkpoints / name).read_bytes() for name in before} == before
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [json.loads(line)["steps"] for line in text.splitlines()] == [1, 2, 3, 4]

        filler.unlink()
        resumed = run_train(arguments, ranks=2)
        assert resumed.returncode == 0, resumed.stderr
        assert "at step 2" in resumed.stdout
        assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_a_short_chaos_soak_ends_bit_identical():
    """scripts/checks/chaos_soak.py with 3 random faults (a SIGKILLed rank, SIGTERM to the agent or a kill during a
    save, at random moments) on 50 steps: the weights, counters, metrics and TensorBoard points equal the
    uninterrupted run's. About a minute on the 2-core test machine: torchrun starts several times."""
    completed = subprocess.run(
        [sys.executable, "scripts/checks/chaos_soak.py", "--steps", "50", "--faults", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(completed.stdout)
    assert report["pass"] and report["faults_injected"] >= 3 and report["same_weights"]


# ---------------------------------------------------------------------------------------------------------
# Multi-node: two torchrun agents meeting through the c10d rendezvous
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_agents_with_c10d_rendezvous_equal_one_standalone_agent(tmp_path, corpus, reference):
    """--nnodes=2 --nproc_per_node=1 on this machine, as on two nodes: the same 2 ranks, the same data per
    rank and the same gloo reduction of two terms (a + b == b + a exactly), so the same bits."""
    options = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--rdzv_id=reliability",
    ]
    arguments = tiny_settings(tmp_path, corpus, **SETTINGS)  # one run directory: "storage both nodes share"
    deadline = time.monotonic() + 150
    agents = [start_torchrun(options, ["train.py"], arguments) for _ in range(2)]
    results = [finish(agent, deadline) for agent in agents]
    for status, output in results:
        assert status == 0, output[-4000:]
    assert_same_run(tmp_path / "runs" / "default", reference)


# ---------------------------------------------------------------------------------------------------------
# Resume on a different number of ranks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_on_1_then_2_ranks_follows_the_2_rank_run(tmp_path, corpus, reference):
    """2 ranks for steps 1-2, 1 rank (A = 4) for steps 3-4, 2 ranks (A = 2) for steps 5-6, against the
    uninterrupted 2-rank run. The first segment is the reference's own: its step-2 checkpoint is what a
    2-rank run stopped at step 2 leaves (test_train proves stopping and resuming exact)."""
    run_dir = tmp_path / "runs" / "default"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copyfile(reference / "checkpoints" / "step_000002.pt", run_dir / "checkpoints" / "latest.pt")
    shutil.copyfile(reference / "metrics.jsonl", run_dir / "metrics.jsonl")  # the resume keeps steps 1-2 only
    for ranks, max_steps in [(1, 4), (2, 6)]:
        completed = run_train(tiny_settings(tmp_path, corpus, **{**SETTINGS, "run.max_steps": max_steps}), ranks=ranks)
        assert completed.returncode == 0, completed.stderr
        assert f"micro 2 x accum {4 // ranks} x ranks {ranks}" in completed.stdout

    # Which examples each step saw is unchanged, so every counter but the per-rank micro-batch count is
    # exact; so is the learning rate, a function of the applied updates.
    metrics, expected = read_metrics(run_dir), read_metrics(reference)
    assert [line["micro_batches"] for line in metrics] == [2, 4, 8, 12, 14, 16]  # A = 2, 2, 4, 4, 2, 2
    for line, expected_line in zip(metrics, expected, strict=True):
        for key in ("steps", "updates", "skipped", "examples", "tokens", "lr"):
            assert line[key] == expected_line[key], (line["steps"], key)
        assert line["loss"] == pytest.approx(expected_line["loss"], rel=1e-6)  # measured: no difference at all
    # Only the order of additions differs: on 1 rank the four micro-batch gradients are summed in .grad,
    # on 2 ranks two per rank and then the all-reduce adds the two. fp32 sums of the same terms in another
    # order differ by a few ulps, and AdamW carries that into the weights; most where a gradient is nothing
    # but rounding noise (the attention's key bias, which softmax ignores), which AdamW scales up to a
    # full step. Measured: at most 2e-5 of a tensor's largest update. A resume that shrinks AdamW's
    # momentum by only 0.1% moves the weights by 7e-4 of it (and the loss by 4e-6, relative).
    weights, expected_weights = final_weights(run_dir), final_weights(reference)
    initial = torch.load(reference / "checkpoints" / "step_000000.pt", weights_only=True)["model"]
    for key, value in expected_weights.items():
        tolerance = 1e-4 * (value - initial[key]).abs().max().item() + 1e-8
        assert (weights[key] - value).abs().max().item() <= tolerance, key


def test_a_number_of_ranks_that_cannot_hold_the_global_batch_is_refused(tmp_path, corpus, capsys, monkeypatch):
    """G = 8 with m = 4 ran on 2 ranks (A = 1); on 4 ranks each rank has 2 examples, which m = 4 cannot
    split, and on 3 ranks G itself does not divide. Checked before any process group or file exists."""
    monkeypatch.setenv("RANK", "0")
    for ranks, named in [(4, "micro_batch_size must be one of [1, 2]"), (3, "multiple of 3 (e.g. 6 or 9)")]:
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"batch.micro_batch_size": 4}), capsys)
        assert status == 2 and named in error and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------


def run_in_process(arguments: list[str], capsys) -> tuple[int, str, str]:
    status = train.main(arguments)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_resume_payload_is_freed_once_loaded(tmp_path, corpus, capsys, monkeypatch):
    """The checkpoint read for a resume (the whole model and optimizer state in host memory) is emptied
    once its state has been loaded, instead of being held for the rest of the run."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.sample_bytes": 0, "run.max_steps": 2})
    assert run_in_process(arguments, capsys)[0] == 0
    payloads = []
    real_find_resume_point = train.find_resume_point

    def keep_a_reference(*args, **kwargs):
        payloads.append(real_find_resume_point(*args, **kwargs))
        return payloads[-1]

    monkeypatch.setattr(train, "find_resume_point", keep_a_reference)
    status, out, _ = run_in_process(arguments + ["run.max_steps=3"], capsys)  # the last value of a key wins
    assert status == 0 and "at step 2" in out
    assert payloads == [{}]


def test_each_rank_continues_its_own_dropout_stream_after_a_resume():
    """The restore half of a 2-rank resume, without launching ranks (the slow torchrun tests run it whole):
    the checkpoint holds one generator state per rank, and rank r must continue stream r. Rank 1 handed
    rank 0's state would draw rank 0's dropout masks: a run that still trains, and no longer the run."""
    config = load_config([])
    saved, expected = {"per_rank": []}, []
    for rank in range(2):  # each rank's stream some draws in, as at a checkpoint
        seed_dropout(config.run.seed, rank)
        torch.rand(7)
        saved["per_rank"].append({"cpu": torch.get_rng_state()})
        expected.append(torch.rand(5))
    assert not torch.equal(expected[0], expected[1])
    for rank in range(2):
        torch.manual_seed(12345)  # whatever the new process drew before the resume
        restore_rng_states(saved, DistributedContext(rank, rank, 2, torch.device("cpu"), "gloo"), config, steps=3)
        assert torch.equal(torch.rand(5), expected[rank]), rank


def garbage(size_bytes: int) -> bytes:
    """Reproducible random bytes behind a pickle header (protocol 33): the unpickler gets far enough to warn
    about the protocol before it fails, and that warning must not reach the user's terminal."""
    generator = torch.Generator().manual_seed(size_bytes)
    return bytes([0x80, 33]) + bytes(
        torch.randint(0, 256, (size_bytes,), generator=generator, dtype=torch.uint8).tolist()
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock file's: each job that takes the lock writes its own pid there."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def test_the_newest_k_checkpoints_are_kept_and_damaged_ones_are_passed_over(tmp_path, corpus, capsys):
    """keep_checkpoints = 2 keeps step files 3 and 4. Then latest.pt is truncated, step_000004.pt holds
    random bytes and metrics.jsonl ends in half a line, as after a crash: the resume warns about both
    files, continues from step 3 and ends with the same bits and the same metrics as before."""
    arguments = tiny_settings(
        tmp_path, corpus, **{"run.checkpoint_every": 1, "run.keep_checkpoints": 2, "run.sample_bytes": 0}
    )
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest.pt", "step_000003.pt", "step_000004.pt"]
    weights_before, metrics_before = final_weights(run_dir), read_metrics(run_dir)

    latest_bytes = (checkpoints / "latest.pt").read_bytes()
    (checkpoints / "latest.pt").unlink()  # a new file: latest.pt may be a hard link to step_000004.pt
    (checkpoints / "latest.pt").write_bytes(latest_bytes[: len(latest_bytes) // 2])
    (checkpoints / "step_000004.pt").write_bytes(garbage(5000))
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"micro_batches": 20, "ste')

    status, output, error = run_in_process(arguments, capsys)
    assert status == 0, error
    assert f"warning: checkpoint {checkpoints / 'latest.pt'} cannot be read" in error  # warnings: stderr
    assert f"warning: checkpoint {checkpoints / 'step_000004.pt'} cannot be read" in error
    assert "warning" not in output
    assert f"resuming from {checkpoints / 'step_000003.pt'} at step 3" in output
    for key, value in weights_before.items():
        assert torch.equal(final_weights(run_dir)[key], value), key
    assert comparable(read_metrics(run_dir)) == comparable(metrics_before)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest.pt", "step_000003.pt", "step_000004.pt"]


@pytest.fixture
def started_run(tmp_path, corpus, capsys) -> tuple[list[str], Path]:
    """A run directory holding the step-0 checkpoint of tiny settings on a private copy of the corpus, and
    those settings."""
    own_corpus = shutil.copytree(corpus, tmp_path / "corpus")
    arguments = tiny_settings(tmp_path, own_corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    return arguments, tmp_path / "runs" / "default"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model.d_model": 32}, "model.d_model 16 -> 32"),
        ({"batch.global_batch_size": 16}, "batch.global_batch_size 8 -> 16"),
        ({"run.seed": 7}, "run.seed 1337 -> 7"),
        ({"data.seq_len": 8}, "data.seq_len 16 -> 8"),
        ({"optim.lr": 0.1}, "optim.lr 0.003 -> 0.1"),
        ({"optim.name": "sgd"}, "optim.name 'adamw' -> 'sgd'"),
        ("edited data", "training data fingerprint"),
        ("another data order", "data order feistel-4 -> feistel-8-blake2b"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, capsys, started_run, change, named):
    arguments, run_dir = started_run
    if change == "edited data":  # the same data.source and settings; every file has one more line
        for document in (tmp_path / "corpus").iterdir():
            document.write_text(document.read_text() + "\nedited")
        change = {}
    if change == "another data order":  # a checkpoint of a program version that ordered the rows otherwise
        for path in (run_dir / "checkpoints").glob("*.pt"):
            payload = torch.load(path, weights_only=True)
            torch.save({**payload, "data": {**payload["data"], "order": "feistel-4"}}, path)
        change = {}
    before = snapshot(run_dir)
    status, _, error = run_in_process(arguments + [f"{key}={value}" for key, value in change.items()], capsys)
    assert status == 2
    assert error.count("\n") == 1 and "belongs to a different run" in error and named in error, error
    assert snapshot(run_dir) == before


# Every other setting a resume must share, in one test (one step-0 run to refuse them all: cheap). A resume
# that skipped, say, beta2 would exit 0 with config.toml saying 0.99 while AdamW's loaded state kept 0.95.
MORE_SETTINGS_THAT_MUST_MATCH = [
    ("optim.beta2", 0.99, "0.95 -> 0.99"),
    ("optim.momentum", 0.8, "0.9 -> 0.8"),
    ("optim.weight_decay", 0.0, "0.1 -> 0.0"),
    ("batch.tail", "partial", "'drop' -> 'partial'"),
    ("model.n_layer", 2, "1 -> 2"),
    ("model.n_head", 4, "2 -> 4"),
    ("model.name", "gru", "'gpt' -> 'gru'"),
]


def test_every_setting_that_shapes_the_run_is_compared_on_resume(capsys, started_run):
    arguments, run_dir = started_run
    before = snapshot(run_dir)
    for key, value, change in MORE_SETTINGS_THAT_MUST_MATCH:
        status, _, error = run_in_process(arguments + [f"{key}={value}"], capsys)
        assert status == 2, (key, error)
        assert error.count("\n") == 1 and f"belongs to a different run: {key} {change}" in error, error
    assert snapshot(run_dir) == before


class CreatesAFileWhenUnpickled:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # unpickling calls open(path, "w")
        return (open, (str(self.path), "w"))


def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, capsys, started_run):
    arguments, run_dir = started_run
    marker = tmp_path / "created_by_the_pickle"
    payload = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    payload["counters"] = CreatesAFileWhenUnpickled(marker)
    for path in (run_dir / "checkpoints").iterdir():
        path.unlink()
    torch.save(payload, run_dir / "checkpoints" / "latest.pt")

    status, _, error = run_in_process(arguments, capsys)
    assert status == 2 and error.count("\n") == 1, error
    assert (
        "latest.pt cannot be read (the weights-only loader, which accepts tensors and plain values only, refused it"
        in error
    )
    assert not marker.exists()
    # The file is a working attack: an unrestricted load runs it.
    torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------------------------------------------
# Non-finite steps
# ---------------------------------------------------------------------------------------------------------


def make_loss_nan_at(monkeypatch, bad_steps: set[int]) -> None:
    """The loss of each step in bad_steps (counted from 1) is multiplied by nan, and so is every gradient."""
    real_optimizer_step, real_step_batch = train.optimizer_step, train.step_batch
    step_running = []  # the step whose examples were fetched last, counted from 1

    def step_batch(rows, step, **layout):
        step_running.append(step + 1)
        return real_step_batch(rows, step, **layout)

    def optimizer_step(model, micro_batches, optimizer, *, loss_sum_fn, **options):
        if step_running[-1] in bad_steps:
            return real_optimizer_step(
                model, micro_batches, optimizer, loss_sum_fn=lambda *args: loss_sum_fn(*args) * math.nan, **options
            )
        return real_optimizer_step(model, micro_batches, optimizer, loss_sum_fn=loss_sum_fn, **options)

    monkeypatch.setattr(train, "step_batch", step_batch)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)


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
        ("less than one global batch", "the training data has 3 rows, fewer than one global batch of 8"),
    ],
)
def test_bad_data_is_one_line_and_nothing_written(tmp_path, capsys, kind, named):
    source = bad_data(tmp_path / "data", kind)
    status, _, error = run_in_process(tiny_settings(tmp_path, source, **{"data.val_fraction": 0.0}), capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
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
    if kind == "missing parameter":
        return {**payload, "model": {key: value for key, value in payload["model"].items() if key != "lm_head.weight"}}
    assert kind == "wrong shape"  # the config matches; the tensor does not
    return {**payload, "model": {**payload["model"], "lm_head.weight": torch.zeros(256, 8)}}


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
        ("missing parameter", "its model does not fit the configured model: missing lm_head.weight"),
        ("wrong shape", "lm_head.weight has shape [256, 8], the configured model [256, 16]"),
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
    status, _, error = run_in_process(arguments, capsys)
    assert status == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and named in error, error
    assert snapshot(run_dir) == before


@pytest.mark.parametrize(
    "line, named",
    [('{"steps": 1, "loss": 5.2\n', "line 1 is not JSON"), ('{"loss": 5.2}\n', 'line 1 is not an object with "steps"')],
    ids=["not-json", "no-steps"],
)
def test_a_damaged_metrics_line_is_one_line_and_the_run_directory_untouched(tmp_path, capsys, started_run, line, named):
    """A complete line of metrics.jsonl that is not a record (a half last line is what a kill leaves, and is
    dropped): the resume cannot tell its step, so it says which line and stops, before anything is written.
    It was a JSONDecodeError or KeyError traceback on every retry."""
    arguments, run_dir = started_run
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write(line)
    before = snapshot(run_dir)
    status, _, error = run_in_process(arguments + ["run.max_steps=1"], capsys)
    assert status == 2
    assert error.startswith(f"error: {run_dir / 'metrics.jsonl'} {named}") and error.count("\n") == 1, error
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


def test_bad_input_through_the_real_entry_point(tmp_path, corpus):
    """The exit status and stderr a shell sees: exit 2, one line, no traceback, for a checkpoint of random
    bytes and for a data file that is not UTF-8."""
    settings = tiny_settings(tmp_path, corpus, **{"run.max_steps": 0})
    checkpoints = tmp_path / "runs" / "default" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest.pt").write_bytes(garbage(3000))
    source = bad_data(tmp_path / "data", "invalid UTF-8 file")
    for arguments, named in [
        (settings, "latest.pt cannot be read"),
        (settings + [f"data.source={source}"], "is not a text file"),
    ]:
        completed = run_train(arguments)
        assert completed.returncode == 2
        assert (
            completed.stderr.count("\n") == 1 and named in completed.stderr and "Traceback" not in completed.stderr
        ), completed.stderr


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
    deadline = time.monotonic() + 90
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
