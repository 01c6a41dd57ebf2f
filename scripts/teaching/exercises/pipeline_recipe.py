"""Exercise 20 (docs/exercises.md): the loss and the schedule of a pipeline's step.

Check with `python -m pytest scripts/teaching/exercises -k pipeline_recipe`; it fails until this is fixed.
"""

from torch.distributed.pipelining import Schedule1F1B
from torch.nn import functional as F

IGNORE_INDEX = -100


def make_schedule(stage, n_microbatches: int, tokens: int, replicas: int):
    """The 1F1B schedule of one data replica's step on this `stage`, over `n_microbatches` micro-batches, such
    that each stage's .grad, averaged over the `replicas` data replicas by DDP, is the gradient of the mean loss
    over the `tokens` supervised tokens of the whole step (every micro-batch of every replica)."""

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    return Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
