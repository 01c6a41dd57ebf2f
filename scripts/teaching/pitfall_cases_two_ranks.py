"""The pitfalls that need 2 gloo ranks (DDP's gradient sync, the token count across ranks, and the pipeline's
in pitfall_cases_pipeline.py), each a pair of twins: one run of 2 gloo ranks computes every twin, the parent
measures. scripts/teaching/pitfalls.py runs them."""

import contextlib

from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import all_reduce_ints
from scripts.teaching.pitfall_cases_pipeline import pipeline_pitfalls, pipeline_twins
from scripts.teaching.pitfall_setup import (
    ACCUMULATION_STEPS,
    ALLREDUCE_BYTES,
    BUG_MIN,
    CPU,
    GRADIENT_RTOL,
    RANK_DIVERGENCE,
    TWO_RANK_STEP_IDS,
    WORLD_SIZE,
    Measurement,
    correct_step,
    gpt,
    gradient_measurement,
    gradients,
    loss_sum,
    relative_difference,
    step_batches,
    tokens_in,
)
from testkit.ranks import run_on_ranks
from testkit.reference import counting_allreduce_hook, float64_reference_gradient, max_relative_error

# ---------------------------------------------------------------------------------------------------------
# Two-rank pitfalls: one run of 2 gloo ranks computes every twin; the parent measures.
# ---------------------------------------------------------------------------------------------------------


def counted_ddp_model() -> tuple[DistributedDataParallel, dict]:
    model = DistributedDataParallel(gpt())
    state = {"bytes": 0}
    model.register_comm_hook(state, counting_allreduce_hook)
    return model, state


def two_rank_twins(rank: int, world_size: int) -> dict:
    """Runs on each rank: the correct step, then the buggy loops, each on a fresh DDP model."""
    batches = step_batches(TWO_RANK_STEP_IDS, world_size, rank)
    last = len(batches) - 1
    results = {}

    model, sent = counted_ddp_model()
    results["correct"] = {"gradient": correct_step(model, batches), "bytes": sent["bytes"]}

    # 2. Each rank divides by its own token count; DDP then averages the D per-rank means, so a token on the
    # rank with 37 tokens weighs 128/37 times one on the rank with 128. torchtitan normalised per rank until
    # https://github.com/pytorch/torchtitan/pull/2206.
    model = DistributedDataParallel(gpt())
    tokens_local = tokens_in(batches)
    for k, mb in enumerate(batches):
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss_sum(model, mb) / tokens_local).backward()
    results["per-rank means"] = gradients(model)

    # 9. The forward outside no_sync: DDP decides at forward time whether the coming backward all-reduces,
    # so every micro-batch synchronises. The gradient is still right; the communication is A times larger.
    model, sent = counted_ddp_model()
    [tokens_global] = all_reduce_ints([tokens_local], CPU)
    loss_multiplier = world_size / tokens_global  # D / N, as in optimizer_step: DDP's mean over D undoes the D
    for k, mb in enumerate(batches):
        loss = loss_sum(model, mb)
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss * loss_multiplier).backward()
    results["forward outside no_sync"] = {"gradient": gradients(model), "bytes": sent["bytes"]}

    # 10. The sync boundary on the wrong micro-batch: the first synchronises, the last stays local. Each rank
    # steps with the all-reduced first micro-batch plus its own unsynchronised rest, and the replicas drift.
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        with model.no_sync() if k > 0 else contextlib.nullcontext():
            (loss_sum(model, mb) * loss_multiplier).backward()
    results["wrong sync boundary"] = gradients(model)

    # 22. The sync flag set after the forward, in the style of loops that write DDP's attribute by hand
    # (`model.require_backward_grad_sync = k == last`) instead of entering no_sync. DDP reads the flag during
    # the forward, so each forward uses the value set one micro-batch earlier: the first micro-batch finds the
    # default True and all-reduces its partial gradient, the last finds False and stays local. Each rank
    # steps with its own, different gradient.
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        loss = loss_sum(model, mb)
        model.require_backward_grad_sync = k == last  # the mistake: set after the forward that reads it
        (loss * loss_multiplier).backward()
    results["sync flag after the forward"] = gradients(model)

    # 15. Each loss divided by the global N, but not multiplied by D: DDP's mean over the ranks then divides
    # once more, so the gradient is the true one over D. TRL divides its count by the process count for this
    # reason (https://github.com/huggingface/trl/issues/5619 shows the line).
    model = DistributedDataParallel(gpt())
    for k, mb in enumerate(batches):
        with model.no_sync() if k < last else contextlib.nullcontext():
            (loss_sum(model, mb) / tokens_global).backward()  # the mistake: no × D
    results["times D forgotten"] = gradients(model)

    # 17. No sharding: every rank reads the same examples (rank 0's share, as a loader without a distributed
    # sampler does). The step itself is the project's, so the gradient is exactly that of half the batch,
    # counted twice: the other half of the global batch is never seen.
    model = DistributedDataParallel(gpt())
    results["same data on every rank"] = correct_step(model, step_batches(TWO_RANK_STEP_IDS, world_size, 0))

    # 23-25. The same two ranks as two pipeline stages (P = 2, D = 1).
    results["pipeline"] = pipeline_twins(rank, world_size)
    return results


def two_rank_pitfalls() -> list[Measurement]:
    per_rank = run_on_ranks(two_rank_twins, WORLD_SIZE)
    batches = [mb for rank in range(WORLD_SIZE) for mb in step_batches(TWO_RANK_STEP_IDS, WORLD_SIZE, rank)]
    reference = float64_reference_gradient(gpt(), batches)
    gradient_bytes = sum(p.numel() * p.element_size() for p in gpt().parameters())
    correct = [r["correct"] for r in per_rank]
    forward_outside = per_rank[0]["forward outside no_sync"]
    correct_divergence = relative_difference(correct[0]["gradient"], correct[1]["gradient"], reference)
    buggy_divergence = relative_difference(*(r["wrong sync boundary"] for r in per_rank), reference)
    flag_divergence = relative_difference(*(r["sync flag after the forward"] for r in per_rank), reference)
    correct_gradient = correct[0]["gradient"]  # rank 1's is bit-identical (row 10's correct column)
    return [
        gradient_measurement(
            "2. no cross-rank token normalization", per_rank[0]["per-rank means"], correct_gradient, reference
        ),
        gradient_measurement(
            "15. ×D compensation forgotten", per_rank[0]["times D forgotten"], correct_gradient, reference
        ),
        gradient_measurement(
            "17. same data on every rank", per_rank[0]["same data on every rank"], correct_gradient, reference
        ),
        Measurement(
            "9. forward outside no_sync",
            ALLREDUCE_BYTES,
            forward_outside["bytes"],
            correct[0]["bytes"],
            correct[0]["bytes"] == gradient_bytes,
            # Exactly this bug: A all-reduces instead of one, while the gradient itself stays right.
            forward_outside["bytes"] == ACCUMULATION_STEPS * gradient_bytes
            and max_relative_error(forward_outside["gradient"], reference) <= GRADIENT_RTOL,
            "one gradient's bytes",
        ),
        Measurement(
            "10. sync boundary on the wrong micro-batch",
            RANK_DIVERGENCE,
            buggy_divergence,
            correct_divergence,
            correct_divergence == 0,
            buggy_divergence >= BUG_MIN,
            "0: ranks bit-identical",
        ),
        Measurement(
            "22. sync flag set after the forward",
            RANK_DIVERGENCE,
            flag_divergence,
            correct_divergence,
            correct_divergence == 0,
            flag_divergence >= BUG_MIN,
            "0: ranks bit-identical",
        ),
        *pipeline_pitfalls([r["pipeline"] for r in per_rank]),
    ]
