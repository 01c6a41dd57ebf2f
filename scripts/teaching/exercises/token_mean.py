"""Exercise 11 (docs/exercises.md): make the accumulated gradient the token mean of the whole step.

Check with `python -m pytest scripts/teaching/exercises -k token_mean`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def accumulate(model, micro_batches) -> None:
    """Backpropagate one step's micro-batches [(inputs, labels), ...] so that .grad ends as the gradient of the
    mean loss over every supervised token of the step (labels -100 where there is no target)."""
    accumulation_steps = len(micro_batches)
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)
        (loss / accumulation_steps).backward()
