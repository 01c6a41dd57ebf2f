"""The independent reference every equivalence check compares against, and the instruments around it.

The reference knows nothing of micro-batches, ranks or our weighting: one float64 forward and backward of
PyTorch's own mean cross-entropy (`reduction="mean"`, `ignore_index=-100`) over every example of the step
at once. Its gradient is ∇L of the step's objective by definition, so an accumulated gradient that matches
it is right whatever the split.
"""

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.config import Config


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


def max_relative_error(gradient: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """max |gradient - reference| over all entries, relative to the largest entry of the reference."""
    largest = max(r.abs().max().item() for r in reference)
    pairs = zip(gradient, reference, strict=True)
    return max((g.double().cpu() - r.double().cpu()).abs().max().item() for g, r in pairs) / largest


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


def without_dropout(config: Config) -> Config:
    """The config with dropout off: its masks are random, and no reference (or second run) draws the same."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.0))


def first_update_probe(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list]:
    """(an optimizer that never moves the weights, handed): SGD with learning rate 0 and no momentum, so it
    holds no state, whose pre-step hook puts into `handed` the gradients of the first update it is asked to
    apply, as it sees them (after accumulation, DDP's all-reduce, unscaling and clipping). Later updates add
    nothing, so that memory measured around them holds no copies of the probe's. Under FSDP2 the gradients
    are shards (DTensors): each is gathered whole, a collective that every rank's optimizer step takes part in."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handed = []

    def whole(grad: torch.Tensor) -> torch.Tensor:
        return grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()

    def record_first_gradient(opt, args, kwargs):
        if not handed:
            handed.append([whole(p.grad) for p in model.parameters()])

    optimizer.register_step_pre_hook(record_first_gradient)
    return optimizer, handed
