"""The step on two gloo ranks: equal to the float64 full-batch reference for every label shape, gradients
synchronised only at the boundary (one all-reduce per step, counted in bytes), and the scheduler stepped
once per applied update."""

import contextlib
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import MicroBatch
from accumulation.counters import Counters
from accumulation.schedule import build_scheduler, lr_multiplier
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, counting_allreduce_hook, float64_reference_gradient, max_relative_error
from tests.test_step import CPU, FLOAT64_RTOL, micro_batches, new_model, training_step
from tests.test_step_label_shapes import (
    CLASSIFIER_LOSSES,
    classifier,
    classifier_micro_batches,
    prompt_masked_micro_batches,
    supervised_and_real,
)

# ----------------------------------------------------------------------------------------------------------
# Two gloo ranks.

# Per-rank micro-batches (supervised-token counts per row) of each two-rank scenario.
TWO_RANK_CASES = {
    "uneven ranks, one with a single token": {0: [[8, 8], [7, 6], [8, 5]], 1: [[1, 0], [0, 0], [0, 0]]},
    "one rank without tokens": {0: [[3, 8], [2, 6], [8, 1]], 1: [[0, 0], [0, 0], [0, 0]]},
    "partial final group": {0: [[8, 2], [5, 7], [4, 0]], 1: [[0, 0], [0, 0], [0, 0]]},
    "uneven everywhere": {0: [[8, 1], [2, 2], [8, 8]], 1: [[3, 4], [6, 0], [1, 1]]},
}


def case_batches(case: str, rank: int) -> list[MicroBatch]:
    return micro_batches(TWO_RANK_CASES[case][rank], seed=100 * rank + len(case))


def two_rank_equivalence_worker(rank, world_size):
    results = {}
    for case in TWO_RANK_CASES:
        model = DistributedDataParallel(new_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        # The accumulated gradients just before the boundary micro-batch's forward.
        before_boundary = []
        forwards = []

        def snapshot(module, args, forwards=forwards, before_boundary=before_boundary):
            forwards.append(1)
            if len(forwards) == 3:
                before_boundary.append([p.grad.clone() for p in module.parameters()])

        model.module.register_forward_pre_hook(snapshot)
        result = optimizer_step(StepSetup(model, CPU), case_batches(case, rank), optimizer)
        results[case] = {"after": captured[0], "before": before_boundary[0], "result": result}
    # A step with no supervised token anywhere: skipped on both ranks, nobody hangs.
    model = DistributedDataParallel(new_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results["all empty"] = optimizer_step(
        StepSetup(model, CPU, grad_clip=1.0), micro_batches([[0, 0], [0, 0]], seed=rank), optimizer
    )
    return results


def test_two_ranks_equal_the_full_batch_and_sync_only_at_the_boundary():
    per_rank = run_on_ranks(two_rank_equivalence_worker, world_size=2)
    model = new_model()
    for case in TWO_RANK_CASES:
        reference = float64_reference_gradient(model, case_batches(case, 0) + case_batches(case, 1))
        after = [r[case]["after"] for r in per_rank]
        # Bit-identical after the boundary all-reduce, and equal to the reference.
        assert all(torch.equal(a, b) for a, b in zip(after[0], after[1], strict=True)), case
        assert max_relative_error(after[0], reference) < FLOAT64_RTOL, case
        total = sum(sum(map(sum, TWO_RANK_CASES[case][rank])) for rank in (0, 1))
        results = [r[case]["result"] for r in per_rank]
        assert results[0].tokens == results[1].tokens == total
        assert results[0].loss == results[1].loss
        assert results[0].micro_batches == 3
    # Before the boundary each rank holds only its own unsynchronised partial sums (where it has tokens).
    before = [r["uneven everywhere"]["before"] for r in per_rank]
    assert any(not torch.equal(a, b) for a, b in zip(before[0], before[1], strict=True))
    for r in per_rank:
        result = r["all empty"]
        assert result.applied is False and result.skip_reason == "no supervised tokens in the step"
        assert (result.micro_batches, result.examples, result.tokens) == (2, 0, 0)


# Per-rank micro-batches of the other label shapes, with very uneven counts: the classifier's ranks hold
# 11 and 1 supervised examples, the prompt-masked rows' ranks 40 and 2 targets.
TWO_RANK_CLASSIFIER = {0: [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], 1: [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]}
TWO_RANK_PROMPT_MASKED = {
    0: [[(0, 8), (1, 8)], [(2, 8), (0, 8)], [(3, 7), (1, 8)]],
    1: [[(6, 8), (0, 0)], [(5, 5), (0, 0)], [(0, 0), (0, 0)]],
}


def two_rank_label_shape_cases(rank: int) -> dict:
    """case -> (the model, rank `rank`'s micro-batches, the step's loss_sum_fn, the reference gradient)."""
    classifier_batches = classifier_micro_batches(TWO_RANK_CLASSIFIER[rank], seed=200 + rank)
    cases = {
        f"classifier, {loss}": (classifier(), classifier_batches, loss_sum_fn, reference_gradient)
        for loss, (loss_sum_fn, reference_gradient) in CLASSIFIER_LOSSES.items()
    }
    prompt_masked_batches = prompt_masked_micro_batches(TWO_RANK_PROMPT_MASKED[rank], seed=300 + rank)
    cases["prompt-masked GPT rows"] = (
        new_model(),
        prompt_masked_batches,
        token_cross_entropy_sum,
        float64_reference_gradient,
    )
    return cases


def two_rank_label_shapes_worker(rank, world_size):
    """One step per case on this rank; the gradient the optimizer was handed, and the StepResult."""
    results = {}
    for case, (model, batches, loss_sum_fn, _) in two_rank_label_shape_cases(rank).items():
        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        result = optimizer_step(StepSetup(wrapped, CPU, loss_sum_fn=loss_sum_fn), batches, optimizer)
        results[case] = {"gradient": captured[0], "result": result}
    return results


def test_two_ranks_equal_the_full_batch_for_a_classifier_and_prompt_masked_rows():
    per_rank = run_on_ranks(two_rank_label_shapes_worker, world_size=2)
    cases_by_rank = [two_rank_label_shape_cases(rank) for rank in (0, 1)]
    for case, (model, rank0_batches, _, reference_gradient) in cases_by_rank[0].items():
        all_batches = rank0_batches + cases_by_rank[1][case][1]
        reference = reference_gradient(model, all_batches)
        gradients = [r[case]["gradient"] for r in per_rank]
        assert all(torch.equal(a, b) for a, b in zip(gradients[0], gradients[1], strict=True)), case
        assert max_relative_error(gradients[0], reference) < FLOAT64_RTOL, case
        for r in per_rank:
            assert (r[case]["result"].tokens, r[case]["result"].examples) == supervised_and_real(all_batches), case


def communication_worker(rank, world_size, bypass_no_sync, accumulation):
    if bypass_no_sync:
        # The mistake being measured: every micro-batch synchronises.
        DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    model = DistributedDataParallel(new_model(torch.float32), bucket_cap_mb=0.01)  # several buckets
    state = {"bytes": 0}
    model.register_comm_hook(state, counting_allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, "cosine", 2, 5, 0.1)
    counters = Counters()
    bytes_per_step, lrs = [], []
    for step in range(3):  # DDP rebuilds its buckets after the first iteration: count every step
        counts = [[8 - rank * 3, 2 + step]] * accumulation
        batches = micro_batches(counts, seed=10 * step + rank)
        state["bytes"] = 0
        training_step(model, batches, optimizer, scheduler, counters, grad_clip=1.0)
        bytes_per_step.append(state["bytes"])
        lrs.append(optimizer.param_groups[0]["lr"])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "bytes_per_step": bytes_per_step,
        "grad_bytes": grad_bytes,
        "lrs": lrs,
        "last_epoch": scheduler.last_epoch,
        "counters": counters,
    }


def test_one_gradient_all_reduce_per_step_counted_in_bytes():
    accumulation = 4
    synced = run_on_ranks(communication_worker, 2, args=(False, accumulation))
    bypassed = run_on_ranks(communication_worker, 2, args=(True, accumulation))
    for rank in (0, 1):
        grad_bytes = synced[rank]["grad_bytes"]
        assert synced[rank]["bytes_per_step"] == [grad_bytes] * 3
        assert bypassed[rank]["bytes_per_step"] == [accumulation * grad_bytes] * 3
        # The scheduler advanced once per applied update (3), not per micro-batch (12), on every rank.
        assert synced[rank]["last_epoch"] == 3 == synced[rank]["counters"].updates
        assert synced[rank]["counters"].micro_batches == 3 * accumulation
    assert synced[0]["lrs"] == synced[1]["lrs"]


@pytest.mark.parametrize("accumulation", [1, 3])
def test_scheduler_counts_applied_updates_only(accumulation):
    """After k applied updates, for any A: last_epoch == k and the lr is the schedule's value at k."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = build_scheduler(optimizer, "cosine", 3, 8, 0.1)
    counters = Counters()
    for step in range(6):
        counts = [[0, 0]] * accumulation if step == 2 else [[5, 3]] * accumulation  # step 2 has no tokens
        training_step(model, micro_batches(counts, seed=step), optimizer, scheduler, counters, grad_clip=1.0)
    assert counters.updates == 5 and counters.skipped == 1
    assert scheduler.last_epoch == 5
    # Independent arithmetic of the schedule at 5 updates: cosine after 3 warm-up updates, horizon 8.
    progress = (5 - 3) / (8 - 3)
    expected = 0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert lr_multiplier(5, "cosine", 3, 8, 0.1) * 0.5 == pytest.approx(expected, rel=1e-12)
