"""Exercise 22 (docs/exercises.md): GRPO's per-sequence mean under accumulation.

Check with `python -m pytest scripts/teaching/exercises -k sequence_mean`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def accumulate(model, micro_batches, sequences: int) -> None:
    """Leave in .grad the gradient of GRPO's loss aggregation over the whole step: the mean over its
    `sequences` responses (rows, in all micro-batches) of each response's mean token loss. Micro-batches hold
    different numbers of responses."""
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        token_losses = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        token_losses = token_losses.view(labels.shape)
        sequence_means = token_losses.sum(dim=1) / (labels != IGNORE_INDEX).sum(dim=1)
        (sequence_means.mean() / len(micro_batches)).backward()
