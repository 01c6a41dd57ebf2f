"""The micro-batch is a memory knob, the global batch a cadence knob: training curves against updates.

    python scripts/teaching/cadence.py [--steps 120] [--png docs/figures/cadence.png]

One process trains the SFT example (configs/sft.toml, a smaller GPT) with the project's optimizer_step four
times from the same initial weights: global batch G = 32 with micro-batches m = 4 (A = 8) and m = 16
(A = 2), then G = 8 and G = 64. The examples of step s depend on (seed, s, G) only, so the two G = 32 runs
see the same examples in the same steps and differ only in fp32 rounding: one curve against updates. A
different G changes what one update averages over, and with it the curve: the same number of updates sees
a different number of examples. The left panel plots the training loss against updates, the right one
against examples seen. The script prints each run's final loss and the largest difference between the two
G = 32 curves. It took 241 s wall on this project's 2-core CPU shared with other jobs (load average 3.9
to 9.8; measured once, 2026-12-01).
"""

import argparse
import sys
from pathlib import Path

import torch

from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_batch
from accumulation.models.factory import build_model
from accumulation.run.build import build_optimizer
from accumulation.schedule import build_scheduler
from accumulation.step import StepSetup, optimizer_step

# Run as `python scripts/teaching/cadence.py`, Python puts only this file's folder on sys.path: the
# repository root goes first, so that the figures' shared sizes import as scripts.teaching.figures.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.figures import FONT_PT, TITLE_PT, matplotlib_defaults

REPO = Path(__file__).resolve().parents[2]
CONFIG_ARGUMENTS = [
    "--config",
    str(REPO / "configs" / "sft.toml"),
    f"data.source={REPO / 'data' / 'sft_arithmetic.jsonl'}",
    "model.n_layer=1",
    "model.d_model=48",
    "model.n_head=2",
]
RUNS = ((32, 4), (32, 16), (8, 4), (64, 16))  # (global batch G, micro-batch m); one process, so A = G / m
SMOOTHING = 10  # steps in the moving average of the figure
CPU = torch.device("cpu")


def train(config, data, global_batch_size: int, micro_batch_size: int, steps: int) -> list[float]:
    """The training loss of every step of one run (the step's exact token-mean loss)."""
    # the same initial weights for every run
    model = build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    optimizer = build_optimizer(config.optim, model, CPU)
    schedule = config.schedule
    scheduler = build_scheduler(optimizer, schedule.name, schedule.warmup_updates, steps, schedule.min_lr_ratio)
    losses = []
    for step in range(steps):
        batch = step_batch(
            data.train,
            step,
            seed=config.run.seed,
            global_batch_size=global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=micro_batch_size,
            world_size=1,
            rank=0,
        )
        result = optimizer_step(StepSetup(model, CPU, grad_clip=config.optim.grad_clip), batch.micro_batches, optimizer)
        if result.applied:
            scheduler.step()
        losses.append(result.loss)
    return losses


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def draw(curves: dict, png_path: str):
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    matplotlib_defaults()

    figure = Figure(figsize=(13, 5), layout="constrained")
    by_updates, by_examples = figure.subplots(1, 2, sharey=True)
    styles = {(32, 4): "-", (32, 16): "--"}
    for (global_batch_size, micro_batch_size), losses in curves.items():
        smoothed = moving_average(losses, min(SMOOTHING, len(losses)))
        updates = range(1, len(losses) + 1)
        label = f"G = {global_batch_size}, m = {micro_batch_size}, A = {global_batch_size // micro_batch_size}"
        style = styles.get((global_batch_size, micro_batch_size), "-")
        by_updates.plot(updates, smoothed, style, label=label, linewidth=1.3)
        by_examples.plot([u * global_batch_size for u in updates], smoothed, style, label=label, linewidth=1.3)
    by_updates.set_xlabel("optimizer updates")
    by_updates.set_ylabel(f"training loss (nats per token,\nmoving average of {SMOOTHING} steps)")
    by_examples.set_xlabel("examples seen")
    by_examples.set_xscale("log")
    by_updates.legend(fontsize=FONT_PT)
    figure.suptitle("Same G, different m: one curve. Different G: different curves.", fontsize=TITLE_PT)
    figure.savefig(png_path, dpi=90)
    return figure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--png", default="cadence.png", help="where to write the figure (default: %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # the same matrix kernels for every run: only the micro-batch layout differs
    config = load_config(CONFIG_ARGUMENTS)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    curves = {run: train(config, data, *run, args.steps) for run in RUNS}
    for (global_batch_size, micro_batch_size), losses in curves.items():
        tail = losses[-SMOOTHING:]
        print(f"G = {global_batch_size:>3}, m = {micro_batch_size:>2}: final loss {sum(tail) / len(tail):.4f}")
    same_g = max(abs(a - b) for a, b in zip(curves[(32, 4)], curves[(32, 16)], strict=True))
    print(f"largest loss difference between G = 32 with m = 4 and with m = 16, over all steps: {same_g:.1e}")
    draw(curves, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
