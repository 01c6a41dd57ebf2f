"""Print every number quoted in docs/accumulation.md, computed by the project's own code.

    python scripts/guide_numbers.py

Each line is `name: value`; tests/test_guide.py checks that every value appears in the guide, so the guide
cannot drift from what the code does.
"""

import numpy
import torch

from accumulation.batching import accumulation_steps, describe_batch
from accumulation.schedule import lr_multiplier


def token_weighting() -> dict:
    """Two micro-batches with different token counts and mean losses."""
    tokens = [512, 1536]
    mean_losses = [2.0, 4.0]
    token_weighted = sum(n * loss for n, loss in zip(tokens, mean_losses, strict=True)) / sum(tokens)
    unweighted = sum(mean_losses) / len(mean_losses)
    return {"weighting.token_weighted": token_weighted, "weighting.mean_of_means": unweighted}


def batch_arithmetic() -> dict:
    return {
        "batch.example": describe_batch(32, 2, 2),
        "batch.model_parallel": describe_batch(64, 4, 4),  # 8 GPUs, tensor-parallel pairs: 4 data ranks
        "batch.accum_on_8_gpus_wrongly_counted": accumulation_steps(64, 4, 8),
    }


def ddp_compensation() -> dict:
    """Two ranks with loss sums 300 and 60 over N = 120 tokens: DDP averages what each rank backpropagates."""
    loss_sums, total_tokens, ranks = [300.0, 60.0], 120, 2
    without_factor = sum(s / total_tokens for s in loss_sums) / ranks
    with_factor = sum(s * ranks / total_tokens for s in loss_sums) / ranks
    return {
        "ddp.true_mean": sum(loss_sums) / total_tokens,
        "ddp.without_times_D": without_factor,
        "ddp.with_times_D": with_factor,
    }


def scheduler_unit() -> dict:
    """Warm-up of 100 updates, A = 8: stepping the scheduler per micro-batch finishes it after 100/8 updates."""
    warmup, accum = 100, 8
    updates_done = 10
    per_update = lr_multiplier(updates_done, "cosine", warmup, 1000, 0.1)
    per_micro_batch = lr_multiplier(updates_done * accum, "cosine", warmup, 1000, 0.1)
    return {
        "schedule.lr_factor_after_10_updates": round(per_update, 4),
        "schedule.lr_factor_if_stepped_per_micro_batch": round(per_micro_batch, 4),
        "schedule.warmup_done_after_updates_when_wrong": warmup / accum,
    }


def float_sums() -> dict:
    """The same 4096 gradient-like values (positive and negative) added in two orders in fp32, and added
    into a bf16 running sum."""
    generator = numpy.random.default_rng(0)
    values = generator.standard_normal(4096) * 1e-3
    exact = values.sum()  # float64
    # add.accumulate adds strictly left to right, so the two orders are two different chains of roundings.
    in_order = numpy.add.accumulate(values.astype(numpy.float32))[-1]
    shuffled = numpy.add.accumulate(generator.permutation(values).astype(numpy.float32))[-1]
    positives = numpy.abs(values) * 1e-3  # a sum that keeps growing, like a gradient accumulated over micro-batches
    bf16_running = torch.zeros((), dtype=torch.bfloat16)
    for value in torch.from_numpy(positives).to(torch.bfloat16):
        bf16_running += value
    return {
        "float.fp32_reorder_relative_difference": f"{abs(in_order - shuffled) / abs(exact):.1e}",
        "float.bf16_accumulation_relative_error": f"{abs(bf16_running.item() - positives.sum()) / positives.sum():.2f}",
    }


def main() -> None:
    for part in (token_weighting, batch_arithmetic, ddp_compensation, scheduler_unit, float_sums):
        for name, value in part().items():
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
