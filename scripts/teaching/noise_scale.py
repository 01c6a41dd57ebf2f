"""Where the default global batch sits against the gradient noise scale B_simple, measured during training.

    python scripts/teaching/noise_scale.py [--steps 300] [--window 50]

One process trains the default config (`python train.py`'s GPT on the embedded corpus, G = 32 examples in
A = 8 micro-batches of m = 4, its AdamW, clipping and cosine schedule over run.max_steps) with the project's
optimizer_step for the first --steps steps of that run. accumulation/noise_scale.py reads each micro-batch's
own gradient and the step's off `.grad` as the step accumulates them, and estimates B_simple = tr(Σ) / |G|²
(McCandlish et al. 2018, appendix A) from the 8 pairs (micro-batch, step) of every step, in supervised tokens.

It prints, for each window of --window steps, the mean loss, the estimates of |G|² and tr(Σ) and B_simple from
that window alone (the noise scale grows as the loss falls), in tokens (and from the window's even and its odd
steps apart, to show how settled it is) and in examples (tokens / the window's supervised tokens per example),
and the ratio G / B_simple. It also checks that the step's gradient it reads off `.grad` has the norm
optimizer_step reports. The windows do not depend on --steps: the schedule is the default run's either way.
"""

import argparse
import sys

import torch

from accumulation.batching import count_supervised_tokens
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_batch
from accumulation.models.factory import build_model
from accumulation.noise_scale import MicroBatchGradients, NoiseScale
from accumulation.run.build import build_optimizer
from accumulation.schedule import run_scheduler
from accumulation.step import StepSetup, optimizer_step

CPU = torch.device("cpu")


def measure(steps: int, window: int) -> dict:
    """Train the default config for `steps` steps; B_simple estimated from each window of `window` steps alone."""
    config = load_config([])  # the built-in defaults: configs/default.toml
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    model = build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    optimizer = build_optimizer(config.optim, model, CPU)
    # The default run's schedule (decay over run.max_steps), so these steps are the first steps of `python train.py`.
    scheduler = run_scheduler(optimizer, config.schedule, config.run.max_steps)
    gradients = MicroBatchGradients(model)

    windows = []
    tokens_seen = 0
    largest_norm_mismatch = 0.0  # relative, between √|g|² read off .grad and optimizer_step's grad_norm
    for step in range(steps):
        if step % window == 0:
            # The window's estimate, and one from its even and one from its odd steps: how far those two differ
            # shows how settled the window's estimate is.
            in_window, by_parity = NoiseScale(), (NoiseScale(), NoiseScale())
            losses, window_tokens, window_examples = [], 0, 0
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
            StepSetup(model, CPU, grad_clip=config.optim.grad_clip),
            batch.micro_batches,
            optimizer,
            global_counts=batch.global_counts,
        )
        if result.applied:
            scheduler.step()
        micro_batch_tokens = [count_supervised_tokens(micro_batch.labels) for micro_batch in batch.micro_batches]
        micro_batch_squared_norms, step_squared_norm = gradients.finish_step(micro_batch_tokens)
        largest_norm_mismatch = max(largest_norm_mismatch, abs(step_squared_norm**0.5 / result.grad_norm - 1))

        measured = (micro_batch_squared_norms, micro_batch_tokens, step_squared_norm, result.tokens)
        in_window.add_step(*measured)
        by_parity[step % 2].add_step(*measured)
        losses.append(result.loss)
        tokens_seen += result.tokens
        window_tokens += result.tokens
        window_examples += result.examples
        if (step + 1) % window == 0 or step + 1 == steps:
            tokens_per_example = window_tokens / window_examples
            windows.append(
                {
                    "steps": (step + 1 - len(losses), step + 1),
                    "loss": sum(losses) / len(losses),
                    "gradient_squared": in_window.gradient_squared,
                    "trace": in_window.trace,
                    "b_simple_tokens": in_window.b_simple,
                    "b_simple_tokens_even_odd": (by_parity[0].b_simple, by_parity[1].b_simple),
                    "b_simple_examples": in_window.b_simple / tokens_per_example,
                    "tokens_per_example": tokens_per_example,
                }
            )
    gradients.remove()
    return {
        "windows": windows,
        "global_batch_examples": config.batch.global_batch_size,
        "global_batch_tokens": tokens_seen / steps,  # mean supervised tokens per step
        "largest_norm_mismatch": largest_norm_mismatch,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (default: %(default)s)")
    parser.add_argument("--window", type=int, default=50, help="steps per B_simple estimate (default: %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a small share of a shared machine
    results = measure(args.steps, args.window)
    global_batch_tokens = results["global_batch_tokens"]
    print(
        f"G = {results['global_batch_examples']} examples = {global_batch_tokens:.0f} supervised tokens per step "
        "(mean); B_simple from each window of steps alone:"
    )
    print("steps      mean loss   |G|²       tr(Σ)      B_simple: tokens (even, odd steps)  examples   G / B_simple")
    for window in results["windows"]:
        first, last = window["steps"]
        even, odd = window["b_simple_tokens_even_odd"]
        print(
            f"{first:>4}-{last:<4}  {window['loss']:>9.4f}   {window['gradient_squared']:<9.3g}  "
            f"{window['trace']:<9.4g}  {window['b_simple_tokens']:>18.0f} ({even:>5.0f}, {odd:>5.0f})  "
            f"{window['b_simple_examples']:>8.1f}   {global_batch_tokens / window['b_simple_tokens']:>12.2f}"
        )
    print(f"the step's gradient norm read off .grad against optimizer_step's: {results['largest_norm_mismatch']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
