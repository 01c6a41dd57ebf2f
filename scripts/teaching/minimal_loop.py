"""The smallest correct gradient-accumulation loop: one process, plain PyTorch, token-weighted. Read it first.

    python scripts/teaching/minimal_loop.py [--classic]

A step is A micro-batches whose rows supervise different numbers of tokens (labels -100 elsewhere). The
objective of a step is the mean loss over its N supervised tokens. The classic loop, as most tutorials
write it, backpropagates each micro-batch's MEAN loss divided by A; that weights a token of a short
micro-batch more than one of a long micro-batch. The one line that differs:

    classic:  (F.cross_entropy(logits, labels) / A).backward()                   # mean of micro-batch means
    here:     (F.cross_entropy(logits, labels, reduction="sum") / N).backward()  # N: tokens of the whole step

The script trains a tiny model for a few steps with this loop, and from the same weights on the same
micro-batches with the project's `optimizer_step`, and prints how far apart the weights end (and how far
the classic loop ends). It exits 1 when this loop and `optimizer_step` differ by more than TOLERANCE.
`--classic` trains with the classic line instead, to watch the check fail.
"""

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from accumulation.batching import MicroBatch
from accumulation.step import StepSetup, optimizer_step

IGNORE_INDEX = -100  # label of a position without a target
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 12, 16
MICRO_BATCH_SIZE, ACCUMULATION_STEPS, STEPS = 4, 4, 5  # m, A, and optimizer steps
LR = 0.5
# Both loops add the same float32 terms in the same order; they may differ only in rounding (S · (1/N) in
# optimizer_step against S / N here), about 1e-7 relative per operation, growing over STEPS updates to at
# most about 1e-6 of the largest weight (on this project's CPU they end bit-identical). The classic loop's
# wrong weighting moves the weights by about 4e-3 here.
TOLERANCE = 1e-5


def make_step(generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's A micro-batches of (inputs, labels); each row supervises a random prefix of 1 to SEQ_LEN tokens."""
    micro_batches = []
    for _ in range(ACCUMULATION_STEPS):
        inputs = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        targets = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        supervised = torch.randint(1, SEQ_LEN + 1, (MICRO_BATCH_SIZE, 1), generator=generator)
        labels = torch.where(torch.arange(SEQ_LEN) < supervised, targets, IGNORE_INDEX)
        micro_batches.append((inputs, labels))
    return micro_batches


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights for every loop
    return nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, classic: bool) -> float:
    """One optimizer step over the micro-batches; returns the step's mean loss over its N tokens."""
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)  # N, before any backward
    loss_sum = 0.0
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)  # [rows · seq_len, vocab]
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")  # S_k
        if classic:
            (F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX) / ACCUMULATION_STEPS).backward()
        else:
            (loss / tokens).backward()  # backward adds: Σ_k ∇(S_k / N) = ∇ of the mean over all N tokens
        loss_sum += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum / tokens


def weights_difference(a: nn.Module, b: nn.Module) -> float:
    """max |a - b| over all weights, relative to the largest weight of b."""
    pairs = [(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    return max(float((p - q).abs().max()) for p, q in pairs) / max(float(q.abs().max()) for _, q in pairs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classic", action="store_true", help="train with the classic line (loss / A) instead")
    args = parser.parse_args(argv)
    steps = [make_step(torch.Generator().manual_seed(step)) for step in range(STEPS)]

    loops = {"this loop": make_model(), "classic loop (loss / A)": make_model(), "optimizer_step": make_model()}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=LR) for name, model in loops.items()}
    for step, micro_batches in enumerate(steps):
        loss = train_step(loops["this loop"], optimizers["this loop"], micro_batches, args.classic)
        train_step(loops["classic loop (loss / A)"], optimizers["classic loop (loss / A)"], micro_batches, True)
        project_batches = [MicroBatch(inputs, labels, MICRO_BATCH_SIZE) for inputs, labels in micro_batches]
        result = optimizer_step(
            StepSetup(loops["optimizer_step"], torch.device("cpu")), project_batches, optimizers["optimizer_step"]
        )
        print(f"step {step}: N = {result.tokens} tokens, loss {loss:.6f} (optimizer_step: {result.loss:.6f})")

    reference = loops["optimizer_step"]
    difference = weights_difference(loops["this loop"], reference)
    print(f"weights after {STEPS} steps, max difference relative to the largest weight of optimizer_step:")
    print(f"  this loop{' (--classic)' if args.classic else ''}: {difference:.2e} (tolerance {TOLERANCE:.0e})")
    print(f"  classic loop (loss / A): {weights_difference(loops['classic loop (loss / A)'], reference):.2e}")
    print("PASS" if difference <= TOLERANCE else "FAIL")
    return 0 if difference <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
