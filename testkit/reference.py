"""The independent reference every equivalence check compares against, and the instruments around it.

The reference knows nothing of micro-batches, ranks or our weighting: one float64 forward and backward of
PyTorch's own mean cross-entropy (`reduction="mean"`, `ignore_index=-100`) over every example of the step
at once. Its gradient is ∇L of the step's objective by definition, so an accumulated gradient that matches
it is right whatever the split.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accumulation.batching import IGNORE_INDEX, MicroBatch

# The checker's instruments (accumulation/checker/reference.py), used by the tests and scripts as they are.
from accumulation.checker.reference import first_update_probe as first_update_probe
from accumulation.checker.reference import max_relative_error as max_relative_error
from accumulation.checker.reference import without_dropout as without_dropout


def full_batch_mean_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PyTorch's mean cross-entropy over supervised targets; classes last in `outputs`, any label shape."""
    return F.cross_entropy(
        outputs.reshape(-1, outputs.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="mean"
    )


def float64_reference_gradient(model: torch.nn.Module, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """∇ of the mean loss over all supervised targets of `batches`, as one float64 batch (model untouched)."""
    model = copy.deepcopy(model).double()
    inputs = torch.cat([mb.inputs for mb in batches])
    labels = torch.cat([mb.labels for mb in batches])
    full_batch_mean_loss(model(inputs), labels).backward()
    return [p.grad.clone() for p in model.parameters()]


def capture_gradients(optimizer: torch.optim.Optimizer) -> list:
    """Record the gradients the optimizer is handed when it steps (after accumulation, the all-reduce,
    unscaling and clipping); the step sets .grad to None after the update, so this is where to look."""
    captured = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: captured.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
    )
    return captured


def counting_allreduce_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce of one gradient bucket, adding its bytes to state["bytes"]."""
    state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)
