"""Exercise 12 (docs/exercises.md): one update with a GradScaler and gradient clipping, in the right order.

Check with `python -m pytest scripts/teaching/exercises -k scaler_order`; it fails until this is fixed.
"""

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


def update(model, micro_batches, optimizer, scaler, scheduler, max_norm: float) -> None:
    """One optimizer update from the step's micro-batches: the token-mean gradient, clipped once to
    max_norm, with the loss scaled by `scaler` (as fp16 training needs); a gradient with an inf or a NaN
    skips the update, and `scheduler` advances once per applied update."""
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)  # N of the whole step
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        loss_sum = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        scaler.scale(loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad()
