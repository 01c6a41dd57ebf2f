"""Stage-by-stage initialisation under dist.pipeline_stages > 1: the model is built on the meta device, cut into its
stages, and each rank materialises and initialises only its own stage (accumulation/parallel/pipeline.py,
initialise_stage). No rank holds the whole model; the initial weights are those of a one-process build, bit for bit,
for any P and D, so a pipelined run is the same run as one built whole. And the memory check counts what a rank
holds: its stage, not the whole model."""

import pytest
import torch

import train
from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.config.config import load_config
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, build_model_on_meta, count_parameters, resolved_vocab_size
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.mesh import build_layout
from accumulation.parallel.pipeline import stand_in_forward, whole_names
from accumulation.probe import InexactStep, probe_loss_and_model
from accumulation.run import build
from accumulation.step import token_cross_entropy_sum
from testkit.ranks import run_main_on_ranks, run_on_ranks
from tests.test_pipeline_train import PIPELINE_RUN, STAGES, comparable_metrics
from tests.test_sharded_init import build_under_limit_worker, whole_build_refused
from tests.test_step import CPU
from tests.test_train import final_weights, tiny_settings, uneven_corpus


def stage_weights_worker(rank: int, world_size: int, arguments: list[str]) -> dict:
    """build_training as train.py calls it, with the whole build forbidden: this rank's stage under the whole
    model's names, and the names of the parameters it left on the meta device."""
    build.build_model = whole_build_refused  # this forked rank's copy of the module only
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    layout = build_layout(CPU, config.dist.pipeline_stages)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo", layout)
    training = build.build_training(config, data.vocab_size, None, context)  # train.py's assembly
    names = whole_names(training.pipeline)
    stage = {names[name]: tensor for name, tensor in training.pipeline.stage_module.state_dict().items()}
    on_meta = [name for name, param in training.model.named_parameters() if param.is_meta]
    return {"stage": stage, "on_meta": on_meta, "device": str(next(iter(stage.values())).device)}


@pytest.mark.parametrize("world_size, stages", [(2, 2), (3, 3), (4, 2)], ids=["P2", "P3", "D2xP2"])
def test_stage_initial_weights_equal_a_one_process_build_bit_for_bit(tmp_path, world_size, stages):
    # 3 layers: 2 stages hold 2 blocks and 1; 3 stages one each. D = 2 × P = 2: the replicas' stages are equal too.
    corpus = uneven_corpus(tmp_path / "corpus")
    overrides = {"dist.pipeline_stages": stages, "model.n_layer": 3, "model.d_model": 24, "run.seed": 7}
    arguments = tiny_settings(tmp_path, corpus, **{**PIPELINE_RUN, **overrides})
    built = run_on_ranks(stage_weights_worker, world_size=world_size, args=(arguments,))
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    expected = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).state_dict()
    gathered = {}
    for rank, got in enumerate(built):
        assert got["device"] == "cpu"
        # The rank holds its stage only: every other parameter of the model is still shapes on the meta device.
        assert sorted(got["on_meta"]) == sorted(set(expected) - set(got["stage"])), rank
        for name, value in got["stage"].items():
            # Bit for bit: the same generator's draws in the same order, each stage keeping its own parameters;
            # a stage drawing only its own values would start the generator elsewhere and differ.
            assert torch.equal(value, expected[name]), (rank, name)
        gathered.update(got["stage"])
    assert sorted(gathered) == sorted(expected)  # the stages cover the model


def main_built_whole(argv: list[str]) -> int:
    """train.main in a rank that builds the whole model and keeps its stage, as pipelined runs did before they were
    built stage by stage (the model then says it cannot be built in parts)."""
    build.builds_in_parts = lambda model: False  # this forked rank's copy of the module only
    return train.main(argv)


def test_a_pipelined_run_built_by_stages_is_the_run_built_whole(tmp_path):
    # AdamW with dropout, 4 steps logged, validated and checkpointed every 2: the same initial values and the same
    # dropout streams (seeded after the build; the probe's stand-in outputs draw from a generator of their own), so
    # the same run, bit for bit: every logged figure and the final weights.
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**STAGES, "model.n_layer": 2, "model.dropout": 0.1, "run.log_every": 1, "run.checkpoint_every": 2}
    runs = {}
    for name, main in (("stages", "tests.test_sharded_init:main_without_whole_build"), ("whole", None)):
        arguments = tiny_settings(tmp_path, corpus, **settings, **{"run.name": name})
        if main is None:
            main = "tests.test_pipeline_init:main_built_whole"
        for status, _stdout, stderr in run_main_on_ranks(main, arguments, world_size=2):
            assert status == 0, stderr
        runs[name] = tmp_path / "runs" / name
    losses = [line["loss"] for line in comparable_metrics(runs["stages"]) if "loss" in line]
    assert len(losses) == 4
    assert comparable_metrics(runs["stages"]) == comparable_metrics(runs["whole"])
    built_by_stages, built_whole = (final_weights(runs[name]) for name in ("stages", "whole"))
    assert list(built_by_stages) == list(built_whole)
    for name, value in built_whole.items():
        assert torch.equal(built_by_stages[name], value), name


def token_mean(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the supervised targets: the bug step 0's probe refuses."""
    return token_cross_entropy_sum(outputs, labels) / (labels != IGNORE_INDEX).sum()


def test_step_zero_s_probe_on_a_model_built_by_stages_still_refuses_a_mean_and_passes_a_sum():
    # No rank can run the whole model's forward: the probe tests the loss on stand-in outputs of its shape (the
    # forward on the meta device), drawn from a generator of its own, so the global random state is left as it was.
    config = GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=16, vocab_size=64)
    with torch.device("meta"):
        model = GPT(config, seed=0)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = MicroBatch(tokens[:, :-1], tokens[:, 1:], 4)
    forward = stand_in_forward(model, CPU)
    state = torch.get_rng_state()
    assert probe_loss_and_model(forward, model, token_cross_entropy_sum, batch, CPU, "error") == []
    with pytest.raises(InexactStep, match=r"^step 0: the loss is a mean, not a sum over its targets"):
        probe_loss_and_model(forward, model, token_mean, batch, CPU, "error")
    assert torch.equal(torch.get_rng_state(), state)
    assert forward(batch.inputs).shape == (4, 8, 64) and forward(batch.inputs).device == CPU


def test_a_model_larger_than_a_ranks_memory_limit_builds_by_stages_on_2_ranks(tmp_path):
    # 20 blocks of d_model 384: 35.5 M parameters, 142 MB in fp32, each block's largest matrix 2.4 MB. Each of 2
    # pipeline ranks may map 90 % of the whole fp32 model: its stage (10 blocks and an embedding or the head, about
    # half) and one whole parameter at a time fit, the whole model does not (each rank built it whole before).
    corpus = uneven_corpus(tmp_path / "corpus")
    overrides = {**STAGES, "model.d_model": 384, "model.n_layer": 20, "model.n_head": 4, "optim.name": "sgd"}
    arguments = tiny_settings(tmp_path, corpus, **overrides)
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    meta = build_model_on_meta(config.model, resolved_vocab_size(config.model, data.vocab_size), config.data.seq_len)
    budget_bytes = int(0.9 * 4 * count_parameters(meta))
    built = run_on_ranks(build_under_limit_worker, world_size=2, args=(arguments, budget_bytes))
    for rank, result in enumerate(built):
        assert result["raised"] is None, f"rank {rank}: {result['raised']}"
        assert result["rise_bytes"] < budget_bytes
