"""With model.compile on, the forward and the loss as one module, so that torch.compile traces both into one region
(accumulation/models/factory.py, training_forward_and_loss; accumulation/run/build.py, wrap_for_training)."""

from collections.abc import Callable

import torch


class ForwardAndLoss(torch.nn.Module):
    """forward(inputs, labels, **extras) -> S = loss_sum_fn(module(inputs), labels, **extras): the forward and the
    loss as one module (extras: the micro-batch's per-row tensors, MicroBatch.extras).

    torch.compile of this module traces both into one graph, so the loss's kernels fuse with the model's and its
    memory is planned with theirs (the chunked loss's autograd Function and its loop included); DDP wraps it
    as it wraps the model (its no_sync and its bucketed all-reduce are unchanged). It holds `module` (the same
    parameters), so checkpoints of the model are unchanged."""

    def __init__(self, module: torch.nn.Module, loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.module = module
        self.loss_sum_fn = loss_sum_fn

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, **extras: torch.Tensor) -> torch.Tensor:
        return self.loss_sum_fn(self.module(inputs), labels, **extras)
