"""Where the default global batch sits against the gradient noise scale B_simple, measured during training.

    python scripts/teaching/noise_scale.py [--steps 300] [--window 50]

One process trains the default config (`python train.py`'s GPT on the embedded corpus, G = 32 examples in
A = 8 micro-batches of m = 4, its AdamW, clipping and cosine schedule over run.max_steps) with the project's
optimizer_step for the first --steps steps of that run. accumulation/noise_scale.py reads each micro-batch's
own gradient and the step's off `.grad` as the step accumulates them, and estimates B_simple = tr(Σ) / |G|²
(McCandlish et al. 2018, appendix A) from the 8 pairs (micro-batch, step) of every step, in supervised tokens.

It prints, for each window of --window steps, the mean loss and B_simple estimated from that window alone (the
noise scale grows as the loss falls), then B_simple over the last half of the steps in tokens and in examples
(tokens / the run's mean supervised tokens per example) against G. It also checks that the step's gradient it
reads off `.grad` has the norm optimizer_step reports.
"""

import argparse
import sys

import torch

from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_batch
from accumulation.models.factory import build_model
from accumulation.noise_scale import MicroBatchGradients, NoiseScale
from accumulation.run.build import build_optimizer
from accumulation.schedule import build_scheduler
from accumulation.step import count_supervised_tokens, optimizer_step

CPU = torch.device("cpu")


def measure(steps: int, window: int) -> dict:
    """Train the default config for `steps` steps; B_simple per window and over the last half of the steps."""
    config = load_config([])  # the built-in defaults: configs/default.toml
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    model = build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    optimizer = build_optimizer(config.optim, model, CPU)
    schedule = config.schedule
    # The default run's schedule (decay over run.max_steps), so these steps are the first steps of `python train.py`.
    decay_updates = schedule.decay_updates or config.run.max_steps
    scheduler = build_scheduler(optimizer, schedule.name, schedule.warmup_updates, decay_updates, schedule.min_lr_ratio)
    gradients = MicroBatchGradients(model)

    last_half, in_window = NoiseScale(), NoiseScale()
    windows, window_losses = [], []
    tokens_seen = examples_seen = 0
    largest_norm_mismatch = 0.0  # relative, between √|g|² read off .grad and optimizer_step's grad_norm
    for step in range(steps):
        batch = step_batch(
            data.train,
            step,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=config.batch.micro_batch_size,
            world_size=1,
            rank=0,
        )
        result = optimizer_step(
            model,
            batch.micro_batches,
            optimizer,
            device=CPU,
            grad_clip=config.optim.grad_clip,
            global_counts=batch.global_counts,
        )
        if result.applied:
            scheduler.step()
        micro_batch_tokens = [count_supervised_tokens(micro_batch.labels) for micro_batch in batch.micro_batches]
        micro_batch_squared_norms, step_squared_norm = gradients.finish_step(micro_batch_tokens)
        largest_norm_mismatch = max(largest_norm_mismatch, abs(step_squared_norm**0.5 / result.grad_norm - 1))
        tokens_seen += result.tokens
        examples_seen += result.examples

        measured = (micro_batch_squared_norms, micro_batch_tokens, step_squared_norm, result.tokens)
        in_window.add_step(*measured)
        window_losses.append(result.loss)
        if step >= steps // 2:
            last_half.add_step(*measured)
        if (step + 1) % window == 0 or step + 1 == steps:
            windows.append(
                {
                    "steps": (step + 1 - len(window_losses), step + 1),
                    "loss": sum(window_losses) / len(window_losses),
                    "b_simple_tokens": in_window.b_simple,
                }
            )
            in_window, window_losses = NoiseScale(), []
    gradients.remove()

    tokens_per_example = tokens_seen / examples_seen
    return {
        "windows": windows,
        "global_batch_examples": config.batch.global_batch_size,
        "global_batch_tokens": tokens_seen / steps,  # mean supervised tokens per step
        "tokens_per_example": tokens_per_example,
        "gradient_squared": last_half.gradient_squared,
        "trace": last_half.trace,
        "b_simple_tokens": last_half.b_simple,
        "b_simple_examples": last_half.b_simple / tokens_per_example,
        "largest_norm_mismatch": largest_norm_mismatch,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (default: %(default)s)")
    parser.add_argument("--window", type=int, default=50, help="steps per B_simple estimate (default: %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a small share of a shared machine
    results = measure(args.steps, args.window)
    print("steps      mean loss   B_simple (tokens, this window alone)")
    for window in results["windows"]:
        first, last = window["steps"]
        print(f"{first:>4}-{last:<4}  {window['loss']:>9.4f}   {window['b_simple_tokens']:>10.0f}")
    half = args.steps // 2
    print(
        f"steps {half}-{args.steps}: |G|² ≈ {results['gradient_squared']:.3e}, tr(Σ) ≈ {results['trace']:.3e} per token"
    )
    print(
        f"B_simple ≈ {results['b_simple_tokens']:.0f} supervised tokens "
        f"≈ {results['b_simple_examples']:.1f} examples ({results['tokens_per_example']:.1f} tokens per example)"
    )
    print(
        f"G = {results['global_batch_examples']} examples ≈ {results['global_batch_tokens']:.0f} supervised tokens: "
        f"G / B_simple ≈ {results['global_batch_tokens'] / results['b_simple_tokens']:.2f}"
    )
    print(f"the step's gradient norm read off .grad against optimizer_step's: {results['largest_norm_mismatch']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
