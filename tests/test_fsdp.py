"""dist.strategy = "fsdp2": the same exact step as DDP with sharded parameters, gradients and optimizer state,
one reduce-scatter per group and update, and checkpoints that move between ddp, fsdp2 and world sizes."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import train
from accumulation import checker as check_equivalence
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_row_ids
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.factory import build_model, resolved_vocab_size
from accumulation.parallel.distributed import DistributedContext
from accumulation.parallel.fsdp import full_model_state_dict, full_optimizer_state_dict
from accumulation.run.build import build_optimizer, build_training
from accumulation.run.optimizer_state import load_optimizer_state
from accumulation.step import optimizer_step
from scripts.benchmarks.bench_fsdp import counting_fsdp_collectives, padded_gradient_bytes, sync_in_every_micro_batch
from testkit.ranks import pretend_launched, run_on_ranks
from testkit.reference import float64_reference_gradient, max_relative_error
from tests.test_check_equivalence import reported_relative_error, run_checker_with_stderr
from tests.test_sharded_checkpoint import whole
from tests.test_step import FLOAT64_RTOL
from tests.test_train import (
    PLAIN_SGD,
    REPO,
    comparable,
    read_metrics,
    tiny_settings,
    train_forked,
    uneven_corpus,
)

CPU = torch.device("cpu")
GLOBAL_BATCH_SIZE = 8  # tiny_settings' G: (m, A, D) = (4, 1, 2) and (1, 4, 2)
# fp32 under ddp and fsdp2: each rank accumulates the same micro-batch gradients in the same order; only the
# collective differs (DDP's all-reduce and mean, FSDP2's reduce-scatter with ReduceOp.AVG), and each sums the
# same D = 2 terms per entry, so the updates differ by at most an ulp or so of an entry. 1e-6 of the largest
# update entry is about 8 ulps of it; a wrong weighting or a missed rank is off by 1e-2 or more.
FP32_RTOL = 1e-6
# bf16 all-gathered weights and autocast: 8 mantissa bits, a relative error of a few 1e-3 per product, which
# the backward compounds; the same bound as the bf16 autocast test of tests/test_step.py.
BF16_RTOL = 5e-2


@pytest.fixture
def corpus(tmp_path):
    return uneven_corpus(tmp_path / "corpus")


def settings(tmp_path, corpus, **overrides) -> list[str]:
    return tiny_settings(tmp_path, corpus, **{**PLAIN_SGD, **overrides})


def one_update_worker(rank: int, world_size: int, cases: dict) -> dict:
    """For each case (config arguments, dtype): one optimizer_step on this rank's micro-batches of step 0, as
    train.py runs it (wrap, then the optimizer), and the whole weights afterwards (on rank 0); the whole
    optimizer state too, under "<case> optimizer"."""
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    weights = {}
    for name, (arguments, dtype) in cases.items():
        config = load_config(arguments)
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        model = build_model(
            config.model,
            resolved_vocab_size(config.model, data.vocab_size),
            seq_len=config.data.seq_len,
            seed=config.run.seed,
        ).to(dtype)
        training = build_training(config, data.vocab_size, None, context, model=model)  # train.py's assembly
        optimizer = training.optimizer
        row_ids = step_row_ids(data.train.num_rows, GLOBAL_BATCH_SIZE, config.run.seed, 0, config.batch.tail)
        micro_batches = build_micro_batches(
            data.train, row_ids, GLOBAL_BATCH_SIZE, config.batch.micro_batch_size, world_size, rank, step=0
        )
        training.step(training.setup, micro_batches, optimizer)
        weights[name] = full_model_state_dict(model)
        weights[f"{name} optimizer"] = full_optimizer_state_dict(optimizer)
        if name == "fsdp2 adamw":
            weights["reloaded"] = reloaded_optimizer_state(config, model, optimizer, weights[f"{name} optimizer"])
    return weights


def reloaded_optimizer_state(config, model, optimizer, whole_state: dict) -> dict:
    """A resume of the FSDP2 optimizer: every rank loads the whole state (rank 0's gathered copy, as each rank
    reads it from the checkpoint) into a fresh optimizer. Each moment must come back as this rank's shard,
    placed as its parameter is: the same placements, the same local values. (Sharded along another
    dimension, the step still ran, with gloo warnings and three times slower.)"""
    box = [whole_state]
    dist.broadcast_object_list(box, src=0)
    reloaded = build_optimizer(config.optim, model, CPU)
    load_optimizer_state(reloaded, box[0], sharded=True)
    found = {"parameters": len(list(model.parameters())), "moments": 0, "misplaced": [], "different": []}
    for parameter in model.parameters():
        for key, value in reloaded.state[parameter].items():
            if key == "step":
                continue
            found["moments"] += 1
            if not isinstance(value, DTensor) or value.placements != parameter.placements:
                found["misplaced"].append(key)
            elif not torch.equal(value.to_local(), optimizer.state[parameter][key].to_local()):
                found["different"].append(key)
    return found


def updates(initial: dict, after: dict) -> list[torch.Tensor]:
    """initial - after, per parameter: with SGD at lr 1 and nothing else, the gradient the update applied."""
    return [initial[name].double() - after[name].double() for name in initial]


def test_one_sgd_update_under_fsdp2_equals_ddp_and_the_float64_reference(tmp_path, corpus):
    cases = {}
    for micro in (4, 1):  # (m, A, D) = (4, 1, 2) and (1, 4, 2)
        for strategy in ("ddp", "fsdp2"):
            arguments = settings(tmp_path, corpus, **{"batch.micro_batch_size": micro, "dist.strategy": strategy})
            cases[f"{strategy} m{micro}"] = (arguments, torch.float32)
        fsdp2 = settings(tmp_path, corpus, **{"batch.micro_batch_size": micro, "dist.strategy": "fsdp2"})
        cases[f"fsdp2 float64 m{micro}"] = (fsdp2, torch.float64)
    # bf16 (MixedPrecisionPolicy and autocast), and a model without fsdp_units(), sharded whole.
    cases["fsdp2 bf16 m1"] = (cases["fsdp2 m1"][0] + ["precision.dtype=bf16"], torch.float32)
    for strategy in ("ddp", "fsdp2"):  # AdamW (the default optimizer) for its state: two moments per parameter
        adamw = tiny_settings(tmp_path, corpus, **{"batch.micro_batch_size": 1, "dist.strategy": strategy})
        cases[f"{strategy} adamw"] = (adamw, torch.float32)
        gru = settings(tmp_path, corpus, **{"batch.micro_batch_size": 1, "dist.strategy": strategy})
        cases[f"{strategy} gru"] = (gru + ["model.name=gru"], torch.float32)
    per_rank = run_on_ranks(one_update_worker, world_size=2, args=(cases,))
    weights = per_rank[0]
    for rank, found in enumerate(per_rank):  # the FSDP2 optimizer state, loaded again: where it was, as it was
        reloaded = found["reloaded"]
        assert reloaded["moments"] == 2 * reloaded["parameters"]  # AdamW: exp_avg and exp_avg_sq of each
        assert reloaded["misplaced"] == [] and reloaded["different"] == [], (rank, reloaded)

    config = load_config(cases["fsdp2 m1"][0])
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    model = build_model(
        config.model,
        resolved_vocab_size(config.model, data.vocab_size),
        seq_len=config.data.seq_len,
        seed=config.run.seed,
    )
    initial = model.state_dict()
    row_ids = step_row_ids(data.train.num_rows, GLOBAL_BATCH_SIZE, config.run.seed, 0, config.batch.tail)
    everything = build_micro_batches(data.train, row_ids, GLOBAL_BATCH_SIZE, GLOBAL_BATCH_SIZE, 1, 0, step=0)
    reference = float64_reference_gradient(model, everything)  # one float64 batch of all 8 examples
    for micro in (4, 1):
        ddp, fsdp2 = updates(initial, weights[f"ddp m{micro}"]), updates(initial, weights[f"fsdp2 m{micro}"])
        assert max_relative_error(fsdp2, ddp) <= FP32_RTOL, micro
        assert max_relative_error(updates(initial, weights[f"fsdp2 float64 m{micro}"]), reference) < FLOAT64_RTOL
    assert max_relative_error(updates(initial, weights["fsdp2 bf16 m1"]), updates(initial, weights["fsdp2 m1"])) < (
        BF16_RTOL
    )
    # The checkpoint's optimizer entry is DDP's: parameter numbers, keys, whole shapes, settings; values to fp32.
    ddp_state, fsdp2_state = weights["ddp adamw optimizer"], weights["fsdp2 adamw optimizer"]
    assert fsdp2_state["param_groups"] == ddp_state["param_groups"]
    assert fsdp2_state["state"].keys() == ddp_state["state"].keys() and len(ddp_state["state"]) == len(initial)
    for number, state in ddp_state["state"].items():
        assert fsdp2_state["state"][number].keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert fsdp2_state["state"][number][key].shape == value.shape, (number, key)
            assert max_relative_error([fsdp2_state["state"][number][key]], [value]) <= FP32_RTOL, (number, key)
    gru_config = load_config(cases["ddp gru"][0])
    gru_initial = build_model(
        gru_config.model,
        resolved_vocab_size(gru_config.model, data.vocab_size),
        seq_len=gru_config.data.seq_len,
        seed=gru_config.run.seed,
    ).state_dict()
    gru_ddp, gru_fsdp2 = updates(gru_initial, weights["ddp gru"]), updates(gru_initial, weights["fsdp2 gru"])
    assert max_relative_error(gru_fsdp2, gru_ddp) <= FP32_RTOL


def communication_worker(rank: int, world_size: int, arguments: list[str]) -> dict:
    """Counted collectives of one fsdp2 update with A = 4, with and without the step's no-sync; then the
    GradScaler on sharded gradients where only rank 0's shard holds an inf."""
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    model = build_model(
        config.model,
        resolved_vocab_size(config.model, data.vocab_size),
        seq_len=config.data.seq_len,
        seed=config.run.seed,
    )
    training = build_training(config, data.vocab_size, None, context, model=model)  # train.py's assembly
    wrapped, optimizer, setup = training.setup.module, training.optimizer, training.setup
    row_ids = step_row_ids(data.train.num_rows, GLOBAL_BATCH_SIZE, config.run.seed, 0, config.batch.tail)
    micro_batches = build_micro_batches(data.train, row_ids, GLOBAL_BATCH_SIZE, 1, world_size, rank, step=0)
    found = {}
    counts, seen_at_forward = {}, []
    hook = wrapped.register_forward_pre_hook(lambda module, args: seen_at_forward.append(counts["reduce_scatters"]))
    with counting_fsdp_collectives(counts):
        optimizer_step(setup, micro_batches, optimizer)
    found["synced"] = dict(counts, seen_at_forward=seen_at_forward)
    hook.remove()
    with counting_fsdp_collectives(counts), sync_in_every_micro_batch():
        optimizer_step(setup, micro_batches, optimizer)
    found["sync_every"] = dict(counts)

    # GradScaler: the inf check runs on each rank's shards; FSDP2's DTensor gradients reduce the found-inf flag
    # over the ranks, so rank 1, whose own shards are finite, must skip the update too.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    inputs, labels = micro_batches[0].inputs, micro_batches[0].labels
    scaler.scale(torch.nn.functional.cross_entropy(wrapped(inputs).flatten(0, 1), labels.flatten())).backward()
    first = next(model.parameters())
    if rank == 0:
        first.grad.to_local().view(-1)[0] = math.inf
    before = [param.to_local().clone() for param in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    found["scale"] = scaler.get_scale()
    after = [param.to_local() for param in model.parameters()]
    found["weights_unchanged"] = all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    return found


def test_fsdp2_reduce_scatters_once_per_group_per_update_and_the_grad_scaler_agrees(tmp_path, corpus):
    arguments = settings(tmp_path, corpus, **{"batch.micro_batch_size": 1, "dist.strategy": "fsdp2"})
    config = load_config(arguments)
    groups = config.model.n_layer + 1  # each block, and the root with the rest
    gradient_bytes = padded_gradient_bytes(config, 2)
    for rank, found in enumerate(run_on_ranks(communication_worker, world_size=2, args=(arguments,))):
        synced = found["synced"]
        # Nothing before the last micro-batch's backward (A = 4 forwards, none preceded by a reduce-scatter),
        # then one reduce-scatter per group, carrying the whole gradient once.
        assert synced["seen_at_forward"] == [0, 0, 0, 0], rank
        assert synced["reduce_scatters"] == groups and synced["reduce_scatter_bytes"] == gradient_bytes, rank
        # Synchronising every micro-batch sends it A times: what the no-sync saves.
        assert found["sync_every"]["reduce_scatters"] == 4 * groups
        assert found["sync_every"]["reduce_scatter_bytes"] == 4 * gradient_bytes
        assert found["scale"] == 512.0 and found["weights_unchanged"], rank


@pytest.mark.parametrize("launched", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_the_equivalence_checker_passes_under_fsdp2(tmp_path, capsys, monkeypatch, launched):
    """scripts/checks/check_equivalence.py with fsdp2 on 2 forked ranks (and under torchrun, launched): the gradient
    handed to the optimizer, gathered whole from the shards (testkit/reference.py's probe), against the float64
    full batch."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the script imports this checkout's accumulation/
    status, stdout, _ = run_checker_with_stderr(tmp_path, ["dist.strategy=fsdp2"], 2, capsys, launched)
    assert status == 0, stdout
    assert "model: FSDPGPT (gpt)" in stdout and stdout.splitlines()[-1] == "PASS"
    assert reported_relative_error(stdout) < check_equivalence.RELATIVE_TOLERANCE["fp32"]


DROPOUT_RUN = {"model.dropout": 0.2, "schedule.decay_updates": 4, "run.checkpoint_every": 2, "run.sample_bytes": 0}


def train_run(tmp_path, corpus, name: str, ranks: int, strategy: str, steps: int) -> str:
    """train.main on `ranks` forked gloo ranks (tests/test_train.py, train_forked); rank 0's stdout."""
    overrides = {**DROPOUT_RUN, "run.name": name, "run.max_steps": steps, "dist.strategy": strategy}
    status, stdout, stderr = train_forked(tiny_settings(tmp_path, corpus, **overrides), ranks)
    assert status == 0, stderr
    return stdout


@pytest.fixture(scope="module")
def fsdp2_straight(tmp_path_factory):
    """4 steps of fsdp2 on 2 ranks with dropout, uninterrupted: the reference of the two tests below."""
    tmp_path = tmp_path_factory.mktemp("fsdp2_straight")
    corpus = uneven_corpus(tmp_path / "corpus")
    stdout = train_run(tmp_path, corpus, "straight", 2, "fsdp2", 4)
    assert "fsdp2: 2 groups (1 from fsdp_units() and the root)" in stdout
    return tmp_path, corpus


@pytest.mark.slow
def test_fsdp2_resume_is_bit_exact_with_dropout(fsdp2_straight):
    """As tests/test_train.py's resume test, under fsdp2: 4 steps straight equal 2, a restart, and 2 more."""
    tmp_path, corpus = fsdp2_straight
    train_run(tmp_path, corpus, "resumed", 2, "fsdp2", 2)
    assert "resuming from" in train_run(tmp_path, corpus, "resumed", 2, "fsdp2", 4)
    a, b = tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed"
    for key, value in whole(a)["model"].items():
        assert torch.equal(value, whole(b)["model"][key]), key
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))


@pytest.mark.slow
def test_checkpoints_move_between_ddp_fsdp2_and_world_sizes(fsdp2_straight):
    """2 steps under ddp, 2 under fsdp2 from ddp's checkpoint (against 4 straight under fsdp2), then 2 more
    under ddp on one process from fsdp2's checkpoint: ddp's single file read by fsdp2, fsdp2's sharded folder
    (accumulation/run/sharded_checkpoint.py) read by ddp."""
    tmp_path, corpus = fsdp2_straight
    train_run(tmp_path, corpus, "moving", 2, "ddp", 2)
    assert "resuming from" in train_run(tmp_path, corpus, "moving", 2, "fsdp2", 4)
    reference = whole(tmp_path / "runs" / "straight")["model"]
    weights = whole(tmp_path / "runs" / "moving")["model"]
    # The same dropout masks (D unchanged: every rank's generator restored) and fp32 reordering in the
    # collective only (all-reduce vs reduce-scatter of the same two terms), carried through 4 AdamW updates:
    # ulps. An optimizer state lost on the way (moments restarted) moves each weight of steps 3 and 4 by about
    # the learning rate (~1e-3) instead, 1e-2 of the largest weights: 1e-5 separates the two by far.
    assert max_relative_error([weights[key] for key in reference], list(reference.values())) < 1e-5
    losses = [line["loss"] for line in read_metrics(tmp_path / "runs" / "moving")]
    assert losses == pytest.approx([line["loss"] for line in read_metrics(tmp_path / "runs" / "straight")], rel=1e-5)
    # fsdp2's checkpoint on one process under ddp (A = 8 instead of 4; dropout reseeded for the new D).
    assert "resuming from" in train_run(tmp_path, corpus, "moving", 1, "ddp", 6)
    final = torch.load(tmp_path / "runs" / "moving" / "checkpoints" / "latest.pt", weights_only=True)
    # AdamW's own step counter went on from fsdp2's 4 (a restarted optimizer state would say 2).
    assert {state["step"].item() for state in final["optimizer"]["state"].values()} == {6.0}
    assert final["counters"]["steps"] == 6


@pytest.mark.parametrize(
    "arguments, world_size, named",
    [
        (["dist.strategy=fsdp2"], 1, "dist.strategy"),  # nothing to shard over
        (["dist.strategy=fsdp2", "batch.on_oom=shrink"], 2, "batch.on_oom"),  # recovery is DDP's only
        (["dist.strategy=zero3"], 1, "dist.strategy"),
    ],
)
def test_bad_fsdp2_combinations_are_one_line_exit_2_nothing_written(
    tmp_path, capsys, monkeypatch, arguments, world_size, named
):
    pretend_launched(monkeypatch, world_size)  # main checks the world before any process group exists
    out_dir = tmp_path / "runs"
    assert train.main(arguments + [f"run.out_dir={out_dir}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0]
    assert not out_dir.exists()


def test_the_fsdp_benchmark_measures_both_strategies_and_its_marks_pass():
    """scripts/benchmarks/bench_fsdp.py's own measuring and table on a small model (the README's command ran into a
    KeyError once, when the DDP branch stopped running): every figure present, DDP's all-reduce is the whole
    gradient, and every target the table marks holds."""
    from scripts.benchmarks.bench_fsdp import measure, table

    small = ("model.n_layer=1", "model.n_head=2", "model.d_model=16", "data.seq_len=16")
    results = measure(small)
    assert results["ddp"]["ddp_allreduce_bytes_per_update"] == results["grad_bytes"]
    marks = {name: mark for name, _, _, mark in table(results) if mark}
    assert marks and set(marks.values()) == {"PASS"}, marks
