"""The checker of the coding exercises on the last third of the guide (docs/exercises.md, 20 to 22): a pipeline
schedule, FSDP2's two switches, and GRPO's per-sequence mean. As in checks.py, each check runs the student's
function on the tiny float64 model and raises AssertionError, with what went wrong, unless it matches an
independent float64 reference of the whole step as one batch (tolerance RTOL = 1e-10; every bug costs 1e-2).
"""

import warnings

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from scripts.benchmarks.bench_fsdp import counting_fsdp_collectives
from scripts.teaching.exercises.checks import (
    IGNORE_INDEX,
    RANKS,
    RTOL,
    SEQ_LEN,
    VOCAB_SIZE,
    make_model,
    make_step,
    on_two_ranks,
    reference_gradient,
    relative_error,
)

REPLICAS = 2  # D of exercise 20: the pipeline's data replicas, run one after the other on the same two stages
CPU = torch.device("cpu")


def supervised_tokens(micro_batches: list) -> int:
    return sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)


# ---------------------------------------------------------------------------------------------------------
# Exercise 20: the pipeline recipe.
# ---------------------------------------------------------------------------------------------------------


def stage_of(rank: int):
    """The tiny model cut in two: stage 0 embeds (Embedding, Tanh), stage 1 projects (Linear)."""
    model = make_model()
    return model[:2] if rank == 0 else model[2:]


def pipeline_worker(rank: int, make_schedule, replica_steps: list, tokens: int) -> list:
    """One rank, one stage: for each data replica, a fresh copy of the stage, the student's schedule over that
    replica's micro-batches, and the stage's accumulated gradient."""
    gradients = []
    for micro_batches in replica_steps:
        module = stage_of(rank)
        stage = PipelineStage(module, rank, RANKS, CPU)
        schedule = make_schedule(stage, len(micro_batches), tokens, REPLICAS)
        if rank == 0:
            schedule.step(torch.cat([inputs for inputs, _ in micro_batches]))
        else:
            schedule.step(target=torch.cat([labels for _, labels in micro_batches]))
        assert all(p.grad is not None for p in module.parameters()), f"stage {rank} has no gradient after step()"
        gradients.append([p.grad.clone() for p in module.parameters()])
    return gradients


def check_pipeline_recipe(make_schedule) -> None:
    """Exercise 20: make_schedule(stage, n_microbatches, tokens, replicas) returns the pipeline schedule of one
    replica's step, so that after it has run on every replica, the mean of the replicas' stage gradients (what
    DDP around each stage computes) is the gradient of the token mean over all N supervised tokens of all
    replicas. The two stages run on 2 gloo ranks; the D = 2 replicas run one after the other on them, and the
    check averages them, as DDP would."""
    replica_steps = [make_step(seed=10), make_step(seed=11)]
    tokens = sum(supervised_tokens(step) for step in replica_steps)
    reference = reference_gradient(make_model(), replica_steps[0] + replica_steps[1])
    per_stage = on_two_ranks(pipeline_worker, make_schedule, replica_steps, tokens)
    # DDP's mean over the D replicas, stage by stage, then stage 0's parameters before stage 1's.
    gradient = [sum(replica[i] for replica in stage) / REPLICAS for stage in per_stage for i in range(len(stage[0]))]
    error = relative_error(gradient, reference)
    ratio = float(
        torch.cat([g.flatten() for g in gradient]).norm() / torch.cat([g.flatten() for g in reference]).norm()
    )
    assert error <= RTOL, (
        f"gradient off by {error:.3g} of its largest entry (allowed {RTOL:g}); its norm is {ratio:.3g} times the "
        "true one"
    )


# ---------------------------------------------------------------------------------------------------------
# Exercise 21: FSDP2's two switches.
# ---------------------------------------------------------------------------------------------------------

UNITS = 2  # the FSDP2 units that hold parameters: the embedding and the projection (the root holds none)


def fsdp_worker(rank: int, accumulate, micro_batches_per_rank: list, tokens: int) -> dict:
    """One FSDP2 rank: the tiny model sharded in units that stay gathered from forward to backward
    (reshard_after_forward=False), the student's accumulate() with the collectives counted, then the whole
    gradient and whether the parameters ended sharded."""
    # The Linear returns a view of its matmul on 3-d inputs; nothing here changes it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = make_model()
    for unit in (model[0], model[2]):
        fully_shard(unit, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    with counting_fsdp_collectives({}) as counts:
        accumulate(model, micro_batches_per_rank[rank], tokens, RANKS)
    # Every rank runs the same code, so either every rank has a gradient or none has: full_tensor() is safe.
    gradient = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"gradient": gradient, "counts": dict(counts), "sharded": sharded}


def check_fsdp_switches(accumulate) -> None:
    """Exercise 21: on D = 2 FSDP2 ranks, accumulate(model, micro_batches, tokens, ranks) leaves in each
    parameter's sharded .grad this rank's shard of the gradient of the token mean over all N tokens of both
    ranks, reduce-scatters each unit's gradient once per step (gradient sync on for the last micro-batch
    only), all-gathers each unit's parameters once per step (kept gathered from one micro-batch's backward to
    the next one's forward), and leaves the parameters sharded again at the end."""
    micro_batches_per_rank = [make_step(seed=12), make_step(seed=13)]
    tokens = sum(supervised_tokens(step) for step in micro_batches_per_rank)
    reference = reference_gradient(make_model(), micro_batches_per_rank[0] + micro_batches_per_rank[1])
    results = on_two_ranks(fsdp_worker, accumulate, micro_batches_per_rank, tokens)
    for rank, result in enumerate(results):
        # First: while they are gathered, model.parameters() lists the unsharded tensors, which hold no .grad.
        assert result["sharded"], f"rank {rank}: the parameters are still gathered after the step (reshard at the end)"
    for rank, result in enumerate(results):
        assert all(g is not None for g in result["gradient"]), (
            f"rank {rank}: a parameter has no sharded .grad: was the gradient sync on in the last micro-batch?"
        )
        error = relative_error(result["gradient"], reference)
        assert error <= RTOL, f"rank {rank}: gradient off by {error:.3g} of its largest entry (allowed {RTOL:g})"
    for rank, result in enumerate(results):
        counts = result["counts"]
        assert counts["reduce_scatters"] == UNITS, (
            f"rank {rank} reduce-scattered {counts['reduce_scatters']} times in the step, for {UNITS} units: only "
            "the last micro-batch should sync the gradient"
        )
        assert counts["all_gathers"] == UNITS, (
            f"rank {rank} all-gathered {counts['all_gathers']} times in the step, for {UNITS} units: keep the "
            "parameters gathered after each backward but the last"
        )


# ---------------------------------------------------------------------------------------------------------
# Exercise 22: GRPO's per-sequence mean under accumulation.
# ---------------------------------------------------------------------------------------------------------

ROWS_PER_MICRO_BATCH = (3, 1, 2, 2)  # micro-batches cut by a token budget: unequal numbers of sequences


def uneven_step(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's micro-batches of (inputs, labels) with ROWS_PER_MICRO_BATCH rows; each row (a response)
    supervises 1 to SEQ_LEN tokens."""
    generator = torch.Generator().manual_seed(seed)
    micro_batches = []
    for rows in ROWS_PER_MICRO_BATCH:
        inputs = torch.randint(VOCAB_SIZE, (rows, SEQ_LEN), generator=generator)
        targets = torch.randint(VOCAB_SIZE, (rows, SEQ_LEN), generator=generator)
        lengths = torch.randint(1, SEQ_LEN + 1, (rows, 1), generator=generator)
        micro_batches.append((inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)))
    return micro_batches


def sequence_mean_gradient(model, micro_batches: list) -> list[torch.Tensor]:
    """∇ of GRPO's aggregation written from its definition, over the whole step as one batch: the mean over
    sequences of each sequence's mean token loss, (1/C) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}."""
    inputs = torch.cat([inputs for inputs, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    token_losses = F.cross_entropy(
        model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    sequence_means = token_losses.sum(dim=1) / (labels != IGNORE_INDEX).sum(dim=1)
    return list(torch.autograd.grad(sequence_means.mean(), list(model.parameters())))


def check_sequence_mean(accumulate) -> None:
    """Exercise 22: accumulate(model, micro_batches, sequences) leaves in .grad the gradient of the mean over
    the step's `sequences` responses of each response's token mean, on micro-batches that hold 3, 1, 2 and 2
    responses."""
    model = make_model()
    micro_batches = uneven_step(seed=14)
    reference = sequence_mean_gradient(model, micro_batches)
    accumulate(model, micro_batches, sum(len(inputs) for inputs, _ in micro_batches))
    error = relative_error([p.grad for p in model.parameters()], reference)
    assert error <= RTOL, f"gradient off by {error:.3g} of its largest entry (allowed {RTOL:g})"
