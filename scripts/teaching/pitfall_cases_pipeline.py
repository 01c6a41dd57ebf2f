"""The pitfalls of pipeline parallelism, measured on 2 gloo ranks as 2 pipeline stages (P = 2, so D = 1: two
ranks, one data replica). Each is a pair of twins run directly on `torch.distributed.pipelining` with a tiny
token model split in two by hand; the correct twin is the recipe the project's pipelined step follows:

    last stage's loss per micro-batch = S_mb · D / N,   schedule built with scale_grads=False,

where S_mb is the micro-batch's sum of token losses and N the step's supervised targets over all replicas,
counted on the host from the labels. The schedule runs the A micro-batches of the step and backpropagates each
loss as it goes, so the stage's .grad is Σ_mb ∇S_mb · D / N: the pipeline schedule IS the accumulation group.

`pipeline_twins` runs on each rank inside the gallery's one two-rank launch (pitfall_cases_two_ranks.py calls
it); `pipeline_pitfalls` measures in the parent against the float64 full batch.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from accumulation.step import token_cross_entropy_sum
from scripts.teaching.pitfall_setup import (
    CPU,
    MODEL_SEED,
    STEP_IDS,
    VOCAB_SIZE,
    Measurement,
    clip_like_pytorch,
    gradient_measurement,
    step_batches,
    tokens_in,
)
from testkit.reference import float64_reference_gradient, full_batch_mean_loss, max_relative_error

PIPELINE_STAGES = 2  # P: the two ranks hold one stage each
DATA_REPLICAS = 1  # D = world size / P: two ranks, but one copy of the model, so one replica


def two_stage_model() -> nn.Sequential:
    """A token model cut by hand into two stages: stage 0 embeds and mixes, stage 1 mixes and projects to the
    vocabulary. The same float64 weights every time (a fixed seed, the caller's random state untouched)."""
    width = 16
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        first = nn.Sequential(nn.Embedding(VOCAB_SIZE, width), nn.Linear(width, width), nn.Tanh())
        last = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, VOCAB_SIZE))
    return nn.Sequential(first, last).double()


def pipelined_step(rank: int, loss_fn, scale_grads: bool, schedule_class=Schedule1F1B) -> tuple[nn.Module, list]:
    """One schedule.step over the step's A micro-batches on this rank's stage. Rank 0 feeds the inputs, rank 1
    the labels; the schedule cuts both into the same A chunks of m rows (the gallery's micro-batches).
    Returns the stage module (its .grad accumulated over the A micro-batches) and the losses the schedule
    kept per micro-batch (last stage only; empty on the first)."""
    batches = step_batches(STEP_IDS)
    stage_module = two_stage_model()[rank]
    stage = PipelineStage(stage_module, rank, PIPELINE_STAGES, CPU)
    schedule = schedule_class(stage, n_microbatches=len(batches), loss_fn=loss_fn, scale_grads=scale_grads)
    losses = []
    if rank == 0:
        schedule.step(torch.cat([mb.inputs for mb in batches]))
    else:
        schedule.step(target=torch.cat([mb.labels for mb in batches]), losses=losses)
    return stage_module, losses


def stage_gradients(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def pipeline_twins(rank: int, world_size: int) -> dict:
    """Runs on each of the 2 ranks: every pipelined twin, each on a fresh copy of the weights. Returns this
    rank's stage gradients by twin; the parent concatenates stage 0's and stage 1's in parameter order."""
    assert world_size == PIPELINE_STAGES * DATA_REPLICAS
    batches = step_batches(STEP_IDS)
    tokens_global = tokens_in(batches)  # N, counted on the host from the labels: no collective needed

    def normalised_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # S_mb · D / N: each micro-batch's sum of token losses over the GLOBAL count, so the A backward passes
        # the schedule runs add up to ∇(Σ S_mb / N) = ∇L. D = 1 here: the two ranks are stages, not replicas.
        return token_cross_entropy_sum(outputs, labels) * DATA_REPLICAS / tokens_global

    results = {}
    for name, schedule_class in (("1F1B", Schedule1F1B), ("GPipe", ScheduleGPipe)):
        module, _ = pipelined_step(rank, normalised_loss, scale_grads=False, schedule_class=schedule_class)
        results[f"correct {name}"] = stage_gradients(module)

    # 23. The schedule's default scale_grads=True: after the last backward it divides every accumulated
    # gradient by the number of micro-batches. That is right for A equal-sized MEAN losses (their mean is
    # the batch mean), wrong for a loss already normalised by the global count: the gradient is ∇L / A.
    # torchtitan hit it with accumulation on top of the schedule (https://github.com/pytorch/torchtitan/issues/1733).
    module, _ = pipelined_step(rank, normalised_loss, scale_grads=True)
    results["scale_grads default"] = stage_gradients(module)

    # 24. The loss normalised after the schedule: the schedule backpropagates the raw sum S_mb, and the
    # division by N happens on the losses it hands back, for the log only. The logged loss is right; the
    # gradient is N times too large. torchtitan's trainer shipped this shape
    # (https://github.com/pytorch/torchtitan/issues/2972), and its Forge trainer again (PR #4194).
    module, losses = pipelined_step(rank, token_cross_entropy_sum, scale_grads=False)
    results["normalised after the schedule"] = stage_gradients(module)
    if losses:  # the last stage: the mistake's only division, after every backward has run
        results["logged loss after the schedule"] = float(sum(losses).detach() / tokens_global)

    # 25. Clipping each stage by its own norm: clip_grad_norm_ sees only this rank's parameters, so each
    # stage is scaled by max_norm / |g_stage| instead of one factor max_norm / |g| for the whole model, and
    # the update turns (torchtitan fixed it in https://github.com/pytorch/torchtitan/pull/649). The correct
    # twin sums the stages' squared norms over the pipeline group and clips every stage with that one norm.
    max_norm = clip_threshold()
    module, _ = pipelined_step(rank, normalised_loss, scale_grads=False)
    torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)  # the mistake: this stage's norm only
    results["one stage's clip norm"] = stage_gradients(module)

    module, _ = pipelined_step(rank, normalised_loss, scale_grads=False)
    squared_norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()]) ** 2
    dist.all_reduce(squared_norm)  # over the pipeline group (here every rank): |g|² = Σ_stages |g_stage|²
    torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, squared_norm.sqrt())
    results["whole-model clip norm"] = stage_gradients(module)
    return results


def clip_threshold() -> float:
    """A threshold that bites: a tenth of the norm of the step's true gradient (float64 full batch)."""
    reference = float64_reference_gradient(two_stage_model(), step_batches(STEP_IDS))
    return 0.1 * float(torch.cat([g.flatten() for g in reference]).norm())


def pipeline_pitfalls(per_rank: list[dict]) -> list[Measurement]:
    """The parent's half: the stages' gradients joined into the model's, each twin against the float64 full
    batch of the same step on the unsplit model (clipped for row 25)."""
    batches = step_batches(STEP_IDS)
    reference = float64_reference_gradient(two_stage_model(), batches)

    def whole(name: str) -> list[torch.Tensor]:
        """The model's gradient: stage 0's parameters, then stage 1's, as the unsplit model lists them."""
        return [g for rank in per_rank for g in rank[name]]

    # The correct column is the worse of the two schedules: 1F1B and GPipe order the same backward passes
    # differently, and both must land on the reference.
    correct = max(
        (whole(f"correct {name}") for name in ("1F1B", "GPipe")), key=lambda g: max_relative_error(g, reference)
    )
    normalised_after = gradient_measurement(
        "24. pipeline loss normalised after the schedule", whole("normalised after the schedule"), correct, reference
    )
    # Exactly this bug: the gradient is off while the loss it logs is the step's true mean loss, which is
    # why the logs never showed it. Float64 sums in another order: 1e-12 relative is rounding, not a bug.
    inputs, labels = torch.cat([mb.inputs for mb in batches]), torch.cat([mb.labels for mb in batches])
    with torch.no_grad():
        true_loss = float(full_batch_mean_loss(two_stage_model()(inputs), labels))
    logged_loss = per_rank[-1]["logged loss after the schedule"]
    normalised_after.bug_shown &= abs(logged_loss - true_loss) <= 1e-12 * true_loss
    clipped_reference = clip_like_pytorch(reference, clip_threshold())
    return [
        gradient_measurement(
            "23. pipeline scale_grads left at its default", whole("scale_grads default"), correct, reference
        ),
        normalised_after,
        gradient_measurement(
            "25. pipeline clip norm of one stage",
            whole("one stage's clip norm"),
            whole("whole-model clip norm"),
            clipped_reference,
            described="float64 full batch, clipped",
        ),
    ]
