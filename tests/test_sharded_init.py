"""Sharded initialisation under dist.strategy = "fsdp2": the model is built on the meta device, sharded, then each
rank materialises and initialises its own shards (accumulation/parallel/fsdp.py, initialise_shards). No rank holds
the whole model, and the initial weights are those of a one-process build, bit for bit, at any world size."""

import os
import resource

import pytest
import torch

import train
from accumulation.config.config import load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.fsdp import full_model_state_dict
from accumulation.run import build
from testkit.ranks import run_main_on_ranks, run_on_ranks
from tests.test_train import PLAIN_SGD, read_metrics, tiny_settings, uneven_corpus

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


# A rank's address space above what it had at its start, in bytes; read in the rank (main_under_memory_limit).
BUDGET_VARIABLE = "ACCUMULATION_TEST_RANK_BUDGET_BYTES"


def vm_size_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main_under_memory_limit(argv: list[str]) -> int:
    """train.main with this rank's address space limited (RLIMIT_AS) to what it has now plus the budget: any
    allocation past it fails, as it would on a host without the memory."""
    limit = vm_size_bytes() + int(os.environ[BUDGET_VARIABLE])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return train.main(argv)
