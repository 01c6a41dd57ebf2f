"""Sharded initialisation under dist.strategy = "fsdp2": the model is built on the meta device, sharded, then each
rank materialises and initialises its own shards (accumulation/parallel/fsdp.py, initialise_shards). No rank holds
the whole model, and the initial weights are those of a one-process build, bit for bit, at any world size."""

import ctypes
import resource

import pytest
import torch

import train
from accumulation.config.config import ConfigError, load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, build_model_on_meta, count_parameters, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.fsdp import full_model_state_dict
from accumulation.run import build
from testkit.ranks import run_main_on_ranks, run_on_ranks
from tests.test_train import tiny_settings, uneven_corpus

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


def build_under_limit_worker(rank: int, world_size: int, arguments: list[str], budget_bytes: int) -> dict:
    """build_training under an address-space limit (RLIMIT_AS) of what this rank maps before it plus
    `budget_bytes`: any allocation past it fails, as it would on a host without the memory. What the build
    raised (None when it fit) and how far the address space rose."""
    # Address space that is not memory, which would count against the limit as if it were: glibc reserves 64 MiB
    # per thread's malloc arena (one arena: M_ARENA_MAX, -8 in malloc.h), and with its moving mmap threshold keeps
    # freed tensors of up to 32 MiB in the heap, where fragments stay mapped (a fixed 1 MiB threshold,
    # M_MMAP_THRESHOLD, -3: every tensor above it is its own mapping, unmapped when freed).
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-8, 1)
    libc.mallopt(-3, 2**20)
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
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
