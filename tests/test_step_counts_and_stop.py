"""The counts the caller gives the step, its one read-back per update, the stop flag carried to every rank,
and a fused AdamW overflow skipped exactly as GradScaler skips it."""

import copy
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import GlobalCounts
from accumulation.data.rows import make_rows
from accumulation.data.sources import step_row_ids, steps_per_epoch
from accumulation.data.step_tools import build_micro_batches, step_counts
from accumulation.step import StepSetup, optimizer_step
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient, max_relative_error
from tests.test_step import (
    CPU,
    FLOAT64_RTOL,
    SEQ_LEN,
    SINGLE_PROCESS_CASES,
    micro_batches,
    new_model,
    one_step_gradient,
)
from tests.test_step_label_shapes import supervised_and_real

# ----------------------------------------------------------------------------------------------------------
# The counts from the caller, the one read-back, and the stop flag.


def test_given_global_counts_give_the_same_update_as_counting_and_a_wrong_count_fails_the_reference():
    batches = micro_batches(SINGLE_PROCESS_CASES["token counts 1..full length"], seed=12)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    counted, counted_result = one_step_gradient(copy.deepcopy(model), batches)  # the fallback: counts the labels
    tokens, examples = supervised_and_real(batches)

    def step_with(counts):
        step_model = copy.deepcopy(model)
        optimizer = torch.optim.SGD(step_model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        result = optimizer_step(StepSetup(step_model, CPU), batches, optimizer, global_counts=counts)
        return captured[0], result

    given, given_result = step_with(GlobalCounts(tokens=tokens, examples=examples))
    assert all(torch.equal(a, b) for a, b in zip(given, counted, strict=True))  # the same bits
    assert (given_result.tokens, given_result.examples) == (counted_result.tokens, counted_result.examples)
    assert max_relative_error(given, reference) < FLOAT64_RTOL
    # A count off by one token scales the gradient by N / (N + 1): the reference comparison catches it.
    wrong, _ = step_with(GlobalCounts(tokens=tokens + 1, examples=examples))
    assert max_relative_error(wrong, reference) > 1e-3 > FLOAT64_RTOL


def test_one_read_back_per_update_when_the_counts_are_given(monkeypatch):
    """(loss sum, stop flag, OOM flag, grad norm) come back together in one tolist(); nothing else is read."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD keeps no step counter to read
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    batches = micro_batches([[8, 3], [5, 5], [2, 1], [7, 7]], seed=13)
    counts = GlobalCounts(*supervised_and_real(batches))
    reads.clear()
    result = optimizer_step(StepSetup(model, CPU, grad_clip=1.0), batches, optimizer, global_counts=counts)
    assert result.applied and reads == ["tolist"]


def answers(requested: bool):
    """A stop_requested callable, as train.py passes one (it reads a signal flag at the step's boundary)."""
    return lambda: requested


def test_the_stop_flag_comes_back_on_one_process():
    batches = micro_batches([[8, 3]], seed=14)
    for requested in (False, True):
        model = new_model(torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        result = optimizer_step(StepSetup(model, CPU), batches, optimizer, stop_requested=answers(requested))
        assert result.stop_requested is requested and result.applied


def stop_flag_worker(rank, world_size):
    model = DistributedDataParallel(new_model(torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step, stopping_rank in enumerate((None, 1, 0)):  # nobody, then rank 1 alone, then rank 0 alone
        batches = micro_batches([[8, 3], [5, 2]], seed=20 * step + rank)
        result = optimizer_step(
            StepSetup(model, CPU), batches, optimizer, stop_requested=answers(rank == stopping_rank)
        )
        results.append(result.stop_requested)
    empty = micro_batches([[0, 0]], seed=99)  # a step without tokens still carries the flag
    result = optimizer_step(StepSetup(model, CPU), empty, optimizer, stop_requested=answers(rank == 1))
    results.append(result.stop_requested)
    return results


def test_the_stop_flag_of_any_rank_reaches_every_rank():
    assert run_on_ranks(stop_flag_worker, 2) == [[False, True, True, True]] * 2


def test_grad_scaler_overflow_with_fused_adamw_skips_exactly_what_the_scaler_skips():
    """An injected overflow: the scaler's own inf check skips the fused AdamW step (weights and the optimizer's
    step counts unchanged), the scale halves, `applied` is False; the next step is applied."""
    model = new_model(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    first = optimizer_step(StepSetup(model, CPU, scaler=scaler), micro_batches([[8, 3]], seed=15), optimizer)
    assert first.applied
    weights = copy.deepcopy(model.state_dict())
    steps_before = [state["step"].clone() for state in optimizer.state.values()]
    handle = model.lm_head.weight.register_hook(lambda grad: grad * math.inf)
    overflow = optimizer_step(StepSetup(model, CPU, scaler=scaler), micro_batches([[8, 3]], seed=16), optimizer)
    handle.remove()
    assert not overflow.applied and overflow.skip_reason == "non-finite gradient (GradScaler lowered its scale)"
    assert not math.isfinite(overflow.grad_norm)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, state["step"]) for a, state in zip(steps_before, optimizer.state.values(), strict=True))
    assert scaler.get_scale() == 2.0**9
    after = optimizer_step(StepSetup(model, CPU, scaler=scaler), micro_batches([[8, 3]], seed=17), optimizer)
    assert after.applied and all(state["step"].item() == 2 for state in optimizer.state.values())
    assert (first.loss_scale, overflow.loss_scale, after.loss_scale) == (2.0**10, 2.0**10, 2.0**9)  # read back free


@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_the_counts_train_py_takes_from_row_ids_equal_the_labels_counts_over_all_ranks(tail):
    """train.py passes GlobalCounts from rows.supervised_counts(row_ids); the fallback counts the labels of every
    rank's micro-batches. Both must agree for every step and layout, the partial last step included."""
    documents = [bytes(range(3 + i % 11, 20 + 5 * i)) for i in range(30)]  # rows of many supervised lengths
    rows_of_corpus = make_rows(documents, SEQ_LEN)
    global_batch_size = 12
    for step in range(steps_per_epoch(rows_of_corpus.num_rows, global_batch_size, tail) + 1):
        row_ids = step_row_ids(rows_of_corpus.num_rows, global_batch_size, 3, step, tail)
        given = step_counts(rows_of_corpus, row_ids, step)
        for micro_batch_size, world_size in ((2, 2), (3, 1), (6, 2)):
            every = [
                mb
                for rank in range(world_size)
                for mb in build_micro_batches(
                    rows_of_corpus, row_ids, global_batch_size, micro_batch_size, world_size, rank, step=step
                )
            ]
            assert given == GlobalCounts(*supervised_and_real(every)), (step, micro_batch_size, world_size)
