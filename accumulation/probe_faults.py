"""The lines of the step-0 probe (accumulation/probe.py) for a forward or a loss that raises on the first
micro-batch: imported only then. `fault` is probe.fault_text's "ValueError: message (at path:line)"."""

import torch


def shapes_text(value) -> str:
    """ "float32 [2, 3, 16, 16]" for a tensor, each one's for a tuple, the type's name for anything else."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, tuple):
        return f"({', '.join(shapes_text(item) for item in value)})"
    return type(value).__name__


def forward_raised(inputs, fault: str) -> str:
    return (
        f"step 0: the model's forward raised on the first micro-batch (inputs {shapes_text(inputs)}): {fault}; "
        f"the model does not fit this data (model.name, data.source)"
    )


def loss_raised(outputs, labels, fault: str) -> str:
    return (
        f"step 0: the loss raised on the model's outputs {shapes_text(outputs)} and the labels {shapes_text(labels)}: "
        f"{fault}; the model's outputs do not fit the loss (model.name, model.objective)"
    )


def loss_without_gradient(loss) -> str:
    return (
        f"step 0: the loss returned a {type(loss).__name__} without gradient, so no backward can train the model: it "
        f"was computed outside autograd (.detach(), .item(), torch.no_grad(), a tensor made anew from numbers); "
        f"return the sum built from the outputs with torch operations (docs/forking.md)"
    )
