"""Exact recovery from running out of memory (batch.on_oom = "shrink").

A GPU is not needed to test the logic: a model wrapper raises torch.OutOfMemoryError, as the CUDA caching
allocator does, whenever a forward gets more rows than a chosen limit. The step must then redo itself with
smaller micro-batches and give the update the larger micro-batches would have given: the same examples, the
same global denominator N, only the order of the float64 additions differs (a few ulps per term, far below
the 1e-10 relative tolerance used throughout tests/test_step.py), and it must match the float64 full-batch
reference computed independently (testkit/reference.py). The fused update after a retry is the update without
one.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from accumulation.data.rows import make_rows
from accumulation.data.sources import step_row_ids
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.shrink_on_oom import (
    ShrinkOnOutOfMemory,
    optimizer_step_shrinking_on_oom,
    smaller_micro_batch_size,
    split_micro_batches,
)
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient, max_relative_error

CPU = torch.device("cpu")
SEQ_LEN = 8
MODEL = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=16, vocab_size=256)
FLOAT64_RTOL = 1e-10  # float64 reordering only, as in tests/test_step.py


class RaisesAboveRows(nn.Module):
    """The model, except that a forward of more than `max_rows` rows runs out of memory at its end (after the
    model ran, so a failed attempt has drawn its dropout masks, as a real one would have)."""

    def __init__(self, model: nn.Module, max_rows: int):
        super().__init__()
        self.model, self.max_rows = model, max_rows
        self.rows_seen = []

    def forward(self, inputs):
        self.rows_seen.append(inputs.shape[0])
        outputs = self.model(inputs)
        if inputs.shape[0] > self.max_rows:
            raise torch.OutOfMemoryError(f"injected: {inputs.shape[0]} rows > {self.max_rows}")
        return outputs


def corpus_rows():
    documents = [bytes(range(i % 7, 40 + 3 * i)) for i in range(24)]  # rows of uneven supervised lengths
    return make_rows(documents, SEQ_LEN)


def step_batches(rows, global_batch_size, micro_batch_size, world_size=1, rank=0, tail_ids=None):
    row_ids = step_row_ids(rows.num_rows, global_batch_size, 5, 0, "drop")
    if tail_ids is not None:  # a partial step: fewer ids than G, the rest padding
        row_ids = row_ids[:tail_ids]
    return build_micro_batches(rows, row_ids, global_batch_size, micro_batch_size, world_size, rank, step=0)


def sgd_step(model, batches, shrink_on_oom=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    if shrink_on_oom:
        result = optimizer_step_shrinking_on_oom(
            StepSetup(model, CPU, strategy=ShrinkOnOutOfMemory(model)), batches, optimizer
        )
    else:
        result = optimizer_step(StepSetup(model, CPU), batches, optimizer)
    return captured[0], result


@pytest.mark.parametrize(("m", "expected"), [(8, 4), (6, 3), (9, 3), (7, 1), (2, 1), (1, None)])
def test_the_smaller_size_divides_m(m, expected):
    assert smaller_micro_batch_size(m) == expected


@pytest.mark.parametrize("tail_ids", [None, 11])
def test_split_micro_batches_are_what_the_smaller_size_builds(tail_ids):
    """The recovery's split reproduces build_micro_batches at m/2, padding and example counts included."""
    rows = corpus_rows()
    for rank in (0, 1):
        larger = step_batches(rows, 16, 4, world_size=2, rank=rank, tail_ids=tail_ids)
        smaller = step_batches(rows, 16, 2, world_size=2, rank=rank, tail_ids=tail_ids)
        split = split_micro_batches(larger, 2)
        assert len(split) == len(smaller) == 4
        for got, want in zip(split, smaller, strict=True):
            assert torch.equal(got.inputs, want.inputs) and torch.equal(got.labels, want.labels)
            assert got.num_examples == want.num_examples


def test_an_out_of_memory_step_is_redone_with_half_m_and_equals_the_larger_m_update():
    rows = corpus_rows()
    batches = step_batches(rows, 8, 8)  # m = 8, A = 1
    model = GPT(MODEL, seed=3).double()
    reference = float64_reference_gradient(model, batches)
    larger_m, larger_result = sgd_step(copy.deepcopy(model), batches)

    limited = RaisesAboveRows(copy.deepcopy(model), max_rows=2)
    recovered, result = sgd_step(limited, batches, shrink_on_oom=True)
    assert limited.rows_seen == [8, 4, 2, 2, 2, 2]  # 8 fails, 4 fails, then A = 4 micro-batches of 2
    assert (result.micro_batch_size, result.micro_batches) == (2, 4)
    assert (result.tokens, result.examples) == (larger_result.tokens, larger_result.examples)
    assert result.loss == pytest.approx(larger_result.loss, rel=FLOAT64_RTOL)
    assert result.applied
    assert max_relative_error(recovered, larger_m) < FLOAT64_RTOL
    assert max_relative_error(recovered, reference) < FLOAT64_RTOL


def test_the_retry_starts_from_the_steps_rng_state_so_dropout_matches_a_run_at_the_smaller_m():
    rows = corpus_rows()
    batches = step_batches(rows, 8, 4)
    config = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=16, vocab_size=256, dropout=0.3)
    model = GPT(config, seed=3).double()
    torch.manual_seed(11)
    at_smaller_m, _ = sgd_step(copy.deepcopy(model), split_micro_batches(batches, 2))
    torch.manual_seed(11)
    recovered, result = sgd_step(RaisesAboveRows(copy.deepcopy(model), max_rows=2), batches, shrink_on_oom=True)
    assert result.micro_batch_size == 2
    assert all(torch.equal(a, b) for a, b in zip(recovered, at_smaller_m, strict=True))  # the same bits


def test_without_shrink_or_at_one_row_the_error_is_raised():
    rows = corpus_rows()
    batches = step_batches(rows, 8, 4)
    model = GPT(MODEL, seed=3).double()
    with pytest.raises(torch.OutOfMemoryError):
        sgd_step(RaisesAboveRows(copy.deepcopy(model), max_rows=2), batches)
    with pytest.raises(torch.OutOfMemoryError):
        sgd_step(RaisesAboveRows(copy.deepcopy(model), max_rows=0), batches, shrink_on_oom=True)


def test_a_grad_scaler_step_redone_after_an_oom_leaves_the_scale_as_it_was():
    """unscale_ ran before the ranks learnt of the OOM; the redone step must not see a second unscale_, and the
    scale and its growth count must be those of the step's start."""
    rows = corpus_rows()
    batches = step_batches(rows, 8, 4)
    model = GPT(MODEL, seed=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # grows after every good step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    limited = RaisesAboveRows(model, max_rows=2)
    setup = StepSetup(limited, CPU, scaler=scaler, strategy=ShrinkOnOutOfMemory(limited))
    result = optimizer_step_shrinking_on_oom(setup, batches, optimizer)
    assert result.applied and result.micro_batch_size == 2
    assert scaler.get_scale() == 2.0**9  # one growth, for the one applied update


def two_rank_oom_worker(rank, world_size):
    rows = corpus_rows()
    model = GPT(MODEL, seed=3).double()
    batches = step_batches(rows, 16, 4, world_size=world_size, rank=rank)  # A = 2 per rank
    # Only rank 0 runs out of memory (above 1 row): rank 1 must learn it in the boundary all-reduce.
    limited = RaisesAboveRows(copy.deepcopy(model), max_rows=1 if rank == 0 else 4)
    recovered, result = sgd_step(DistributedDataParallel(limited), batches, shrink_on_oom=True)
    larger_m, _ = sgd_step(DistributedDataParallel(model), batches)
    all_rows = [step_batches(rows, 16, 4, world_size=world_size, rank=r) for r in range(world_size)]
    reference = float64_reference_gradient(GPT(MODEL, seed=3).double(), [mb for per in all_rows for mb in per])
    return {
        "m": result.micro_batch_size,
        "A": result.micro_batches,
        "rows_seen": limited.rows_seen,
        "vs_larger_m": max_relative_error(recovered, larger_m),
        "vs_reference": max_relative_error(recovered, reference),
        "recovered": recovered,
    }


def test_two_ranks_agree_on_the_smaller_m_when_one_of_them_runs_out_of_memory():
    rank0, rank1 = run_on_ranks(two_rank_oom_worker, 2)
    assert (rank0["m"], rank0["A"]) == (rank1["m"], rank1["A"]) == (1, 8)  # 4 -> 2 -> 1 on both ranks
    # Rank 0: 4 rows fail, it joins DDP's all-reduce with one row; 2 rows fail again the same way; then 8 x 1.
    assert rank0["rows_seen"] == [4, 1, 2, 1] + [1] * 8
    assert rank1["rows_seen"] == [4, 4, 2, 2, 2, 2] + [1] * 8  # rank 1 ran each attempt whole
    for result in (rank0, rank1):
        assert result["vs_larger_m"] < FLOAT64_RTOL and result["vs_reference"] < FLOAT64_RTOL
    assert all(torch.equal(a, b) for a, b in zip(rank0["recovered"], rank1["recovered"], strict=True))


class RaisesOnCalls(nn.Module):
    """The model, except that the forwards numbered in `failing_calls` (from 0) run out of memory at their end."""

    def __init__(self, model: nn.Module, failing_calls: set[int]):
        super().__init__()
        self.model, self.failing_calls = model, failing_calls
        self.rows_seen = []

    def forward(self, inputs):
        self.rows_seen.append(inputs.shape[0])
        outputs = self.model(inputs)
        if len(self.rows_seen) - 1 in self.failing_calls:
            raise torch.OutOfMemoryError("injected")
        return outputs


def syncing_forward_oom_worker(rank, world_size):
    rows = corpus_rows()
    model = GPT(MODEL, seed=3).double()
    batches = step_batches(rows, 16, 4, world_size=world_size, rank=rank)  # A = 2 per rank
    # Rank 0 fails in the forward of its LAST micro-batch, the one outside no_sync whose backward all-reduces.
    limited = RaisesOnCalls(copy.deepcopy(model), failing_calls={1} if rank == 0 else set())
    recovered, result = sgd_step(DistributedDataParallel(limited), batches, shrink_on_oom=True)
    all_rows = [step_batches(rows, 16, 4, world_size=world_size, rank=r) for r in range(world_size)]
    reference = float64_reference_gradient(model, [mb for per in all_rows for mb in per])
    return {
        "m": result.micro_batch_size,
        "rows_seen": limited.rows_seen,
        "vs_reference": max_relative_error(recovered, reference),
    }


def test_an_oom_in_the_forward_of_the_syncing_micro_batch_is_recovered_on_two_ranks():
    rank0, rank1 = run_on_ranks(syncing_forward_oom_worker, 2)
    assert rank0["m"] == rank1["m"] == 2
    assert rank0["rows_seen"] == [4, 4, 1, 2, 2, 2, 2]  # the failed forward, the one-row join, then A = 4
    assert rank1["rows_seen"] == [4, 4, 2, 2, 2, 2]
    assert rank0["vs_reference"] < FLOAT64_RTOL and rank1["vs_reference"] < FLOAT64_RTOL


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("injected in the backward")


class OutOfMemoryInEveryBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = GPT(MODEL, seed=3)

    def forward(self, inputs):
        return RaisesInBackward.apply(self.model(inputs))


def syncing_backward_worker(rank, world_size):
    batches = step_batches(corpus_rows(), 8, 8)
    try:
        sgd_step(DistributedDataParallel(OutOfMemoryInEveryBackward()), batches, shrink_on_oom=True)
    except RuntimeError as error:
        return (type(error).__name__, str(error))
    return None


def test_an_oom_in_the_syncing_backward_is_not_retried():
    """Under DDP the last backward has sent gradient buckets by then: the step says so instead of hanging."""
    [(kind, message)] = run_on_ranks(syncing_backward_worker, 1)
    assert kind == "RuntimeError" and "all-reduces the gradients" in message


def test_one_process_retries_an_oom_in_a_backward_down_to_one_row():
    with pytest.raises(torch.OutOfMemoryError):
        sgd_step(OutOfMemoryInEveryBackward(), step_batches(corpus_rows(), 8, 8), shrink_on_oom=True)


def test_running_out_of_memory_in_train_py_is_one_line(tmp_path, capsys, monkeypatch):
    """The CPU allocator's failure is a plain RuntimeError, CUDA's a torch.OutOfMemoryError: either ends train.py
    with one line naming m and what to do, exit 2, instead of an allocator traceback."""
    import train
    from accumulation.run import build
    from tests.test_train import tiny_settings, uneven_corpus

    corpus = uneven_corpus(tmp_path / "corpus")
    for error in (
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 4e13 bytes"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ):

        def out_of_memory(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(build, "optimizer_step", out_of_memory)
        out_dir = tmp_path / type(error).__name__
        assert train.main(tiny_settings(tmp_path, corpus, **{"run.out_dir": out_dir})) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: out of memory at batch.micro_batch_size=2 ("), lines
        assert "lower batch.micro_batch_size" in lines[0] and "Traceback" not in lines[0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_batch_on_oom_shrink_trains_through_train_py_as_the_default_does(tmp_path, capsys, ranks):
    """The option as a user sets it, through train.main for 3 steps: without an out-of-memory error the retry
    changes nothing, so its metrics lines and final weights equal the default run's."""
    from tests.test_train import comparable, final_weights, read_metrics, tiny_settings, train_as, uneven_corpus

    corpus = uneven_corpus(tmp_path / "corpus")
    runs = {}
    for on_oom in ("fail", "shrink"):
        settings = {"run.max_steps": 3, "run.name": on_oom, "batch.on_oom": on_oom}
        status, _, stderr = train_as("in-process", tiny_settings(tmp_path, corpus, **settings), ranks, capsys)
        assert status == 0, stderr
        runs[on_oom] = tmp_path / "runs" / on_oom
    assert [line["steps"] for line in read_metrics(runs["shrink"])] == [1, 2, 3]
    assert comparable(read_metrics(runs["shrink"])) == comparable(read_metrics(runs["fail"]))
    shrunk, default = final_weights(runs["shrink"]), final_weights(runs["fail"])
    assert all(torch.equal(shrunk[name], default[name]) for name in default)


# ------------------------------------------------------------------ The fused update with the out-of-memory retry

# float64: the retry's micro-batches add the same terms in another order, a few ulps (1e-16) apart. Adam's
# update g / (sqrt(v) + eps) keeps a gradient's relative error, so each update agrees to ~1e-12 of its size;
# a second update, a gradient of the failed attempt kept, or a skip lost is off by the whole update.
FUSED_RTOL = 1e-8


def fused_adamw_steps(shrink: bool):
    """Three steps of fused AdamW with a GradScaler, the second one's loss nan (a skip): without a memory
    limit, or with forwards above 2 rows running out of memory (every step redone at m = 4, then 2)."""
    rows = corpus_rows()
    model = GPT(MODEL, seed=3).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    module = RaisesAboveRows(model, max_rows=2) if shrink else model
    step_function = optimizer_step_shrinking_on_oom if shrink else optimizer_step
    strategy = ShrinkOnOutOfMemory(module) if shrink else None
    history = []
    for step in range(3):
        factor = math.nan if step == 1 else 1.0
        row_ids = step_row_ids(rows.num_rows, 8, 5, step, "drop")
        batches = build_micro_batches(rows, row_ids, 8, 8, 1, 0, step=step)  # m = 8, A = 1
        loss_sum_fn = lambda outputs, labels, factor=factor: token_cross_entropy_sum(outputs, labels) * factor  # noqa: E731
        setup = StepSetup(module, CPU, loss_sum_fn=loss_sum_fn, scaler=scaler, strategy=strategy)
        result = step_function(setup, batches, optimizer)
        state = [value.clone() for values in optimizer.state.values() for value in values.values()]
        history.append((result, [p.detach().clone() for p in model.parameters()], state, scaler.get_scale()))
    return history, module


def test_the_fused_update_after_an_out_of_memory_retry_is_the_update_without_one():
    initial = [p.detach().clone() for p in GPT(MODEL, seed=3).double().parameters()]
    plain, _ = fused_adamw_steps(shrink=False)
    shrunk, limited = fused_adamw_steps(shrink=True)
    assert limited.rows_seen[:6] == [8, 4, 2, 2, 2, 2]  # each step ran out of memory twice, then ran at m = 2
    for (result, weights, state, scale), (got, got_weights, got_state, got_scale) in zip(plain, shrunk, strict=True):
        assert (got.applied, got.skip_reason, got.micro_batch_size) == (result.applied, result.skip_reason, 2)
        assert got_scale == scale
        for value, expected, start in zip(got_weights, weights, initial, strict=True):
            assert (value - expected).abs().max() <= FUSED_RTOL * (expected - start).abs().max() + 1e-15
        for value, expected in zip(got_state, state, strict=True):
            assert (value - expected).abs().max() <= FUSED_RTOL * expected.abs().max() + 1e-30
    assert [result.applied for result, *_ in shrunk] == [True, False, True]
    steps = [value for value in shrunk[-1][2] if value.dim() == 0]
    assert steps and all(float(value) == 2.0 for value in steps)  # two updates, each applied once
