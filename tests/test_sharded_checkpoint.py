"""fsdp2's sharded checkpoints (accumulation/run/sharded_checkpoint.py): a resume from step 0 or mid-run is bit
for bit, a damaged shard falls back to the older checkpoint, the state comes back bit for bit at another world
size or strategy, and a run continues there within fp32 reordering."""

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from accumulation.config.config import load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.fsdp import full_model_state_dict, full_optimizer_state_dict
from accumulation.run.build import build_optimizer, wrap_for_training
from accumulation.run.optimizer_state import load_optimizer_state
from accumulation.run.sharded_checkpoint import load_sharded_state, read_sharded_checkpoint, verify_files, whole_state
from testkit.disk import small_disk
from testkit.ranks import run_main_on_ranks, run_on_ranks
from testkit.reference import max_relative_error
from tests.test_train import comparable, read_metrics, tiny_settings, train_forked, uneven_corpus

CPU = torch.device("cpu")


def train_run(tmp_path, corpus, name: str, ranks: int, strategy: str, steps: int, **overrides) -> tuple[int, str, str]:
    settings = {"run.name": name, "dist.strategy": strategy, "run.max_steps": steps, "run.checkpoint_every": 1}
    return train_forked(tiny_settings(tmp_path, corpus, **settings, **{"run.keep_checkpoints": 10, **overrides}), ranks)


def newest(run_dir, kind: str = "dcp"):
    return sorted((run_dir / "checkpoints").glob(f"step_*.{kind}"))[-1]


def whole(run_dir) -> dict:
    """The newest checkpoint of a run as whole tensors, sharded folder or single file."""
    folders = sorted((run_dir / "checkpoints").glob("step_*.dcp"))
    files = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    if folders and (not files or folders[-1].name[:11] > files[-1].name[:11]):
        return whole_state(folders[-1])
    return torch.load(files[-1], weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for number, entries in a["optimizer"]["state"].items():
        assert entries.keys() == b["optimizer"]["state"][number].keys(), number
        for key, value in entries.items():
            assert torch.equal(value, b["optimizer"]["state"][number][key]), (number, key)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 AdamW steps of fsdp2 on 2 ranks, a checkpoint after every step, all kept: the reference below."""
    tmp_path = tmp_path_factory.mktemp("sharded_straight")
    corpus = uneven_corpus(tmp_path / "corpus")
    status, _, stderr = train_run(tmp_path, corpus, "straight", 2, "fsdp2", 4)
    assert status == 0, stderr
    return tmp_path, corpus


def resumed_copy(tmp_path, name: str, keep_steps: list[int]):
    """A copy of the straight run's directory holding only the checkpoints of `keep_steps`."""
    source, target = tmp_path / "runs" / "straight", tmp_path / "runs" / name
    shutil.copytree(source, target)
    for folder in (target / "checkpoints").glob("step_*.dcp"):
        if int(folder.name[5:11]) not in keep_steps:
            shutil.rmtree(folder)
    return target


def test_a_sharded_checkpoint_is_one_folder_with_every_rank_s_shards_and_their_checksums(straight):
    tmp_path, _ = straight
    folder = newest(tmp_path / "runs" / "straight")
    names = {path.name for path in folder.iterdir()}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt", "checksums.json"}
    assert not (folder.parent / "latest.pt").exists() and not list(folder.parent.glob(".*tmp"))
    state = whole_state(folder)
    # AdamW counted each of the 4 updates once, in every parameter's state
    assert {entry["step"].item() for entry in state["optimizer"]["state"].values()} == {4.0}
    assert state["counters"]["steps"] == 4 and set(state["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("from_step", [0, 2])
def test_a_resume_from_a_sharded_checkpoint_is_bit_exact_and_counts_each_adamw_step_once(straight, from_step):
    """From the step-0 checkpoint (a fresh optimizer's, whose state must stay empty: DCP's get_optimizer_state_dict
    would run a zero-gradient step on it, AdamW's step then 1 and every later update other) and from step 2."""
    tmp_path, corpus = straight
    run_dir = resumed_copy(tmp_path, f"from{from_step}", [from_step])
    if from_step == 0:
        assert read_sharded_checkpoint(newest(run_dir))["optimizer"]["state"] == {}
    status, stdout, stderr = train_run(tmp_path, corpus, f"from{from_step}", 2, "fsdp2", 4)
    assert status == 0 and f"resuming from {newest(run_dir).parent}/step_{from_step:06d}.dcp" in stdout, stderr
    assert_same_state(whole(run_dir), whole(tmp_path / "runs" / "straight"))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(tmp_path / "runs" / "straight"))


@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_a_damaged_shard_is_passed_over_for_the_older_checkpoint_and_a_killed_save_is_ignored(straight, damaged_rank):
    """A flipped bit in one rank's shard file of the newest checkpoint, either rank's (each rank checksums only its
    share of the files, the other's verdict comes by a gather): warned about, the step-2 checkpoint used on both
    ranks, the result that of the uninterrupted run. A temporary folder (a save killed before its rename) is no
    checkpoint and the next save removes it. keep_checkpoints = 2 leaves two folders."""
    tmp_path, corpus = straight
    run_dir = resumed_copy(tmp_path, f"damaged{damaged_rank}", [2, 3])
    shard = run_dir / "checkpoints" / "step_000003.dcp" / f"__{damaged_rank}_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    shutil.copytree(run_dir / "checkpoints" / "step_000002.dcp", run_dir / "checkpoints" / ".step_000009.dcp.tmp")
    keep = {"run.keep_checkpoints": 2}
    status, stdout, stderr = train_run(tmp_path, corpus, f"damaged{damaged_rank}", 2, "fsdp2", 4, **keep)
    assert status == 0, stderr
    assert f"__{damaged_rank}_0.distcp does not match the size and CRC-32" in stderr and "passed over" in stderr
    assert "step_000002.dcp at step 2" in stdout
    assert_same_state(whole(run_dir), whole(tmp_path / "runs" / "straight"))
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_000003.dcp", "step_000004.dcp"]


def main_counting_checksummed_bytes(argv: list[str]) -> int:
    """train.main in a rank that writes to $ACCUMULATION_TEST_COUNTS/rank<R>.json the bytes it checksummed of each
    file (through sharded_checkpoint.crc32_of, which streams every CRC-32 of a sharded checkpoint)."""
    import train
    from accumulation.run import sharded_checkpoint

    real_crc32_of, counted = sharded_checkpoint.crc32_of, {}

    def counting_crc32_of(path: Path) -> int:
        counted[str(path)] = counted.get(str(path), 0) + path.stat().st_size
        return real_crc32_of(path)

    sharded_checkpoint.crc32_of = counting_crc32_of
    try:
        return train.main(argv)
    finally:
        (Path(os.environ["ACCUMULATION_TEST_COUNTS"]) / f"rank{os.environ['RANK']}.json").write_text(
            json.dumps(counted)
        )


def test_each_rank_checksums_only_its_share_of_the_shard_files_at_a_resume(straight, monkeypatch):
    """A resume on 2 ranks from the 2-rank step-2 checkpoint: rank r reads shard file r once for its CRC-32 and not
    the other's (every rank read every file before), each rank the small files (state.pt, .metadata) it reads anyway;
    the resumed run ends as the uninterrupted one."""
    tmp_path, corpus = straight
    run_dir = resumed_copy(tmp_path, "counted", [2])
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv("ACCUMULATION_TEST_COUNTS", str(counts))
    settings = {"run.name": "counted", "dist.strategy": "fsdp2", "run.max_steps": 4, "run.checkpoint_every": 1}
    arguments = tiny_settings(tmp_path, corpus, **settings)
    per_rank = run_main_on_ranks("tests.test_sharded_checkpoint:main_counting_checksummed_bytes", arguments)
    assert [status for status, _, _ in per_rank] == [0, 0], per_rank
    folder = run_dir / "checkpoints" / "step_000002.dcp"
    sizes = {path.name: path.stat().st_size for path in folder.iterdir()}
    for rank in range(2):
        counted = json.loads((counts / f"rank{rank}.json").read_text())
        read = {Path(name).name: size for name, size in counted.items() if Path(name).parent == folder}
        expected = {f"__{rank}_0.distcp", ".metadata", "state.pt"}
        assert read == {name: sizes[name] for name in expected}, (rank, read)
    assert_same_state(whole(run_dir), whole(tmp_path / "runs" / "straight"))


def test_a_run_whose_only_checkpoint_is_damaged_is_refused_with_one_line(straight):
    tmp_path, corpus = straight
    run_dir = resumed_copy(tmp_path, "only_damaged", [4])
    (run_dir / "checkpoints" / "step_000004.dcp" / "__0_0.distcp").write_bytes(b"")
    status, _, stderr = train_run(tmp_path, corpus, "only_damaged", 2, "fsdp2", 6)
    assert status == 2
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert lines and "none of the 1 checkpoints" in lines[0] and "__0_0.distcp" in lines[0]


def reload_worker(rank: int, world_size: int, arguments: list[str], folder: str, strategy: str) -> dict:
    """A sharded checkpoint read as a resume reads it, into a fresh model and optimizer held under `strategy` on
    `world_size` ranks; the whole model and optimizer state gathered back on rank 0."""
    config = load_config(arguments + [f"dist.strategy={strategy}"])
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed + 1)
    wrap_for_training(model, config.dist, context, compile=False, param_dtype=None)
    optimizer = build_optimizer(config.optim, model, CPU)
    resume = read_sharded_checkpoint(Path(folder))
    load_sharded_state(resume, model, optimizer)
    load_optimizer_state(optimizer, resume["optimizer"])
    return {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(optimizer)}


@pytest.mark.integration  # 4 ranks and 5 launches: a minute on 2 cores
def test_the_state_comes_back_bit_for_bit_at_another_world_size_and_strategy(straight):
    """Resharding is a copy: the step-2 checkpoint of 2 fsdp2 ranks read by 4 fsdp2 ranks, by 2 ddp ranks and by
    1 process (a model built from another seed, so nothing comes from the build), and a 4-rank checkpoint by 2."""
    tmp_path, corpus = straight
    arguments = tiny_settings(tmp_path, corpus)
    folder = tmp_path / "runs" / "straight" / "checkpoints" / "step_000002.dcp"
    saved = whole_state(folder)
    for world_size, strategy in [(4, "fsdp2"), (2, "ddp"), (1, "ddp")]:
        assert_same_state(run_on_ranks(reload_worker, world_size, (arguments, str(folder), strategy))[0], saved)
    status, _, stderr = train_run(tmp_path, corpus, "four", 4, "fsdp2", 2)
    assert status == 0, stderr
    four = newest(tmp_path / "runs" / "four")
    assert_same_state(run_on_ranks(reload_worker, 2, (arguments, str(four), "fsdp2"))[0], whole_state(four))


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, strategy", [pytest.param(4, "fsdp2", marks=pytest.mark.integration), (2, "ddp"), (1, "ddp")]
)
def test_a_run_continues_from_a_sharded_checkpoint_at_another_world_size_or_strategy(straight, ranks, strategy):
    """Steps 3 and 4 from the 2-rank fsdp2 checkpoint of step 2 at another D or strategy, against the straight run.
    The state is loaded bit for bit (the test above); what differs is the order of fp32 sums: another D regroups
    the same per-example gradients (A = 8/(2·D) micro-batches of m = 2), DDP all-reduces where FSDP2
    reduce-scatters, and the clipping norm is summed over other pieces. Each such sum is exact to a few ulps of
    its largest term, and two AdamW updates carry that through m/√v: 1e-5 of the largest weight bounds it by far,
    while a moment lost or misplaced on the way moves the weights of steps 3 and 4 by about the learning rate
    (~1e-3), 1e-2 of the largest weight."""
    tmp_path, corpus = straight
    name = f"moved_{ranks}_{strategy}"
    run_dir = resumed_copy(tmp_path, name, [2])
    status, stdout, stderr = train_run(tmp_path, corpus, name, ranks, strategy, 4)
    assert status == 0 and "resuming from" in stdout, stderr
    moved, reference = whole(run_dir), whole(tmp_path / "runs" / "straight")
    assert max_relative_error(list(moved["model"].values()), list(reference["model"].values())) < 1e-5
    assert {entry["step"].item() for entry in moved["optimizer"]["state"].values()} == {4.0}
    losses = [line["loss"] for line in read_metrics(run_dir)]
    assert losses == pytest.approx([line["loss"] for line in read_metrics(tmp_path / "runs" / "straight")], rel=1e-5)


def main_signalled_at_step_3(argv: list[str]) -> int:
    """train.main with SIGTERM to rank 0 as step 3 begins (a stop request every rank learns of at that step)."""
    import train
    from accumulation.run import build

    real_optimizer_step, calls = build.optimizer_step, []

    def optimizer_step_signalled_at_step_3(*args, **options):
        calls.append(len(calls) + 1)
        if len(calls) == 3 and os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        return real_optimizer_step(*args, **options)

    build.optimizer_step = optimizer_step_signalled_at_step_3
    return train.main(argv)


def test_a_stop_signal_s_sharded_checkpoint_is_complete_before_exit_and_the_restart_is_bit_exact(straight):
    """SIGTERM as step 3 begins, checkpoints every 2 steps: the step-2 checkpoint is written in the background while
    step 3 trains; step 3's (off the cadence) is published before the ranks exit with 143; the restart ends with the
    state of the uninterrupted run."""
    tmp_path, corpus = straight
    settings = {"run.name": "signalled", "dist.strategy": "fsdp2", "run.max_steps": 4, "run.checkpoint_every": 2}
    arguments = tiny_settings(tmp_path, corpus, **settings, **{"run.keep_checkpoints": 10})
    per_rank = run_main_on_ranks("tests.test_sharded_checkpoint:main_signalled_at_step_3", arguments, world_size=2)
    assert [status for status, _, _ in per_rank] == [143, 143], per_rank
    run_dir = tmp_path / "runs" / "signalled"
    names = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert names == ["step_000000.dcp", "step_000002.dcp", "step_000003.dcp"]
    assert read_sharded_checkpoint(run_dir / "checkpoints" / "step_000003.dcp")["counters"]["steps"] == 3
    status, stdout, stderr = train_forked(arguments, 2)
    assert status == 0 and "at step 3" in stdout, stderr
    assert_same_state(whole(run_dir), whole(tmp_path / "runs" / "straight"))


def main_with_slow_writes(argv: list[str]) -> int:
    """train.main in a rank where a checkpoint's shard file is written 0.5 s late, long after the next step's
    forward and backward: an "overlapped" save whose update did not wait would write the next step's weights."""
    import time

    import train
    from accumulation.run import sharded_checkpoint

    real_write_data = sharded_checkpoint.ShardWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(0.5)
        return real_write_data(self, plan, planner)

    sharded_checkpoint.ShardWriter.write_data = slow_write_data
    return train.main(argv)


@pytest.mark.parametrize("how", ["overlapped", "at_once"])
def test_checkpoints_written_without_a_host_copy_hold_the_staged_ones_state_bit_for_bit(straight, how):
    """run.sharded_save = "overlapped" (from the live shards while the next step's forward and backward run, its
    update held until the write is done) and "at_once": each folder holds the straight run's ("staged") state of its
    step, bit for bit, though every write is slowed past the next step's forward and backward."""
    tmp_path, corpus = straight
    settings = {"run.name": how, "run.sharded_save": how, "run.checkpoint_every": 1, "run.keep_checkpoints": 10}
    arguments = tiny_settings(tmp_path, corpus, **{"dist.strategy": "fsdp2", "run.max_steps": 4}, **settings)
    per_rank = run_main_on_ranks("tests.test_sharded_checkpoint:main_with_slow_writes", arguments)
    assert [status for status, _, _ in per_rank] == [0, 0], per_rank
    folders = sorted((tmp_path / "runs" / how / "checkpoints").glob("step_*.dcp"))
    assert [folder.name for folder in folders] == [f"step_{step:06d}.dcp" for step in range(5)]
    for folder in folders:
        written = whole_state(folder)
        staged = whole_state(tmp_path / "runs" / "straight" / "checkpoints" / folder.name)
        assert_same_state(written, staged)
        assert written["counters"] == staged["counters"]


def full_disk_worker(rank: int, world_size: int, disk: str) -> str:
    """Two sharded saves of a small FSDP2 model with AdamW state into `disk`, the second after the disk was filled:
    the second's WriteError, as each rank sees it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accumulation.run.checkpoint import WriteError
    from accumulation.run.sharded_checkpoint import ShardedCheckpointWriter
    from testkit.disk import fill_disk

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(200, 200), mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 200)).sum().backward()
    optimizer.step()
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    writer = ShardedCheckpointWriter(Path(disk) / "checkpoints", 3, context)
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counters": {"steps": 2}}
    writer.save(payload, optimizer, 2)
    writer.finish()
    if rank == 0:
        fill_disk(Path(disk), leave_free_bytes=40_000)  # under one rank's shards (about 160 kB each)
    torch.distributed.barrier()
    try:
        writer.save(payload | {"counters": {"steps": 4}}, optimizer, 4)
        writer.finish()
    except WriteError as error:
        return str(error)
    return "no error"


def test_a_sharded_checkpoint_on_a_full_disk_is_one_line_and_the_older_ones_stay(tmp_path):
    """A real full disk (a small tmpfs) under the second save: every rank raises WriteError with one line naming
    the full disk and the newest complete checkpoint; no temporary folder is left and step 2's folder is whole."""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        messages = run_on_ranks(full_disk_worker, 2, (str(disk),))
        folder = disk / "checkpoints"
        assert sorted(path.name for path in folder.iterdir()) == ["step_000002.dcp"]
        verify_files(folder / "step_000002.dcp")
    for message in messages:
        assert "could not be written: the disk is full" in message and "\n" not in message, message
        assert "the newest complete checkpoint is step_000002.dcp" in message


def test_the_checkpoint_benchmark_measures_both_paths():
    """scripts/benchmarks/bench_checkpoint.py on one small model and 2 ranks: every figure of both paths present,
    a sharded save's blocked part within its whole, and the table printed from them."""
    from scripts.benchmarks.bench_checkpoint import measure, table

    [row] = measure(world_sizes=(2,), sizes=[(1, 32)])
    for path in ("old", "sharded"):
        for key in ("save_blocked_s", "save_total_s", "save_rise", "resume_s", "resume_rise"):
            assert row[f"{path} {key}"] >= 0, (path, key)
    for path in ("at-once", "overlapped"):  # saves only: the sharded resume reads the overlapped folder
        for key in ("save_blocked_s", "save_total_s", "save_rise"):
            assert row[f"{path} {key}"] >= 0, (path, key)
    for path in ("sharded", "overlapped"):
        assert row[f"{path} save_blocked_s"] <= row[f"{path} save_total_s"], path
    assert "sharded blocked / old blocked" in table([row]) and "overlapped" in table([row])


def test_a_killed_sharded_save_s_folder_is_this_program_s_and_a_sharded_checkpoint_is_a_run(tmp_path):
    """What a first fsdp2 attempt killed while writing its step-0 folder leaves (`.step_000000.dcp.tmp`) does not
    make the directory foreign to a fresh run; a published `step_000000.dcp` makes it a run to continue."""
    from accumulation.run.run_dir import RunDirectoryError, check_run_directory

    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / ".step_000000.dcp.tmp").mkdir(parents=True)
    check_run_directory(tmp_path / "run")
    (checkpoints / "notes.txt").write_text("a user's file")
    with pytest.raises(RunDirectoryError, match="notes.txt"):
        check_run_directory(tmp_path / "run")
    (checkpoints / "step_000000.dcp").mkdir()
    check_run_directory(tmp_path / "run")


def test_a_sharded_checkpoint_with_non_finite_weights_is_refused_with_one_line(straight):
    """A folder whose files all match their checksums but whose weights hold a NaN (written so, not damaged after):
    the shards' check as they load refuses it, exit 2, on 2 fsdp2 ranks."""
    import torch.distributed.checkpoint as dcp

    from accumulation.run.sharded_checkpoint import crc32_of, publish, split_payload

    tmp_path, corpus = straight
    run_dir = resumed_copy(tmp_path, "nan", [])
    state = whole_state(tmp_path / "runs" / "straight" / "checkpoints" / "step_000002.dcp")
    state["model"]["token_embedding.weight"][3, 5] = float("nan")
    moments = state["optimizer"]["state"]  # stand-ins numbered as the optimizer numbers its parameters
    optimizer = torch.optim.SGD([torch.nn.Parameter(moments[number]["exp_avg"]) for number in sorted(moments)])
    tensors, rest = split_payload(state, optimizer)
    temporary = run_dir / "checkpoints" / ".step_000002.dcp.tmp"
    dcp.save(tensors, checkpoint_id=temporary, no_dist=True)
    sums = {p.name: [p.stat().st_size, crc32_of(p)] for p in temporary.glob("__*.distcp")}
    publish(temporary, run_dir / "checkpoints" / "step_000002.dcp", rest, sums)
    status, _, stderr = train_run(tmp_path, corpus, "nan", 2, "fsdp2", 4)
    assert status == 2 and "its weights hold NaN or inf" in stderr, stderr


def test_keep_checkpoints_counts_the_sharded_folders_when_one_process_continues_a_fsdp2_run(straight):
    """The straight run's 5 folders (steps 0-4), continued on one process for 2 steps with keep_checkpoints = 3:
    the newest 3 of folders and files together remain (step_000004.dcp, step_000005.pt, step_000006.pt), not every
    folder beside the files."""
    tmp_path, corpus = straight
    resumed = resumed_copy(tmp_path, "kept", [0, 1, 2, 3, 4])
    settings = {"run.name": resumed.name, "run.max_steps": 6, "run.checkpoint_every": 1, "run.keep_checkpoints": 3}
    status, _, stderr = train_forked(tiny_settings(tmp_path, corpus, **settings), 1)
    assert status == 0, stderr
    names = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert names == ["latest.pt", "step_000004.dcp", "step_000005.pt", "step_000006.pt"], names


def test_one_process_reads_a_sharded_checkpoint_without_a_warning_on_stderr(straight):
    """whole_state (sample.py, export.py) and a one-process resume read the folder with dcp.load outside a process
    group, which torch warns about on every call: stderr is for errors, so no warning may escape."""
    tmp_path, corpus = straight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole_state(newest(tmp_path / "runs" / "straight"))
    resumed_copy(tmp_path, "quiet", [4])
    status, out, stderr = train_forked(tiny_settings(tmp_path, corpus, **{"run.name": "quiet", "run.max_steps": 5}), 1)
    assert status == 0, stderr
    assert "resuming from" in out and "step_000004.dcp" in out, out
    assert "Warning" not in stderr, stderr
