"""Exercise 15 (docs/exercises.md): a loss scale with Adam.

Check with `python -m pytest scripts/teaching/exercises -k adam_eps`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def update(model, micro_batches, optimizer, loss_scale: float) -> None:
    """One Adam update from the step's micro-batches: the token-mean gradient, with each loss multiplied by
    `loss_scale` before its backward (what a GradScaler does, here by hand)."""
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        loss_sum = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum / tokens * loss_scale).backward()
    optimizer.step()  # Adam divides by the gradient's size, so the scale cancels
    optimizer.zero_grad()
