"""GradScaler's scale over a whole run with loss spikes: when it skips, and the path the scale takes.

    python scripts/teaching/scaler_run.py [--json]

fp16 holds values up to 65,504. A GradScaler multiplies the loss by a scale s so that small gradients survive
in fp16, skips the update when the scaled gradient overflowed (an inf or a NaN), halves s after each skip,
and doubles it after `growth_interval` updates in a row without one. So s climbs until s times the largest
gradient entry passes fp16's range, then falls back: at its ceiling the scaler skips about one update per
growth_interval, on purpose, to probe. A loss spike (a bad batch) overflows at a scale that was fine, costs
one skipped update and a halving, and takes growth_interval updates to climb back.

Here a tiny float64 token model (float64, so that no overflow decision depends on a CPU's rounding) trains STEPS
updates of A = 2 micro-batches with SGD and the exact token- weighted step, unscale_, step and update once per
update (section 5). fp16's range is emulated on this CPU: a hook rounds each backward's gradient to fp16, so an
entry beyond 65,504 becomes inf, as it would in an fp16 backward. Updates SPIKES have one micro-batch's loss
multiplied by SPIKE_FACTOR. Printed: the skipped updates and why (the scale reached its ceiling, or a spike),
the scale's path (each change, and at which update), and the share of updates skipped.
tests/test_teaching_lessons.py checks the figures and the guide's quotes of them.
"""

import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# Run as a script, Python puts only this file's folder on sys.path: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.lesson import lesson_main  # noqa: E402

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 12, 16
MICRO_BATCH_SIZE, ACCUMULATION_STEPS = 4, 2
STEPS = 400
INIT_SCALE, GROWTH_INTERVAL = 2.0**16, 25  # PyTorch's default init_scale; growth_interval shortened from 2000
SPIKES = (150, 151, 280)  # updates with a spiking micro-batch
SPIKE_FACTOR = 1000.0


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(ACCUMULATION_STEPS):
        inputs = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        targets = (3 * inputs + 1) % VOCAB_SIZE
        lengths = torch.randint(1, SEQ_LEN + 1, (MICRO_BATCH_SIZE, 1), generator=generator)
        batches.append((inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)))
    return batches


def run() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)).double()
    for parameter in model.parameters():  # each backward's gradient in fp16's range: beyond 65,504 it is inf
        parameter.register_hook(lambda gradient: gradient.half().double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scales, skipped = [], []
    for step in range(STEPS):
        batches = micro_batches(step)
        tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        scales.append(scaler.get_scale())  # the scale this update's backward used
        for k, (inputs, labels) in enumerate(batches):
            loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
            spike = SPIKE_FACTOR if step in SPIKES and k == 0 else 1.0
            scaler.scale(loss_sum * spike / tokens).backward()
        scaler.unscale_(optimizer)  # every overflow here is an inf entry (fp16's range), which unscale_ finds
        if not torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])):
            skipped.append(step)
        scaler.step(optimizer)  # skips the update after an inf
        scaler.update()  # halves the scale after a skip, doubles it after GROWTH_INTERVAL updates without one
        optimizer.zero_grad()
    path = [(0, scales[0])] + [(step, s) for step, s in enumerate(scales) if step and s != scales[step - 1]]
    return {
        "skipped": skipped,
        "skipped at a spike": [step for step in skipped if step in SPIKES],
        "skipped at the ceiling": [step for step in skipped if step not in SPIKES],
        "scale path": path,
        "ceiling": max(scales),
        "final scale": scaler.get_scale(),
        "share skipped": len(skipped) / STEPS,
    }


def report(results: dict) -> list[str]:
    """The lines main prints (the guide quotes them)."""
    lines = []
    lines.append(
        f"updates: {STEPS}, growth_interval: {GROWTH_INTERVAL}, spikes (loss x {SPIKE_FACTOR:g}) at {list(SPIKES)}"
    )
    lines.append(f"skipped at a spike: {results['skipped at a spike']}")
    lines.append(f"skipped at the ceiling: {results['skipped at the ceiling']}")
    lines.append(f"share skipped: {results['share skipped']:.3f}")
    lines.append(f"highest scale: 2^{math.log2(results['ceiling']):.0f}")
    lines.append("scale path: " + ", ".join(f"{step}: 2^{math.log2(s):.0f}" for step, s in results["scale path"]))
    return lines


def main(argv: list[str]) -> int:
    return lesson_main(argv, __doc__.splitlines()[0], run, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
