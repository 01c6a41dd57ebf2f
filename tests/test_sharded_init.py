"""Sharded initialisation under dist.strategy = "fsdp2": the model is built on the meta device, sharded, then each
rank materialises and initialises its own shards (accumulation/parallel/fsdp.py, initialise_shards). No rank holds
the whole model, and the initial weights are those of a one-process build, bit for bit, at any world size."""

import ctypes
import math
import os
import resource

import pytest
import torch

import train
from accumulation.config.config import ConfigError, load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, build_model_on_meta, count_parameters, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.fsdp import full_model_state_dict
from accumulation.parallel.mesh import build_layout
from accumulation.run import build
from accumulation.run.sharded_checkpoint import verify_files
from testkit.ranks import run_main_on_ranks, run_on_ranks
from tests.test_train import read_metrics, tiny_settings, uneven_corpus

CPU = torch.device("cpu")


def whole_build_refused(*args, **kwargs):
    raise AssertionError("build_model was called: a rank built the whole model")


def sharded_weights_worker(rank: int, world_size: int, arguments: list[str]) -> dict:
    """build_training as train.py calls it, with the whole build forbidden; the weights gathered whole on rank 0."""
    build.build_model = whole_build_refused  # this forked rank's copy of the module only
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    training = build.build_training(config, data.vocab_size, None, context)  # train.py's assembly
    return full_model_state_dict(training.model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_initial_weights_equal_a_one_process_build_bit_for_bit(tmp_path, world_size):
    # d_model 24, 3 layers, seq_len 20: rows that 2 ranks split evenly and 3 ranks do not (20 positions), so
    # fully_shard's uneven last shard is covered; the vocabulary is the corpus's bytes.
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = tiny_settings(
        tmp_path,
        corpus,
        **{"dist.strategy": "fsdp2", "model.d_model": 24, "model.n_layer": 3, "data.seq_len": 20, "run.seed": 7},
    )
    gathered = run_on_ranks(sharded_weights_worker, world_size=world_size, args=(arguments,))[0]
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    expected = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).state_dict()
    assert list(gathered) == list(expected)
    for name, value in expected.items():
        # Bit for bit: the same generator's draws, each rank keeping its rows; any other order or seed differs.
        assert torch.equal(gathered[name], value), name


def status_bytes(field: str) -> int:
    """A size from /proc/self/status: VmSize, the address space mapped now; VmPeak, the most it has been."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def address_space_counts_memory() -> None:
    """Make an address-space limit (RLIMIT_AS) a limit on memory, by leaving out the address space glibc reserves
    without using, which would count against the limit as if it were memory: 64 MiB per thread's malloc arena (one
    arena: M_ARENA_MAX, -8 in malloc.h); freed tensors of up to 32 MiB kept in the heap by its moving mmap threshold,
    where fragments stay mapped (a fixed 1 MiB threshold, M_MMAP_THRESHOLD, -3: every tensor above it is its own
    mapping, unmapped when freed); and 8 MiB of stack per thread (RLIMIT_STACK's default), of which a thread here
    uses little (2 MiB for the threads started from now on: pthread_setattr_default_np)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-8, 1)
    libc.mallopt(-3, 2**20)
    attributes = ctypes.create_string_buffer(64)  # a pthread_attr_t: 56 bytes on x86-64, 64 on aarch64
    libc.pthread_attr_init(attributes)
    libc.pthread_attr_setstacksize(attributes, ctypes.c_size_t(2**21))
    libc.pthread_setattr_default_np(attributes)


def build_under_limit_worker(rank: int, world_size: int, arguments: list[str], budget_bytes: int) -> dict:
    """build_training (sharded, or by pipeline stages) under an address-space limit (RLIMIT_AS) of what this rank
    maps before it plus `budget_bytes`: any allocation past it fails, as it would on a host without the memory.
    What the build raised (None when it fit) and how far the address space rose."""
    address_space_counts_memory()
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo", build_layout(CPU, config.dist.pipeline_stages))
    before = status_bytes("VmSize")
    resource.setrlimit(resource.RLIMIT_AS, (before + budget_bytes, resource.RLIM_INFINITY))
    try:
        build.build_training(config, data.vocab_size, None, context)
        raised = None
    except (RuntimeError, MemoryError, ConfigError) as error:  # "DefaultCPUAllocator: can't allocate memory"
        raised = str(error).splitlines()[0]
    return {"raised": raised, "rise_bytes": status_bytes("VmPeak") - before}


def test_a_model_larger_than_a_ranks_memory_limit_builds_sharded_on_2_ranks(tmp_path):
    # 20 blocks of d_model 384: 35.5 M parameters, 142 MB in fp32, each block's largest matrix 2.4 MB. Each of
    # 2 ranks may map 90 % of the whole fp32 model: its shards (half) and one whole parameter at a time fit, the
    # whole model does not (the build before sharded initialisation raised here: each rank built it whole).
    corpus = uneven_corpus(tmp_path / "corpus")
    overrides = {"dist.strategy": "fsdp2", "model.d_model": 384, "model.n_layer": 20, "model.n_head": 4}
    arguments = tiny_settings(tmp_path, corpus, **overrides)
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    meta = build_model_on_meta(config.model, resolved_vocab_size(config.model, data.vocab_size), config.data.seq_len)
    whole_bytes = 4 * count_parameters(meta)
    budget_bytes = int(0.9 * whole_bytes)
    for rank, built in enumerate(run_on_ranks(build_under_limit_worker, world_size=2, args=(arguments, budget_bytes))):
        assert built["raised"] is None, f"rank {rank}: {built['raised']}"
        # The address space rose by about its half of the weights (71 MB) and stayed under the limit it ran in.
        assert built["rise_bytes"] < budget_bytes


def main_without_whole_build(argv: list[str]) -> int:
    """train.main in a rank where building the whole model raises."""
    build.build_model = whole_build_refused  # this forked rank's copy of the module only
    return train.main(argv)


def test_an_fsdp2_resume_builds_no_whole_model(tmp_path):
    # 2 steps, then 2 more from the sharded checkpoint, with the whole build forbidden in both sessions' ranks:
    # the resume reads its shards into a model built on the meta device (that it resumes bit for bit is
    # tests/test_fsdp.py's test_fsdp2_resume_is_bit_exact_with_dropout).
    corpus = uneven_corpus(tmp_path / "corpus")
    for steps in (2, 4):
        arguments = tiny_settings(tmp_path, corpus, **{"dist.strategy": "fsdp2", "run.max_steps": steps})
        outputs = run_main_on_ranks("tests.test_sharded_init:main_without_whole_build", arguments, world_size=2)
        for status, _stdout, stderr in outputs:
            assert status == 0, stderr
    assert "resum" in outputs[0][1].lower(), outputs[0][1]


# The GPT trained under a per-rank limit below its whole fp32 size: 40 blocks of d_model 512, 126.4 M parameters
# with the corpus's bytes, 505 MB in fp32; each block's largest matrix 4.2 MB.
LARGE_MODEL = {"model.d_model": 512, "model.n_layer": 40, "model.n_head": 4}
LIMIT_SHARE = 0.9  # of the whole fp32 model, what each rank may map over what it maps at its start


def main_under_memory_limit(argv: list[str]) -> int:
    """train.main in a rank whose address space may grow by $ACCUMULATION_TEST_BUDGET_BYTES over what it maps at its
    start: the memory check, the build, every step and every checkpoint run under that limit, as under `ulimit -v`."""
    address_space_counts_memory()
    budget_bytes = int(os.environ["ACCUMULATION_TEST_BUDGET_BYTES"])
    resource.setrlimit(resource.RLIMIT_AS, (status_bytes("VmSize") + budget_bytes, resource.RLIM_INFINITY))
    return train.main(argv)


def whole_build_under_limit_worker(rank: int, world_size: int, arguments: list[str], budget_bytes: int) -> str | None:
    """The whole model built in one process under the ranks' limit: what it raised, None when it fit."""
    address_space_counts_memory()
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    resource.setrlimit(resource.RLIMIT_AS, (status_bytes("VmSize") + budget_bytes, resource.RLIM_INFINITY))
    try:
        build.build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    except (RuntimeError, MemoryError, ConfigError) as error:  # the build's error, naming the model
        return str(error).splitlines()[0]
    return None


@pytest.mark.integration  # 4 ranks training a 126 M-parameter model: about 100 s on 2 cores
@pytest.mark.parametrize("world_size, optimizer", [(4, {"optim.name": "sgd", "optim.momentum": 0})], ids=["4-sgd"])
def test_a_model_larger_than_a_ranks_memory_limit_trains_and_checkpoints_sharded(
    tmp_path, monkeypatch, world_size, optimizer
):
    """Each rank holds 1/D of the weights and of their gradient and, with AdamW, of its moments: with SGD without
    momentum on 4 ranks 8/4 = 2 bytes per parameter, with AdamW on 8 ranks 16/8 = 2, where the whole model takes 4.
    A = 1: with more micro-batches each rank would accumulate the whole unsharded gradient between them (FSDP2 with
    its synchronisation off), 4 bytes per parameter again. On 2 ranks no optimizer fits: 1/2 + 1/2 is the whole."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {
        "dist.strategy": "fsdp2",
        **LARGE_MODEL,
        **optimizer,
        "batch.global_batch_size": world_size,  # m = 1, A = 1
        "batch.micro_batch_size": 1,
        "run.max_steps": 3,
        "run.log_every": 1,
        "run.eval_every": 0,
        "run.checkpoint_every": 2,
        # written from the shards, no copy; "staged", each rank would hold a host copy of its shards as well
        "run.sharded_save": "at_once",
    }
    arguments = tiny_settings(tmp_path, corpus, **settings)
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    meta = build_model_on_meta(config.model, resolved_vocab_size(config.model, data.vocab_size), config.data.seq_len)
    whole_bytes = 4 * count_parameters(meta)
    budget_bytes = int(LIMIT_SHARE * whole_bytes)
    # (a) The model does not fit whole under the limit: built in one process, it runs out of memory.
    raised = run_on_ranks(whole_build_under_limit_worker, world_size=1, args=(arguments, budget_bytes))[0]
    assert raised is not None and "allocate" in raised, raised
    # (b) Sharded on the ranks, under the same limit, it trains (the memory check lets it) and checkpoints.
    monkeypatch.setenv("ACCUMULATION_TEST_BUDGET_BYTES", str(budget_bytes))
    outputs = run_main_on_ranks(
        "tests.test_sharded_init:main_under_memory_limit", arguments, world_size=world_size, timeout_s=600
    )
    for rank, (status, _stdout, stderr) in enumerate(outputs):
        assert status == 0, f"rank {rank}: {stderr}"
    run_dir = tmp_path / "runs" / "default"
    losses = [record["loss"] for record in read_metrics(run_dir) if "loss" in record]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    folders = sorted((run_dir / "checkpoints").glob("step_*.dcp"))
    assert [folder.name for folder in folders] == ["step_000000.dcp", "step_000002.dcp", "step_000003.dcp"]
    verify_files(folders[-1])  # every rank's shard file complete, against its checksum
