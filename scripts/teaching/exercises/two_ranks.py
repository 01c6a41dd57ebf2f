"""Exercise 14 (docs/exercises.md): accumulation on D data-parallel ranks under DDP.

Check with `python -m pytest scripts/teaching/exercises -k two_ranks`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def accumulate(model, micro_batches, tokens: int, ranks: int) -> None:
    """Leave in .grad of the DDP-wrapped `model`, on every rank, the gradient of the mean loss over the `tokens`
    supervised tokens of the whole step (all micro-batches of all `ranks` ranks); `micro_batches` are this
    rank's. DDP all-reduces the mean over the ranks; only the last micro-batch should synchronise."""
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        loss_sum = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        with model.no_sync():
            (loss_sum / tokens).backward()
