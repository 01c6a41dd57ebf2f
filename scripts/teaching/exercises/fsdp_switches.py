"""Exercise 21 (docs/exercises.md): accumulation under FSDP2, with its two switches.

Check with `python -m pytest scripts/teaching/exercises -k fsdp_switches`; it fails until this is fixed.
"""

from torch.nn import functional as F

IGNORE_INDEX = -100


def accumulate(model, micro_batches, tokens: int, ranks: int) -> None:
    """Leave in the sharded .grad of the FSDP2 `model`, on every rank, this rank's shard of the gradient of the
    mean loss over the `tokens` supervised tokens of the whole step (all micro-batches of all `ranks` ranks);
    `micro_batches` are this rank's. FSDP2 averages over the ranks. Reduce-scatter the gradient and all-gather
    the parameters once per step, not once per micro-batch, and leave the parameters sharded at the end."""
    for inputs, labels in micro_batches:
        logits = model(inputs).flatten(0, 1)
        loss_sum = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum * ranks / tokens).backward()
