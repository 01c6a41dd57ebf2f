"""Print every number quoted in docs/accumulation.md, computed by the project's own code.

    python scripts/teaching/guide_numbers.py

Each line is `name: value`; tests/test_guide.py checks that every value appears in the guide, so the guide
cannot drift from what the code does.
"""

import numpy
import torch

from accumulation.batching import MicroBatch, accumulation_steps, describe_batch
from accumulation.config.config import DistConfig
from accumulation.data.sources import rows_dropped_per_epoch, steps_per_epoch
from accumulation.schedule import lr_multiplier
from accumulation.step import StepSetup, optimizer_step


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
    """The same 4096 gradient-like values (positive and negative) added in two orders in fp32."""
    generator = numpy.random.default_rng(0)
    values = generator.standard_normal(4096) * 1e-3
    exact = values.sum()  # float64
    # add.accumulate adds strictly left to right, so the two orders are two different chains of roundings.
    in_order = numpy.add.accumulate(values.astype(numpy.float32))[-1]
    shuffled = numpy.add.accumulate(generator.permutation(values).astype(numpy.float32))[-1]
    return {"float.fp32_reorder_relative_difference": f"{abs(in_order - shuffled) / abs(exact):.1e}"}


def accumulated_in(accumulator_dtype: torch.dtype, terms: torch.Tensor) -> torch.Tensor:
    """A running sum over the first dimension (the A micro-batches), rounded to `accumulator_dtype` after each add."""
    running = torch.zeros(terms.shape[1:], dtype=accumulator_dtype)
    for term in terms:
        running += term.to(accumulator_dtype)
    return running


def bf16_accumulation() -> dict:
    """Accumulation adds A terms per gradient entry, one per micro-batch. Here each of 4096 entries receives A
    bf16 micro-batch gradients, added into a bf16 running sum, and into an fp32 running sum of the same bf16
    terms. Two kinds of terms: of one sign (|N(0, 1)| · 1e-3: estimates of one gradient that agree in sign, so
    the running sum keeps growing) and of mixed signs (N(0, 1) · 1e-3: the sum partly cancels, so each term's
    own bf16 rounding is large against it). Error: ‖sum − exact float64 sum‖ over all entries, relative to
    ‖exact‖."""
    errors = {}
    for accumulation in (8, 32, 512):
        generator = numpy.random.default_rng(accumulation)
        normal = generator.standard_normal((accumulation, 4096)) * 1e-3
        for signs, values in (("", numpy.abs(normal)), ("mixed_", normal)):
            terms = torch.from_numpy(values)
            exact = terms.sum(dim=0)
            bf16_terms = terms.to(torch.bfloat16)  # what a bf16 backward hands over: each within 2^-8 relative
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                error = (accumulated_in(dtype, bf16_terms).double() - exact).norm() / exact.norm()
                errors[f"float.{name}_{signs}accumulation_error_A{accumulation}"] = float(error)
            # How much worse the bf16 buffer is than the fp32 one, on the same bf16 terms.
            ratio = errors[f"float.bf16_{signs}accumulation_error_A{accumulation}"]
            ratio /= errors[f"float.fp32_{signs}accumulation_error_A{accumulation}"]
            errors[f"float.bf16_over_fp32_{signs}A{accumulation}"] = f"{ratio:.2g}" if ratio < 100 else f"{ratio:.0f}"
    return {name: value if isinstance(value, str) else f"{value:.1e}" for name, value in errors.items()}


def clipping_before_unscale() -> dict:
    """A GradScaler's scale s = 1024 and a true gradient of norm 0.5, clipped at max_norm 1: clipping the
    scaled gradient s·g (norm 512) brings it to norm 1, which unscales to 1/s; the true gradient would not
    have been clipped at all."""
    scale, max_norm = 1024.0, 1.0
    gradient = torch.tensor([0.3, 0.4], dtype=torch.float64)  # norm 0.5
    parameter = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    parameter.grad = gradient * scale
    torch.nn.utils.clip_grad_norm_([parameter], max_norm)  # the mistake: before unscaling
    clipped_then_unscaled = float((parameter.grad / scale).norm())
    return {
        "clip.true_gradient_norm": float(gradient.norm()),
        "clip.effective_threshold": max_norm / scale,
        "clip.update_norm_when_clipped_scaled": f"{clipped_then_unscaled:.3g}",
    }


def batch_norm_momentum_updates() -> dict:
    """One optimizer_step of A = 4 micro-batches through a BatchNorm layer: its running statistics are
    updated once per forward, so 4 times per optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    micro_batches = [MicroBatch(torch.randn(2, 3), torch.tensor([0, 2]), 2) for _ in range(4)]
    optimizer_step(StepSetup(model, torch.device("cpu")), micro_batches, torch.optim.SGD(model.parameters(), lr=0.1))
    return {"batchnorm.momentum_updates_per_step": int(model[1].num_batches_tracked)}


def tails() -> dict:
    """The gallery's 18 rows in global batches of 8, under the default tail "drop" and under "partial"."""
    return {
        "tail.drop_steps_per_epoch": steps_per_epoch(18, 8, "drop"),
        "tail.drop_rows_left_out_per_epoch": rows_dropped_per_epoch(18, 8, "drop"),
        "tail.partial_steps_per_epoch": steps_per_epoch(18, 8, "partial"),
    }


def collectives() -> dict:
    return {"dist.timeout_s_default": DistConfig().timeout_s}


def main() -> None:
    parts = (
        token_weighting,
        batch_arithmetic,
        ddp_compensation,
        scheduler_unit,
        float_sums,
        bf16_accumulation,
        clipping_before_unscale,
        batch_norm_momentum_updates,
        tails,
        collectives,
    )
    for part in parts:
        for name, value in part().items():
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
