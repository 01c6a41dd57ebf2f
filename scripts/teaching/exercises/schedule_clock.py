"""Exercise 13 (docs/exercises.md): step the learning-rate schedule in its own unit, applied updates.

Check with `python -m pytest scripts/teaching/exercises -k schedule_clock`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def train(model, steps, optimizer, scheduler) -> list[float]:
    """One optimizer update per step (a list of micro-batches); returns the learning rate each step used. A
    step without any supervised token has nothing to learn from and applies no update."""
    used = []
    for micro_batches in steps:
        used.append(optimizer.param_groups[0]["lr"])
        tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
        for inputs, labels in micro_batches:
            logits = model(inputs).flatten(0, 1)
            loss_sum = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            if tokens > 0:
                (loss_sum / tokens).backward()
            scheduler.step()
        if tokens > 0:
            optimizer.step()
        optimizer.zero_grad()
    return used
