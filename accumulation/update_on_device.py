"""The update queued on the device before the step's read-back, for a fused optimizer (fused AdamW, which train.py
builds on CUDA; fused SGD). accumulation/step.py imports this only when every parameter group is fused.

Without it the host reads the gradient norm back and only then decides to call optimizer.step(): on a GPU the
update waits for that read. PyTorch's fused kernels take a device flag instead, `found_inf` (the one GradScaler
hands them): when it is 1 they leave the weights, the moments and the step counters as they were. Here the flag is
"the whole gradient's norm is not finite", the step's own rule for a skip, so the update is applied exactly when
accumulation/step.py's update_or_skip would apply it, with no read of the device.
"""

import torch
from torch.distributed.tensor import DTensor


def queue_update_unless_non_finite(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_norm: torch.Tensor
) -> bool:
    """Queue the update and the scaler's update; returns whether it did. Not for FSDP2's DTensor shards (the fused
    kernels' flag next to them is not tested here): False, and the step updates after its read-back."""
    if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        return False
    # A fused optimizer's step() reads the two attributes GradScaler.step sets for it: `grad_scale` (None: the
    # gradients are already unscaled, as unscale_ left them) and `found_inf`.
    optimizer.grad_scale = None
    optimizer.found_inf = torch.logical_not(torch.isfinite(grad_norm)).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
    scaler.update()  # lowers or grows the scale from its own inf check, on the device too
    return True
