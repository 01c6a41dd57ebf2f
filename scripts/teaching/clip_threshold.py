"""The clip threshold when G changes: the same max_norm clips a different share of the steps.

    python scripts/teaching/clip_threshold.py [--json]

A gradient-norm clip compares the step's gradient norm with max_norm. The step's gradient is a mean over G
examples: its squared norm is about |g|² + tr(Σ) / G (McCandlish et al. 2018; guide, section 15), the true
gradient's plus the noise's, and the noise part shrinks as G grows. So a max_norm tuned at one G clips more
steps at a smaller G and fewer at a larger one, and scales the update by another factor on average: a change of
G moves the clip, whatever m and A are (at a fixed G they change nothing: checked below).

A tiny float64 token model at fixed weights (trained for a few steps first, so that signal and noise are both
present), and STEPS batches drawn at each G from a pool of rows: printed, for each G, the median gradient norm,
the share of the batches whose norm exceeds max_norm (the median norm at G = 32, as if tuned there), and the
mean factor the clip multiplies the gradient by (1 where it does not clip). Also: one batch of G = 128 as one
micro-batch and as m = 16, A = 8 (token-weighted), whose norms agree to rounding.
tests/test_teaching_lessons.py checks the figures and the guide's quotes of them.
"""

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
POOL_ROWS = 8192
GLOBAL_BATCHES = (8, 32, 128, 512)  # G, in rows
TUNED_AT = 32  # max_norm is the median norm at this G
STEPS = 64  # batches drawn at each G
WARMUP_STEPS = 30  # SGD steps at G = 32 before measuring, so the gradient has a signal part and a noise part


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose targets follow the inputs half the time (a learnable signal) and are random otherwise."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(VOCAB_SIZE, (POOL_ROWS, SEQ_LEN), generator=generator)
    noise = torch.randint(VOCAB_SIZE, (POOL_ROWS, SEQ_LEN), generator=generator)
    follows = torch.rand(POOL_ROWS, SEQ_LEN, generator=generator) < 0.5
    targets = torch.where(follows, (3 * inputs + 1) % VOCAB_SIZE, noise)
    lengths = torch.randint(1, SEQ_LEN + 1, (POOL_ROWS, 1), generator=generator)
    return inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)).double()


def gradient_norm(net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, micro_batch_size: int) -> float:
    """The token-mean gradient's norm over these rows, accumulated in micro-batches of micro_batch_size rows."""
    net.zero_grad(set_to_none=True)
    tokens = int((labels != IGNORE_INDEX).sum())
    for first in range(0, len(inputs), micro_batch_size):
        rows = slice(first, first + micro_batch_size)
        logits = net(inputs[rows]).flatten(0, 1)
        (F.cross_entropy(logits, labels[rows].flatten(), reduction="sum") / tokens).backward()
    return float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm())


def measure() -> dict:
    inputs, labels = pool()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(WARMUP_STEPS):
        rows = torch.randint(POOL_ROWS, (TUNED_AT,), generator=generator)
        gradient_norm(net, inputs[rows], labels[rows], TUNED_AT)
        optimizer.step()
    norms = {}
    for global_batch in GLOBAL_BATCHES:
        draws = [torch.randperm(POOL_ROWS, generator=generator)[:global_batch] for _ in range(STEPS)]
        norms[global_batch] = torch.tensor([gradient_norm(net, inputs[r], labels[r], global_batch) for r in draws])
    max_norm = float(norms[TUNED_AT].median())
    results = {"max_norm": max_norm, "by G": {}}
    for global_batch, values in norms.items():
        factor = (max_norm / values).clamp(max=1.0)  # clip_grad_norm_'s factor, without its 1e-6
        results["by G"][global_batch] = {
            "median norm": float(values.median()),
            "share clipped": float((values > max_norm).double().mean()),
            "mean factor": float(factor.mean()),
        }
    rows = torch.randperm(POOL_ROWS, generator=generator)[:128]
    whole, accumulated = (
        gradient_norm(net, inputs[rows], labels[rows], 128),
        gradient_norm(net, inputs[rows], labels[rows], 16),
    )
    results["G=128, m=16 A=8 against one micro-batch"] = abs(accumulated - whole) / whole
    return results


def report(results: dict) -> list[str]:
    """The lines main prints (the guide quotes them)."""
    lines = []
    lines.append(f"max_norm = {results['max_norm']:.3g} (the median norm at G = {TUNED_AT})")
    lines.append("| G | median gradient norm | share of steps clipped | mean clip factor |")
    lines.append("|---|---|---|---|")
    for global_batch, row in results["by G"].items():
        lines.append(
            f"| {global_batch} | {row['median norm']:.3g} | {row['share clipped']:.2f} | {row['mean factor']:.3g} |"
        )
    same = results["G=128, m=16 A=8 against one micro-batch"]
    lines.append(f"G=128, m=16 A=8 against one micro-batch: {'< 1e-14' if same < 1e-14 else f'{same:.3g}'}")
    return lines


def main(argv: list[str]) -> int:
    return lesson_main(argv, __doc__.splitlines()[0], measure, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
