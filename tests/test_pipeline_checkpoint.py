"""Pipeline stages' sharded checkpoints (split_stage_payload and the writer of
accumulation/run/sharded_checkpoint.py): through train.main on gloo ranks, a P = 2 run and a D = 2 × P = 2 mesh
write step_XXXXXX.dcp folders and no single file; a resume is bit for bit, from step 0 (a fresh AdamW, whose state
must stay empty) and mid-run; a folder read whole in one process is the old single-file gather of the live stages,
bit for bit; the state loads bit for bit between P = 2, P = 4, a 2 × 2 mesh, fsdp2, ddp and one process in both
directions, and a run continued there stays within fp32 reordering; a flipped bit in a stage's shard file falls
back to the older checkpoint on every rank."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from accumulation.config.config import load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, build_model_on_meta, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.mesh import build_layout
from accumulation.run.build import build_optimizer, build_training
from accumulation.run.restore import restore_training_state
from accumulation.run.sharded_checkpoint import read_sharded_checkpoint, whole_state
from testkit.ranks import run_main_on_ranks, run_on_ranks
from testkit.reference import max_relative_error
from tests.test_sharded_checkpoint import assert_same_state, reload_worker
from tests.test_train import comparable, read_metrics, tiny_settings, train_forked, uneven_corpus

CPU = torch.device("cpu")

# AdamW (the default optimizer), 4 blocks so that the model splits into 2 or 4 stages, 4 steps with a checkpoint
# after each, all kept; validation every 2 steps and a sample at the end (which reads the last folder).
RUN = {"model.n_layer": 4, "run.max_steps": 4, "run.checkpoint_every": 1, "run.keep_checkpoints": 10}


def arguments_of(tmp_path, corpus, name: str, ranks_layout: dict, **overrides) -> list[str]:
    return tiny_settings(tmp_path, corpus, **{**RUN, **ranks_layout, "run.name": name, **overrides})


def train_run(tmp_path, corpus, name: str, ranks: int, layout: dict, **overrides) -> tuple[int, str, str]:
    return train_forked(arguments_of(tmp_path, corpus, name, layout, **overrides), ranks, timeout_s=240)


def folder(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}.dcp"


def newest(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*.dcp"))[-1]


def resumed_copy(source: Path, target: Path, keep_steps: list[int]) -> Path:
    """A copy of a run's directory holding only the checkpoint folders of `keep_steps`."""
    shutil.copytree(source, target)
    for checkpoint in (target / "checkpoints").glob("step_*.dcp"):
        if int(checkpoint.name[5:11]) not in keep_steps:
            shutil.rmtree(checkpoint)
    (target / "run.lock").unlink(missing_ok=True)
    return target


STAGES_2 = {"dist.pipeline_stages": 2}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 AdamW steps on 2 ranks of 2 stages, a checkpoint after every step: the reference below."""
    tmp_path = tmp_path_factory.mktemp("pipeline_checkpoint")
    corpus = uneven_corpus(tmp_path / "corpus")
    status, _, stderr = train_run(tmp_path, corpus, "straight", 2, STAGES_2)
    assert status == 0, stderr
    return tmp_path, corpus, tmp_path / "runs" / "straight"


@pytest.fixture(scope="module")
def fsdp2_straight(straight):
    """The same 4 steps under fsdp2 on 2 ranks: its run folder."""
    tmp_path, corpus, _ = straight
    status, _, stderr = train_run(tmp_path, corpus, "fsdp2_straight", 2, {"dist.strategy": "fsdp2"})
    assert status == 0, stderr
    return tmp_path / "runs" / "fsdp2_straight"


def assert_only_folders(run_dir: Path, ranks: int) -> None:
    """Every checkpoint a sharded folder of DCP's metadata, a shard file per rank, state.pt and checksums.json;
    no single file anywhere in the run directory (no rank wrote one)."""
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{step:06d}.dcp" for step in range(5)], checkpoints
    for checkpoint in (run_dir / "checkpoints").iterdir():
        names = {path.name for path in checkpoint.iterdir()}
        assert names == {".metadata", "state.pt", "checksums.json"} | {f"__{r}_0.distcp" for r in range(ranks)}
    assert [path.name for path in run_dir.rglob("*.pt")] == ["state.pt"] * 5


def test_a_pipelined_run_writes_sharded_folders_and_no_single_file(straight):
    tmp_path, corpus, run_dir = straight
    assert_only_folders(run_dir, 2)
    state = whole_state(newest(run_dir))
    # AdamW counted each of the 4 updates once, in every parameter's state, gathered from both stages
    model = build_model_on_meta(load_config(arguments_of(tmp_path, corpus, "x", {})).model, 256, 16)
    assert sorted(state["optimizer"]["state"]) == list(range(len(list(model.parameters()))))
    assert {entry["step"].item() for entry in state["optimizer"]["state"].values()} == {4.0}


@pytest.mark.parametrize("from_step", [0, 2])
def test_a_pipelined_resume_is_bit_exact_and_counts_each_adamw_step_once(straight, from_step):
    """From the step-0 folder (a fresh AdamW's: its state stays empty, so the first update is counted once) and
    from step 2: the weights, every AdamW tensor and every metrics line of the uninterrupted run."""
    tmp_path, corpus, run_dir = straight
    resumed = resumed_copy(run_dir, tmp_path / "runs" / f"from{from_step}", [from_step])
    if from_step == 0:
        assert read_sharded_checkpoint(folder(resumed, 0))["optimizer"]["state"] == {}
    status, stdout, stderr = train_run(tmp_path, corpus, f"from{from_step}", 2, STAGES_2)
    assert status == 0 and f"step_{from_step:06d}.dcp at step {from_step}" in stdout, stderr
    assert_same_state(whole_state(folder(resumed, 4)), whole_state(folder(run_dir, 4)))
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(run_dir))


def test_a_flipped_bit_in_a_stage_s_shard_falls_back_to_the_older_checkpoint_on_every_rank(straight):
    """Stage 1's shard file of the newest folder damaged: every rank passes it over and resumes from step 2; the
    run ends on the uninterrupted run's bits."""
    tmp_path, corpus, run_dir = straight
    damaged = resumed_copy(run_dir, tmp_path / "runs" / "damaged", [2, 3])
    shard = folder(damaged, 3) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    # check_ranks_agree_on_resume refuses a run whose ranks found different checkpoints: a clean exit of both
    # ranks says both passed over the damaged folder.
    per_rank = run_main_on_ranks("train:main", arguments_of(tmp_path, corpus, "damaged", STAGES_2), 2, 240)
    assert [status for status, _, _ in per_rank] == [0, 0], per_rank
    stderr = "".join(err for _, _, err in per_rank)
    assert "__1_0.distcp does not match the size and CRC-32" in stderr and "passed over" in stderr
    assert "step_000002.dcp at step 2" in per_rank[0][1]
    assert_same_state(whole_state(folder(damaged, 4)), whole_state(folder(run_dir, 4)))


# ------------------------------------------------- The folder read whole is the old single file, bit for bit


def test_pipelined_folders_written_from_the_live_stages_hold_the_staged_ones_state_bit_for_bit(straight):
    """run.sharded_save = "overlapped" on 2 stages, each write slowed 0.5 s past the next step's forward and backward
    (tests/test_sharded_checkpoint.py's main_with_slow_writes): every folder equals the straight ("staged") run's of
    its step, bit for bit, since each stage's update waits for its write."""
    tmp_path, corpus, run_dir = straight
    arguments = arguments_of(tmp_path, corpus, "overlapped", STAGES_2, **{"run.sharded_save": "overlapped"})
    per_rank = run_main_on_ranks("tests.test_sharded_checkpoint:main_with_slow_writes", arguments, timeout_s=240)
    assert [status for status, _, _ in per_rank] == [0, 0], per_rank
    for step in range(5):
        assert_same_state(
            whole_state(folder(tmp_path / "runs" / "overlapped", step)), whole_state(folder(run_dir, step))
        )


def main_keeping_the_live_stages(argv: list[str]) -> int:
    """train.main on stage ranks, each rank of replica 0 keeping at every checkpoint its stage's live weights and
    AdamW state by parameter name, and its optimizer's group settings (in $LIVE_STATE/rank_step.pt): what the old
    path gathered to rank 0 for the single file."""
    import train

    real_save = train.Checkpointer.save

    def save_keeping_the_live_stage(self, counters, skips_in_a_row, at_once=False):
        pipeline, optimizer = self.training.pipeline, self.training.optimizer
        if pipeline.layout.replica == 0:
            live = {
                "model": {
                    pipeline.names[id(tensor)]: tensor.detach().clone()
                    for tensor in pipeline.stage_module.state_dict(keep_vars=True).values()
                },
                "optimizer": {
                    pipeline.names[id(parameter)]: {key: value.clone() for key, value in entries.items()}
                    for parameter, entries in optimizer.state.items()
                },
                "groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            }
            torch.save(live, Path(os.environ["LIVE_STATE"]) / f"{os.environ['RANK']}_{counters.steps}.pt")
        real_save(self, counters, skips_in_a_row, at_once)

    train.Checkpointer.save = save_keeping_the_live_stage
    return train.main(argv)


def single_file_of_live_stages(live_dir: Path, step: int, arguments: list[str]) -> dict:
    """The single file the old path wrote, assembled from the stages' live state: the model's state dict in the
    model's own order, and the state dict of one AdamW over the whole model (build_optimizer's groups, numbered
    as that optimizer numbers its parameters)."""
    config = load_config(arguments)
    model = build_model_on_meta(config.model, 256, config.data.seq_len)
    live = [torch.load(live_dir / f"{rank}_{step}.pt", weights_only=True) for rank in (0, 1)]
    weights = live[0]["model"] | live[1]["model"]
    moments = live[0]["optimizer"] | live[1]["optimizer"]
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    whole_groups = [
        [names[id(p)] for p in group["params"]] for group in build_optimizer(config.optim, model, CPU).param_groups
    ]
    order = [name for group in whole_groups for name in group]
    groups, first = [], 0
    for group_names, settings in zip(whole_groups, live[0]["groups"], strict=True):
        groups.append({**settings, "params": list(range(first, first + len(group_names)))})
        first += len(group_names)
    state = {number: moments[name] for number, name in enumerate(order) if name in moments}
    return {
        "model": {name: weights[name] for name in model.state_dict()},
        "optimizer": {"state": state, "param_groups": groups},
    }


def test_a_pipelined_folder_read_whole_is_the_old_single_file_of_the_live_stages(tmp_path, monkeypatch):
    """At steps 0 (empty AdamW state), 2 and 4 of a P = 2 run: whole_state of the folder equals, tensor for tensor
    and bit for bit, the single file gathered from the live stages as the old path gathered it."""
    corpus = uneven_corpus(tmp_path / "corpus")
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    monkeypatch.setenv("LIVE_STATE", str(live_dir))
    arguments = arguments_of(tmp_path, corpus, "live", STAGES_2, **{"run.checkpoint_every": 2})
    per_rank = run_main_on_ranks("tests.test_pipeline_checkpoint:main_keeping_the_live_stages", arguments, 2, 240)
    assert [status for status, _, _ in per_rank] == [0, 0], per_rank
    for step in (0, 2, 4):
        single_file = single_file_of_live_stages(live_dir, step, arguments)
        folder_read_whole = whole_state(folder(tmp_path / "runs" / "live", step))
        assert_same_state(folder_read_whole, single_file)
        assert folder_read_whole["optimizer"]["param_groups"] == single_file["optimizer"]["param_groups"]
    assert single_file["optimizer"]["state"][0]["step"].item() == 4.0


# ------------------------------------------------------------------ Resharding: the state, bit for bit


def stage_reload_worker(rank: int, world_size: int, arguments: list[str], checkpoint: str) -> dict:
    """A sharded folder read as a resume on pipeline stages reads it (build_training, restore_training_state), into
    a model built from another seed (nothing comes from the build): this rank's replica, and its stage's weights and
    AdamW state under the whole model's parameter names."""
    config = load_config(arguments)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo", build_layout(CPU, config.dist.pipeline_stages))
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    other = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed + 1)
    resume = read_sharded_checkpoint(Path(checkpoint))
    training = build_training(config, vocab_size, resume, context, model=other)
    restore_training_state(training, resume, config, context)
    pipeline = training.pipeline
    return {
        "replica": pipeline.layout.replica,
        "model": {
            pipeline.names[id(tensor)]: tensor.detach().clone()
            for tensor in pipeline.stage_module.state_dict(keep_vars=True).values()
        },
        "optimizer": {pipeline.names[id(p)]: dict(entries) for p, entries in training.optimizer.state.items()},
    }


def whole_from_stages(per_rank: list, arguments: list[str]) -> dict:
    """The reloaded stages of replica 0 joined, the optimizer's state numbered as one AdamW over the whole model
    numbers it; every other replica's stages hold the same bits."""
    config = load_config(arguments)
    model = build_model_on_meta(config.model, 256, config.data.seq_len)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    order = [names[id(p)] for group in build_optimizer(config.optim, model, CPU).param_groups for p in group["params"]]
    weights, moments = {}, {}
    for part in per_rank:
        if part["replica"] == 0:
            assert not weights.keys() & part["model"].keys()  # each tensor held by one stage
            weights |= part["model"]
            moments |= part["optimizer"]
    for part in per_rank:
        assert all(torch.equal(weights[name], tensor) for name, tensor in part["model"].items())
        for name, entries in part["optimizer"].items():
            assert all(torch.equal(moments[name][key], value) for key, value in entries.items()), name
    return {"model": weights, "optimizer": {"state": {n: moments[name] for n, name in enumerate(order)}}}


def test_the_state_comes_back_bit_for_bit_between_stages_fsdp2_ddp_and_one_process(straight, fsdp2_straight):
    """The P = 2 step-2 folder read by 2 fsdp2 ranks, 2 ddp ranks and 1 process; an fsdp2 D = 2 folder read by
    2 stages: every weight and AdamW tensor as saved (resharding copies, it computes nothing)."""
    tmp_path, corpus, run_dir = straight
    stages = whole_state(folder(run_dir, 2))
    arguments = arguments_of(tmp_path, corpus, "reload", {})
    for ranks, strategy in [(2, "fsdp2"), (2, "ddp"), (1, "ddp")]:
        assert_same_state(run_on_ranks(reload_worker, ranks, (arguments, str(folder(run_dir, 2)), strategy))[0], stages)
    sharded = folder(fsdp2_straight, 2)
    arguments = arguments_of(tmp_path, corpus, "reload", STAGES_2)
    per_rank = run_on_ranks(stage_reload_worker, 2, (arguments, str(sharded)))
    assert_same_state(whole_from_stages(per_rank, arguments), whole_state(sharded))


def test_the_state_comes_back_bit_for_bit_between_two_and_four_stages_and_a_two_by_two_mesh(straight):
    """The P = 2 step-2 folder read by 4 stages and by a D = 2 × P = 2 mesh (both replicas); a 4-stage folder read
    by 2 stages."""
    tmp_path, corpus, run_dir = straight
    saved = whole_state(folder(run_dir, 2))
    for layout in ({"dist.pipeline_stages": 4}, STAGES_2):  # on 4 ranks: 4 stages, or 2 replicas of 2
        arguments = arguments_of(tmp_path, corpus, "reload", layout)
        per_rank = run_on_ranks(stage_reload_worker, 4, (arguments, str(folder(run_dir, 2))), timeout_s=240)
        assert_same_state(whole_from_stages(per_rank, arguments), saved)
    status, _, stderr = train_run(tmp_path, corpus, "four", 4, {"dist.pipeline_stages": 4}, **{"run.max_steps": 2})
    assert status == 0, stderr
    four = folder(tmp_path / "runs" / "four", 2)
    arguments = arguments_of(tmp_path, corpus, "reload", STAGES_2)
    assert_same_state(
        whole_from_stages(run_on_ranks(stage_reload_worker, 2, (arguments, str(four))), arguments), whole_state(four)
    )


# --------------------------------------------- Resharding: a run continues there within fp32 reordering

# Steps 3 and 4 continued from a step-2 folder on another layout, against the uninterrupted run. The state loads bit
# for bit (the tests above); what differs is the order of fp32 sums: stages against one module, FSDP2's
# reduce-scatter against DDP's all-reduce or none, another A = 8 / (2·D) grouping of the same per-example
# gradients, the clipping norm summed over other pieces. Each sum is exact to a few ulps of its largest term, and
# two AdamW updates carry that through m/√v: 1e-5 of the largest weight bounds it by far, while a moment lost or
# misplaced (another parameter's, or zero) moves the weights of steps 3 and 4 by about the learning rate (~1e-3),
# 1e-2 of the largest weight. The losses logged at steps 3 and 4 are sums over the same tokens: 1e-5 too.
CONTINUED = {
    "stages-to-fsdp2": ("straight", 2, {"dist.strategy": "fsdp2"}),
    "stages-to-ddp": ("straight", 2, {}),
    "stages-to-one-process": ("straight", 1, {}),
    "two-stages-to-four": ("straight", 4, {"dist.pipeline_stages": 4}),
    "fsdp2-to-stages": ("fsdp2_straight", 2, STAGES_2),
}
MARKS = {"stages-to-ddp": pytest.mark.slow, "two-stages-to-four": pytest.mark.integration}


@pytest.mark.parametrize("name", [pytest.param(name, marks=MARKS.get(name, ())) for name in CONTINUED])
def test_a_run_continues_from_a_folder_on_another_layout_within_fp32_reordering(straight, request, name):
    tmp_path, corpus, run_dir = straight
    source, ranks, layout = CONTINUED[name]
    reference = run_dir if source == "straight" else request.getfixturevalue(source)
    moved = resumed_copy(reference, tmp_path / "runs" / name, [2])
    status, stdout, stderr = train_run(tmp_path, corpus, name, ranks, layout)
    assert status == 0 and "step_000002.dcp at step 2" in stdout, stderr
    last = folder(moved, 4)  # ddp and one process write the single file
    got = whole_state(last) if last.is_dir() else torch.load(last.with_suffix(".pt"), weights_only=True)
    expected = whole_state(folder(reference, 4))
    assert max_relative_error(list(got["model"].values()), [expected["model"][k] for k in got["model"]]) < 1e-5
    assert {entry["step"].item() for entry in got["optimizer"]["state"].values()} == {4.0}
    losses = [line["loss"] for line in read_metrics(moved)]
    assert losses == pytest.approx([line["loss"] for line in read_metrics(reference)], rel=1e-5)


# ------------------------------------------------------------------ A D = 2 × P = 2 mesh


def test_a_two_by_two_mesh_writes_folders_of_replica_0_and_resumes_bit_exactly(tmp_path):
    """D = 2 replicas of 2 stages: the folders hold the shards of replica 0's stages (replica 1's ranks hold copies
    and hand DCP nothing); a resume from step 2 ends on the uninterrupted run's bits and metrics lines."""
    corpus = uneven_corpus(tmp_path / "corpus")
    status, _, stderr = train_run(tmp_path, corpus, "mesh", 4, STAGES_2)
    assert status == 0, stderr
    run_dir = tmp_path / "runs" / "mesh"
    assert_only_folders(run_dir, 4)
    for checkpoint in (run_dir / "checkpoints").iterdir():  # ranks 2 and 3, replica 1: no tensor written
        assert [(checkpoint / f"__{rank}_0.distcp").stat().st_size for rank in (2, 3)] == [0, 0]
    resumed = resumed_copy(run_dir, tmp_path / "runs" / "mesh_again", [2])
    status, stdout, stderr = train_run(tmp_path, corpus, "mesh_again", 4, STAGES_2)
    assert status == 0 and "step_000002.dcp at step 2" in stdout, stderr
    assert_same_state(whole_state(folder(resumed, 4)), whole_state(folder(run_dir, 4)))
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(run_dir))
