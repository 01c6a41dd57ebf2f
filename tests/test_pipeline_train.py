"""train.py with dist.pipeline_stages = 2 on 2 gloo ranks, and on a 2 × 2 mesh of 4 ranks with A from 1 to 4
under both schedules: the same updates as one process, the same checkpoint state (a pipelined run's sharded
folder resumes on 1 process and on DDP, and a 1-process run's single file resumes pipelined), a stopped run
resumed bit-identically; and every setting pipeline stages refuse is one line, exit 2, nothing written; a stage's
mode around validation, an optimizer state of two parameter groups between layouts, and the layout check alone.
The shared runs are train.main on forked gloo ranks (tests/test_train.py, train_forked); torchrun's launches are
in the integration tier. tests/test_pipeline_checkpoint.py holds the sharded checkpoints' own tests."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from accumulation.batching import MicroBatch
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.mesh import build_layout
from accumulation.parallel.pipeline import build_pipeline, pipelined_loss_sum
from accumulation.run.sharded_checkpoint import whole_state
from accumulation.step import token_cross_entropy_sum
from testkit.ranks import pretend_launched, run_on_ranks
from tests.test_checkpoints import EVAL_MODE_FORK
from tests.test_step import CPU
from tests.test_train import (
    PLAIN_SGD,
    REPO,
    TIMING_KEYS,
    read_metrics,
    run_train,
    tiny_settings,
    train_forked,
    uneven_corpus,
)

# Two blocks, so two stages of one block each; 3 plain SGD steps with a checkpoint after each.
PIPELINE_RUN = {
    **PLAIN_SGD,
    "model.n_layer": 2,
    "run.max_steps": 3,
    "run.checkpoint_every": 1,
    "run.keep_checkpoints": 5,
    "run.eval_every": 3,
    "run.sample_bytes": 0,
}
STAGES = {"dist.pipeline_stages": 2}

# fp32: the same sums taken in another order (per micro-batch and stage, versus one process) differ by a few
# ulps; over 3 updates that stays far below 1e-5 of the largest weight change, while a wrong weighting (the
# schedule's scale_grads default) changes the update by tens of percent.
FP32_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (the reference) and 2 ranks with 2 pipeline stages, the same 3 steps: their run folders."""
    tmp_path = tmp_path_factory.mktemp("pipeline_runs")
    corpus = uneven_corpus(tmp_path / "corpus")
    status, _, stderr = train_forked(tiny_settings(tmp_path, corpus, **PIPELINE_RUN, **{"run.name": "one"}), 1)
    assert status == 0, stderr
    piped = tiny_settings(tmp_path, corpus, **PIPELINE_RUN, **STAGES, **{"run.name": "piped"})
    status, stdout, stderr = train_forked(piped, 2)
    assert status == 0, stderr
    assert "x replicas 1 examples per update; 2 pipeline stages (1f1b), 2 ranks" in stdout
    return tmp_path, corpus, stdout


def comparable_metrics(run_dir) -> list[dict]:
    """metrics.jsonl without the measured timings, which no two runs share."""
    return [{key: value for key, value in line.items() if key not in TIMING_KEYS} for line in read_metrics(run_dir)]


def checkpoint(run_dir, step: int) -> dict:
    """Step `step`'s checkpoint as the single file holds it: a pipelined run's sharded folder read whole, or the
    single file of one process and DDP."""
    folder = run_dir / "checkpoints" / f"step_{step:06d}.dcp"
    if folder.is_dir():
        return whole_state(folder)
    return torch.load(run_dir / "checkpoints" / f"step_{step:06d}.pt", weights_only=True)


def assert_close_updates(got: dict, reference: dict, initial: dict) -> None:
    assert list(got) == list(reference)
    for key in reference:
        update = reference[key] - initial[key]
        tolerance = FP32_RTOL * update.abs().max().item() + 1e-7
        assert (got[key] - reference[key]).abs().max().item() <= tolerance, key


def resumed_from_step_2(source, destination):
    """A copy of a run folder as if the run had been killed after its step-2 checkpoint (a sharded folder, or a
    single file and latest.pt)."""
    shutil.copytree(source, destination)
    checkpoints = destination / "checkpoints"
    if (checkpoints / "step_000003.dcp").is_dir():
        shutil.rmtree(checkpoints / "step_000003.dcp")
    else:
        (checkpoints / "step_000003.pt").unlink()
        shutil.copy(checkpoints / "step_000002.pt", checkpoints / "latest.pt")
    (destination / "run.lock").unlink(missing_ok=True)


def test_pipelined_run_equals_one_process_with_the_same_files_and_logs(runs):
    tmp_path, _corpus, _stdout = runs
    one, piped = tmp_path / "runs" / "one", tmp_path / "runs" / "piped"
    initial = checkpoint(one, 0)["model"]
    assert torch.equal(
        torch.cat([v.flatten() for v in checkpoint(piped, 0)["model"].values()]),
        torch.cat([v.flatten() for v in initial.values()]),
    )
    for step in (1, 3):
        ours, reference = checkpoint(piped, step), checkpoint(one, step)
        assert_close_updates(ours["model"], reference["model"], initial)
        assert ours["counters"] == reference["counters"]
        assert ours["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
    # The logged loss, tokens and validation loss of every step: those of one process.
    for ours, reference in zip(read_metrics(piped), read_metrics(one), strict=True):
        assert ours["tokens"] == reference["tokens"] and ours["micro_batches"] == reference["micro_batches"]
        assert abs(ours["loss"] - reference["loss"]) <= 1e-5 * reference["loss"]
        if "val_loss" in reference:
            assert abs(ours["val_loss"] - reference["val_loss"]) <= 1e-5 * reference["val_loss"]


def test_a_stopped_pipelined_run_resumes_bit_identically(runs):
    tmp_path, corpus, _stdout = runs
    resumed_from_step_2(tmp_path / "runs" / "piped", tmp_path / "runs" / "piped_again")
    status, stdout, stderr = train_forked(
        tiny_settings(tmp_path, corpus, **PIPELINE_RUN, **STAGES, **{"run.name": "piped_again"}), 2
    )
    assert status == 0, stderr
    assert "resuming from" in stdout
    straight, again = checkpoint(tmp_path / "runs" / "piped", 3), checkpoint(tmp_path / "runs" / "piped_again", 3)
    for key, value in straight["model"].items():
        assert torch.equal(value, again["model"][key]), key
    assert comparable_metrics(tmp_path / "runs" / "piped") == comparable_metrics(tmp_path / "runs" / "piped_again")


@pytest.mark.integration
@pytest.mark.slow
def test_a_pipelined_run_killed_by_sigterm_resumes_bit_identically(tmp_path):
    """SIGTERM to torchrun's agent as soon as the first step is logged: both stages learn of it in the same
    step's all-reduce, checkpoint there and exit; started again, the run ends with the bits of a run that was
    never stopped (with dropout on: every rank's random stream is restored too)."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {
        **PIPELINE_RUN,
        **STAGES,
        "model.dropout": 0.2,
        "run.max_steps": 20,
        "run.checkpoint_every": 100,
        "run.eval_every": 0,
    }
    straight = run_train(tiny_settings(tmp_path, corpus, **settings, **{"run.name": "straight"}), ranks=2)
    assert straight.returncode == 0, straight.stderr
    arguments = tiny_settings(tmp_path, corpus, **settings, **{"run.name": "killed"})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [*launcher, str(REPO / "train.py"), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        cwd=REPO,
    )
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (metrics.exists() and metrics.read_text()) and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    agent.send_signal(signal.SIGTERM)
    _stdout, stderr = agent.communicate(timeout=150)
    stopped_at = whole_state(sorted((tmp_path / "runs" / "killed" / "checkpoints").glob("step_*.dcp"))[-1])
    assert 1 <= stopped_at["counters"]["steps"] < 20, stderr[-2000:]  # stopped mid-run, at a step's end
    assert "stopped at step" in stderr
    resumed = run_train(arguments, ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    a, b = (checkpoint(tmp_path / "runs" / run, 20) for run in ("straight", "killed"))
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    assert comparable_metrics(tmp_path / "runs" / "straight") == comparable_metrics(tmp_path / "runs" / "killed")


@pytest.mark.parametrize(
    "source, ranks, stages",
    [("piped", 1, 1), pytest.param("piped", 2, 1, marks=pytest.mark.slow), ("one", 2, 2)],
    ids=["pipelined-to-one-process", "pipelined-to-ddp", "one-process-to-pipelined"],
)
def test_checkpoints_resume_across_layouts(runs, source, ranks, stages):
    tmp_path, corpus, _stdout = runs
    name = f"{source}_on_{ranks}x{stages}"
    resumed_from_step_2(tmp_path / "runs" / source, tmp_path / "runs" / name)
    layout = {"dist.pipeline_stages": stages}
    status, stdout, stderr = train_forked(
        tiny_settings(tmp_path, corpus, **PIPELINE_RUN, **layout, **{"run.name": name}), ranks
    )
    assert status == 0, stderr
    assert "resuming from" in stdout
    initial = checkpoint(tmp_path / "runs" / "one", 0)["model"]
    reference = checkpoint(tmp_path / "runs" / "one", 3)["model"]
    assert_close_updates(checkpoint(tmp_path / "runs" / name, 3)["model"], reference, initial)


# (world size, settings, the key the one line names). WORLD_SIZE is only read here: nothing is launched.
REFUSED = [
    (1, {"dist.pipeline_stages": 2}, "dist.pipeline_stages"),  # 1 rank is not 2 stages
    (4, {"dist.pipeline_stages": 3}, "dist.pipeline_stages"),  # 4 ranks are not D x 3
    (2, {"dist.pipeline_stages": 2, "model.n_layer": 1}, "dist.pipeline_stages"),  # more stages than blocks
    (2, {"dist.pipeline_stages": 2, "model.name": "gru"}, "dist.pipeline_stages"),  # a model without the seam
    (2, {"dist.pipeline_stages": 2, "batch.micro_batch_size": 8}, "dist.pipeline_schedule"),  # A = 1 < P for 1f1b
    (2, {"dist.pipeline_stages": 2, "batch.on_oom": "shrink"}, "batch.on_oom"),
    (2, {"dist.pipeline_stages": 2, "dist.strategy": "fsdp2"}, "dist.strategy"),
    (2, {"dist.pipeline_stages": 2, "model.loss": "chunked"}, "model.loss"),
    (2, {"dist.pipeline_stages": 2, "model.compile": "true"}, "model.compile"),
]


@pytest.mark.parametrize("world_size, settings, named", REFUSED, ids=[str(case[1]) for case in REFUSED])
def test_settings_pipeline_stages_refuse_are_one_line_exit_2_nothing_written(
    tmp_path, capsys, monkeypatch, world_size, settings, named
):
    pretend_launched(monkeypatch, world_size)
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = tiny_settings(tmp_path, corpus, **{"model.n_layer": 2, **settings})
    assert train.main(arguments) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}"), lines
    assert not (tmp_path / "runs").exists()
    assert not torch.distributed.is_initialized()  # nothing here started a process group


# The D × P = 2 × 2 mesh on 4 ranks, A = G / (m·D) from 1 to 4, both schedules (1F1B needs A ≥ P = 2): the
# same 3 steps as one process, within FP32_RTOL (the same sums in other orders, as above). DDP rebuilds its
# buckets at step 2's first forward from the gradient order step 1 recorded, so a one-step test cannot see a
# wrong reducer state. The default tier keeps the default schedule at A = 2 (without the schedule's no_sync,
# the first stage died at step 2 there), on 4 forked ranks; the others are in the integration tier, launched
# by torchrun: each 4-rank launch takes ~30 s on 2 cores.
MESH_RUN = {
    **PLAIN_SGD,
    "model.n_layer": 2,
    "run.max_steps": 3,
    "run.log_every": 1,
    "run.checkpoint_every": 3,
    "run.eval_every": 0,
    "run.sample_bytes": 0,
    "batch.global_batch_size": 24,  # G = m·A·D with D = 2: m = 12, 6, 4, 3 for A = 1, 2, 3, 4
}
DEFAULT_TIER_LAYOUT = ("1f1b", 2)
MESH_LAYOUTS = [
    pytest.param(
        schedule, accumulation, marks=() if (schedule, accumulation) == DEFAULT_TIER_LAYOUT else pytest.mark.integration
    )
    for schedule, accumulation in [
        ("1f1b", 2),
        ("1f1b", 3),
        ("1f1b", 4),
        ("gpipe", 1),
        ("gpipe", 2),
        ("gpipe", 3),
        ("gpipe", 4),
    ]
]


@pytest.fixture(scope="module")
def mesh_reference(tmp_path_factory):
    """One process, the whole global batch in one micro-batch, the same 3 steps: (tmp_path, corpus, run folder)."""
    tmp_path = tmp_path_factory.mktemp("mesh_runs")
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**MESH_RUN, "batch.micro_batch_size": 24, "run.name": "one"}
    status, _, stderr = train_forked(tiny_settings(tmp_path, corpus, **settings), 1)
    assert status == 0, stderr
    return tmp_path, corpus, tmp_path / "runs" / "one"


@pytest.mark.parametrize("schedule, accumulation", MESH_LAYOUTS)
def test_every_two_by_two_mesh_layout_trains_several_steps_as_one_process(mesh_reference, schedule, accumulation):
    tmp_path, corpus, one = mesh_reference
    name = f"mesh_{schedule}_A{accumulation}"
    layout = {
        **STAGES,
        "dist.pipeline_schedule": schedule,
        "batch.micro_batch_size": 24 // (2 * accumulation),
        "run.name": name,
    }
    arguments = tiny_settings(tmp_path, corpus, **MESH_RUN, **layout)
    if (schedule, accumulation) == DEFAULT_TIER_LAYOUT:
        status, stdout, stderr = train_forked(arguments, 4, timeout_s=300)
    else:
        piped = run_train(arguments, ranks=4, timeout_s=300)
        status, stdout, stderr = piped.returncode, piped.stdout, piped.stderr
    assert status == 0, stderr[-3000:]
    assert f"x accum {accumulation} x replicas 2 examples per update; 2 pipeline stages ({schedule}), 4 ranks" in stdout
    ours, reference = read_metrics(tmp_path / "runs" / name), read_metrics(one)
    assert [line["steps"] for line in ours] == [1, 2, 3]
    for got, expected in zip(ours, reference, strict=True):
        assert got["tokens"] == expected["tokens"] and got["micro_batches"] == expected["micro_batches"] * accumulation
        assert abs(got["loss"] - expected["loss"]) <= FP32_RTOL * expected["loss"]
    initial = checkpoint(one, 0)["model"]
    assert_close_updates(checkpoint(tmp_path / "runs" / name, 3)["model"], checkpoint(one, 3)["model"], initial)


@pytest.mark.integration
def test_pipeline_stages_of_a_model_built_in_eval_mode_train_with_dropout_after_a_resume(tmp_path, monkeypatch):
    """The loop puts this rank's stage in train mode before every step: without that, the stages of a model
    built in eval mode (as from_pretrained returns one) trained without dropout after a resume."""
    (tmp_path / "eval_mode_fork.py").write_text(EVAL_MODE_FORK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**PIPELINE_RUN, **STAGES, "model.name": "eval_mode_fork:eval-mode-gpt", "model.dropout": 0.1}
    straight = run_train(tiny_settings(tmp_path, corpus, **settings, **{"run.name": "straight"}), ranks=2)
    assert straight.returncode == 0, straight.stderr
    resumed_from_step_2(tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed")
    resumed = run_train(tiny_settings(tmp_path, corpus, **settings, **{"run.name": "resumed"}), ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    expected, got = (checkpoint(tmp_path / "runs" / name, 3)["model"] for name in ("straight", "resumed"))
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# ------------------------------------------------------------------ A pipeline stage's mode around validation


def validation_mode_worker(rank, world_size):
    """A 2-stage GPT with dropout: each stage's modes after the pipelined validation pass, and the loss of two
    passes over the same rows (equal only when no dropout is drawn)."""
    torch.set_num_threads(1)
    layout = build_layout(CPU, pipeline_stages=2)
    model = GPT(GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=16, vocab_size=64, dropout=0.5), seed=3)
    pipeline = build_pipeline(model, layout, CPU, token_cross_entropy_sum, 2, "1f1b")
    generator = torch.Generator().manual_seed(0)
    rows = [
        MicroBatch(tokens[:, :-1], tokens[:, 1:], 2)
        for tokens in (torch.randint(0, 64, (2, 9), generator=generator) for _ in range(3))
    ]
    losses = []
    for _ in range(2):
        loss_sum, _tokens = pipelined_loss_sum(pipeline, rows, None)
        torch.distributed.all_reduce(loss_sum)
        losses.append(loss_sum.item())
    return losses, [module.training for module in pipeline.stage_module.modules()]


def test_pipelined_validation_runs_in_eval_mode_and_leaves_every_stage_in_train_mode():
    """Train mode after: the step after validation draws dropout again. (train.py's loop also sets train mode
    before every step; this is the validation's own promise, which a caller without that line relies on.)"""
    for losses, modes in run_on_ranks(validation_mode_worker, world_size=2, timeout_s=120):
        assert losses[0] == losses[1], "validation drew dropout: a stage ran it in train mode"
        assert all(modes), "a stage was left in eval mode after validation"


def test_validation_between_pipelined_steps_changes_no_update(tmp_path):
    """2 stages with dropout 0.1: validation after every step ends on the very bits of a run that never
    validates. A stage left in eval mode after validation, or validating in train mode (which draws from the
    stream the next step's dropout uses), ends elsewhere; the run without dropout shows that dropout acts."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**PIPELINE_RUN, **STAGES, "model.dropout": 0.1, "run.checkpoint_every": 3}
    runs = {
        "validating": {"run.eval_every": 1},
        "not_validating": {"run.eval_every": 0},
        "no_dropout": {"run.eval_every": 0, "model.dropout": 0.0},
    }
    for name, overrides in runs.items():
        status, _, stderr = train_forked(
            tiny_settings(tmp_path, corpus, **{**settings, **overrides, "run.name": name}), 2
        )
        assert status == 0, stderr
    validating, not_validating, no_dropout = (checkpoint(tmp_path / "runs" / name, 3)["model"] for name in runs)
    for key, value in not_validating.items():
        assert torch.equal(validating[key], value), key
    assert any(not torch.equal(no_dropout[key], value) for key, value in not_validating.items())
    assert all("val_loss" in line for line in read_metrics(tmp_path / "runs" / "validating"))


# ------------------------------------------- An optimizer state of two parameter groups between layouts

# SGD with momentum and weight decay: build_optimizer's two groups (matrices decay, vectors do not) differ in
# their settings, and each parameter's momentum buffer is linear in its gradients, so the pipelined and the
# one-process buffers agree to fp32 rounding (FP32_RTOL above) while a buffer on the wrong parameter, or a
# group's settings on the other group, is off by its whole size.
TWO_GROUPS = {"optim.momentum": 0.9, "optim.weight_decay": 0.1, "optim.lr": 0.1}


def assert_same_optimizer_state(got: dict, reference: dict) -> None:
    assert got["param_groups"] == reference["param_groups"]
    assert sorted(got["state"]) == sorted(reference["state"])
    for index, state in reference["state"].items():
        buffer, expected = got["state"][index]["momentum_buffer"], state["momentum_buffer"]
        assert buffer.shape == expected.shape, index
        tolerance = FP32_RTOL * expected.abs().max().item() + 1e-7
        assert (buffer - expected).abs().max().item() <= tolerance, index


def test_an_optimizer_state_of_two_groups_moves_between_pipeline_stages_and_one_process(tmp_path):
    """One process and 2 stages, 3 steps each: the pipelined checkpoint's optimizer state (each stage's
    state gathered into one optimizer's numbering) is one process's, parameter by parameter and group by group;
    and each resumed on the other layout from step 2 ends at step 3 where one process does."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**PIPELINE_RUN, **TWO_GROUPS}
    for name, ranks, layout in [("one", 1, {}), ("piped", 2, STAGES)]:
        arguments = tiny_settings(tmp_path, corpus, **settings, **layout, **{"run.name": name})
        status, _, stderr = train_forked(arguments, ranks)
        assert status == 0, stderr
    one, piped = tmp_path / "runs" / "one", tmp_path / "runs" / "piped"
    reference = checkpoint(one, 3)
    assert reference["optimizer"]["param_groups"][0]["weight_decay"] == 0.1  # two groups that differ
    assert reference["optimizer"]["param_groups"][1]["weight_decay"] == 0.0
    for step in (1, 3):
        assert_same_optimizer_state(checkpoint(piped, step)["optimizer"], checkpoint(one, step)["optimizer"])
    initial = checkpoint(one, 0)["model"]
    for source, name, ranks, layout in [("piped", "piped_on_one", 1, {}), ("one", "one_piped", 2, STAGES)]:
        resumed_from_step_2(tmp_path / "runs" / source, tmp_path / "runs" / name)
        arguments = tiny_settings(tmp_path, corpus, **settings, **layout, **{"run.name": name})
        status, stdout, stderr = train_forked(arguments, ranks)
        assert status == 0, stderr
        assert "resuming from" in stdout
        resumed = checkpoint(tmp_path / "runs" / name, 3)
        assert_close_updates(resumed["model"], reference["model"], initial)
        assert_same_optimizer_state(resumed["optimizer"], reference["optimizer"])


# ------------------------------------------------------------------ The layout check, alone


def test_ranks_that_do_not_divide_into_the_stages_are_refused_by_the_layout_check_alone(tmp_path, capsys, monkeypatch):
    """4 ranks, 3 stages, 3 blocks: every other check passes (3 blocks split into 3 stages; a broken layout
    check would take D = 4 // 3 = 1 replica, A = 8 / 2 = 4 >= 3 micro-batches for 1F1B), so only the check
    that the ranks divide into whole replicas can refuse it. The suite's other cases (1 rank for 2 stages,
    4 ranks for 3 stages of 2 blocks) are refused under the same key by the batch arithmetic or the model's
    split too, and hid a broken layout check. dist.timeout_s: a broken check then waits for 4 ranks that never
    come, failing in seconds instead of hanging."""
    pretend_launched(monkeypatch, 4)
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"model.n_layer": 3, "dist.pipeline_stages": 3, "dist.timeout_s": 3}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: dist.pipeline_stages: 4 ranks cannot be split into replicas of 3 pipeline stages; launch a multiple "
        "of 3 ranks (torchrun --nproc_per_node=N) or choose P dividing 4"
    ]
    assert not (tmp_path / "runs").exists()
