"""Disrupted runs under torchrun: killed and hanging ranks, stop signals, a rank that raises, a full disk,
two torchrun agents, and a resume on a different number of ranks. Each must end as the uninterrupted run.

Runs that must be disrupted go through tests/faulty_train.py: train.py itself, with a SIGKILL or a stall
injected at a chosen point of a chosen torchrun attempt. Every launch has a time limit. The helpers that
launch torchrun here are shared with tests/test_signals.py and tests/test_run_dir.py.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from testkit.disk import fill_disk, small_disk
from testkit.ranks import pretend_launched, run_main_on_ranks
from tests.test_checkpoints import run_in_process
from tests.test_logs import assert_tensorboard_matches_metrics
from tests.test_train import comparable, final_weights, read_metrics, run_train, tiny_settings, uneven_corpus

REPO = Path(__file__).resolve().parent.parent

# The run every disrupted 2-rank run must reproduce: six steps, a checkpoint every two (all four kept), a
# cosine horizon that does not move when a shorter session stops early, and no dropout (a change in the
# number of ranks reseeds the dropout streams, see restore_rng_states in accumulation/run/restore.py).
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


@pytest.mark.integration
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


def main_where_rank_1_fails(argv: list[str]) -> int:
    """train.main for a forked rank (testkit/ranks.py) where rank 1, as its step 2 begins, raises
    (RANK_1_FAILS=raise) or stalls for 15 s (RANK_1_FAILS=stall), longer than the tests' dist.timeout_s."""
    import train
    from accumulation.run import build

    real_optimizer_step, calls = build.optimizer_step, []

    def optimizer_step(*args, **options):
        calls.append(len(calls) + 1)
        if os.environ["RANK"] == "1" and len(calls) == 2:
            if os.environ["RANK_1_FAILS"] == "raise":
                raise RuntimeError("injected failure at step 2")
            time.sleep(15)
        return real_optimizer_step(*args, **options)

    build.optimizer_step = optimizer_step
    return train.main(argv)


def test_on_forked_ranks_a_stalled_rank_makes_the_other_fail_within_the_timeout(tmp_path, corpus, monkeypatch):
    """The torchrun test below on 2 forked ranks (the default tier): rank 1 stalls as step 2 begins; rank 0
    waits in step 2's first collective for dist.timeout_s = 5 s, then says so in one line and exits non-zero."""
    monkeypatch.setenv("RANK_1_FAILS", "stall")
    arguments = tiny_settings(tmp_path, corpus, **{"dist.timeout_s": 5, "run.sample_bytes": 0})
    started = time.monotonic()
    [(status, stdout, error), _] = run_main_on_ranks(
        "tests.test_disrupted_runs:main_where_rank_1_fails", arguments, timeout_s=150
    )
    assert status != 0
    assert "error: rank 0: another rank stopped answering, so a collective failed (Timed out" in error, error
    assert "dist.timeout_s=5 s" in error
    assert "step 2/" not in stdout  # rank 0 never finished step 2
    assert time.monotonic() - started < 100  # start-up, 5 s of waiting and rank 1's 15 s stall, not a hang


def test_on_forked_ranks_a_rank_that_raises_ends_the_other_within_seconds(tmp_path, corpus, monkeypatch):
    """The torchrun test below on 2 forked ranks: rank 1 raises before step 2, prints its traceback and leaves
    without tearing down the process group; rank 0's next collective fails at once, not after dist.timeout_s."""
    monkeypatch.setenv("RANK_1_FAILS", "raise")
    arguments = tiny_settings(tmp_path, corpus, **{**SETTINGS, "dist.timeout_s": 300})
    started = time.monotonic()
    [(status_0, stdout_0, _), (status_1, _, error_1)] = run_main_on_ranks(
        "tests.test_disrupted_runs:main_where_rank_1_fails", arguments, timeout_s=150
    )
    assert status_0 != 0 and status_1 == 1
    assert "RuntimeError: injected failure at step 2" in error_1 and "Traceback" in error_1
    assert "step 2/" not in stdout_0  # rank 0 never finished step 2
    assert time.monotonic() - started < 100  # not dist.timeout_s (300 s)


@pytest.mark.integration
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
    # Start-up and 5 s of waiting, not a hang (150 s); wide for a test beside it on the other pytest-xdist worker.
    assert time.monotonic() - started < 100


# ---------------------------------------------------------------------------------------------------------
# Preemption, fail-fast and a full disk under torchrun
# ---------------------------------------------------------------------------------------------------------


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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
        # Start-up, two steps, and seconds to end both ranks, not dist.timeout_s (300 s); wide for the test
        # beside it on the other pytest-xdist worker.
        assert exit_s < 120
        assert checkpoint_names(run_dir) == sorted(before)  # no temporary file left behind
        assert {name: (checkpoints / name).read_bytes() for name in before} == before
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [json.loads(line)["steps"] for line in text.splitlines()] == [1, 2, 3, 4]

        filler.unlink()
        resumed = run_train(arguments, ranks=2)
        assert resumed.returncode == 0, resumed.stderr
        assert "at step 2" in resumed.stdout
        assert_same_run(run_dir, reference)


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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
    for ranks, named in [(4, "micro_batch_size must be one of [1, 2]"), (3, "multiple of 3 (e.g. 6 or 9)")]:
        pretend_launched(monkeypatch, world_size=ranks)
        status, _, error = run_in_process(tiny_settings(tmp_path, corpus, **{"batch.micro_batch_size": 4}), capsys)
        assert status == 2 and named in error and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()
