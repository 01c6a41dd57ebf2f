"""One optimizer step from one rank's micro-batches: exact token-weighted gradient accumulation under DDP.

The objective of a step is the mean loss over every supervised token of the global batch:

    L = (1 / N) · Σ_r Σ_k S_rk

where S_rk is the *sum* of per-token losses of micro-batch k on rank r and N is the number of supervised
tokens over all micro-batches and all ranks. Micro-batches and ranks may hold very different token counts
(padding, short documents), so the mean of per-micro-batch means would weight a token in a short
micro-batch more than one in a long micro-batch. Here every token counts once.

Backward adds gradients into `.grad` (a SUM over micro-batches), and DDP's all-reduce then *averages* over
the D ranks. So each rank backpropagates

    loss_rk = S_rk · D / N

and after accumulation and DDP's mean the gradient is

    (1 / D) · Σ_r Σ_k ∇(S_rk · D / N) = (1 / N) · Σ_r Σ_k ∇S_rk = ∇L.

N is known before the first forward: it is counted from the labels on the host and summed over ranks with
one all-reduce.

This file is the whole contract a fork relies on. A fork may change the model (any `forward(inputs) ->
outputs`), the loss (any `loss_sum_fn(outputs, labels)` that returns the SUM of the losses of the supervised
targets) and the data (any labels with -100 where there is no target, of any shape); the algebra above holds
for all of them, because it only needs per-target sums and the count N of supervised targets.
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch


@dataclass
class StepResult:
    """What one optimizer step did. The caller steps the scheduler and adds this to its counters."""

    loss: float  # global mean loss over supervised targets, L above; nan when the step had none
    tokens: int  # supervised targets in this step, all ranks (N)
    examples: int  # real examples in this step, all ranks (padding rows excluded)
    applied: bool  # whether the optimizer update was applied
    grad_norm: float  # total gradient norm before clipping (of the unscaled gradient)
    skip_reason: str | None  # why the update was not applied, when it was not
    lr: float  # learning rate of the optimizer's first parameter group during this step
    micro_batches: int  # forward+backward passes on this rank (A)


def token_cross_entropy_sum(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default loss: S, the SUM of cross-entropy over supervised targets (labels != -100).

    `outputs` are logits with the classes last: [rows, seq_len, vocab] for a language model with labels
    [rows, seq_len], or [rows, classes] for one class per example with labels [rows]. Computed in at least
    float32 (bf16/fp16 logits from autocast are upcast; float64 stays float64)."""
    outputs = outputs.to(torch.promote_types(outputs.dtype, torch.float32))
    logits = outputs.reshape(-1, outputs.shape[-1])
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def count_supervised_tokens(labels: torch.Tensor) -> int:
    """Targets that count, whatever the shape of `labels`. They live on the host: no device read."""
    return int((labels != IGNORE_INDEX).sum())


def data_parallel_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_ints(values: list[int], device: torch.device) -> list[int]:
    """Sum a few integers over all ranks with one collective (identity on a single process)."""
    if not dist.is_initialized():
        return list(values)
    # NCCL only reduces device tensors; gloo takes host tensors.
    collective_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    summed = torch.tensor(values, dtype=torch.int64, device=collective_device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.tolist()


def to_device(micro_batch: MicroBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy a micro-batch's inputs and labels to `device`. From pinned host memory (train.py pins on CUDA)
    the copy is asynchronous: the host does not wait for it, and the GPU runs it just before the forward."""
    return (
        micro_batch.inputs.to(device, non_blocking=True),
        micro_batch.labels.to(device, non_blocking=True),
    )


def gradient_norm(model: torch.nn.Module, grad_clip: float) -> torch.Tensor:
    """Total 2-norm of all gradients before clipping; clips them to `grad_clip` when it is positive."""
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    # FSDP2: each rank holds shards of the gradients, and the norm over them is a DTensor awaiting the sum of
    # the ranks' squared norms; full_tensor() is that one all-reduce, and every rank gets the total norm.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def optimizer_step(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_cross_entropy_sum,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
) -> StepResult:
    """Run one accumulation group (this rank's A micro-batches) and at most one optimizer update.

    `model` is the DDP-wrapped model when more than one rank trains, the plain module otherwise; its
    outputs go to `loss_sum_fn(outputs, micro_batch.labels)`, which must return the SUM of the losses of
    the supervised targets. `scaler` is a GradScaler for fp16, or None. `grad_clip` > 0 clips the total
    gradient norm. Every rank must call this with the same number of micro-batches: the syncing backward
    and the two scalar all-reduces below are matched across ranks.
    """
    if not micro_batches:
        raise ValueError("an optimizer step needs at least one micro-batch")
    world_size = data_parallel_size()
    if world_size > 1 and not isinstance(model, (DistributedDataParallel, FSDPModule)):
        raise TypeError("with more than one rank the model must be wrapped in DistributedDataParallel or fully_shard")
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False)

    # 1. The global denominator N, before any forward: one collective on host-side counts.
    tokens_local = sum(count_supervised_tokens(mb.labels) for mb in micro_batches)
    examples_local = sum(mb.num_examples for mb in micro_batches)
    tokens_global, examples_global = all_reduce_ints([tokens_local, examples_local], device)
    # A step without a supervised token has no loss to average. Its micro-batches still run (every sum is
    # empty, so they add exactly zero) so that all ranks take part in the same collectives, and the update
    # is skipped below. max(N, 1) only avoids dividing by zero.
    loss_multiplier = world_size / max(tokens_global, 1)

    # 2. The micro-batches. Nothing in this loop reads a value back to the host (the loss sums stay on the
    # device), so on a GPU the host keeps queueing copies and kernels while earlier ones still run.
    last = len(micro_batches) - 1
    loss_sum_local = torch.zeros((), dtype=torch.float64, device=device)  # a scalar: float64 costs nothing
    for k, micro_batch in enumerate(micro_batches):
        inputs, labels = to_device(micro_batch, device)
        # DDP all-reduces gradients during the backward of the boundary (last) micro-batch only. The forward
        # must be inside no_sync too: DDP decides at forward time whether the coming backward synchronises.
        skip_sync = k < last and isinstance(model, DistributedDataParallel)
        if isinstance(model, FSDPModule):
            # FSDP2's no_sync: gradients accumulate unsharded until the last micro-batch's backward
            # reduce-scatters their sum with ReduceOp.AVG (fp32 and bf16; a SUM and a division by D otherwise),
            # so rank r keeps shard r of (1/D)·Σ_q Σ_k ∇(S_qk·D/N) = ∇L: DDP's mean, the same ×D compensation.
            model.set_requires_gradient_sync(k == last)
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                outputs = model(inputs)
            loss_sum = loss_sum_fn(outputs, labels)  # S_rk
            scaler.scale(loss_sum * loss_multiplier).backward()  # ∇(S_rk · D / N), times the scale
        loss_sum_local += loss_sum.detach()

    # 3. The boundary: one more scalar collective for the exact logged loss, then one update.
    loss_sum_global = loss_sum_local
    if dist.is_initialized():
        dist.all_reduce(loss_sum_global, op=dist.ReduceOp.SUM)
    lr = optimizer.param_groups[0]["lr"]
    applied, skip_reason, grad_norm = False, None, 0.0
    if tokens_global == 0:
        skip_reason = "no supervised tokens in the step"
        loss = math.nan
    else:
        scaler.unscale_(optimizer)  # once per step, so clipping sees true gradient values
        grad_norm_tensor = gradient_norm(model, grad_clip)
        # The step's one read-back of device values.
        loss_sum_value, grad_norm = torch.stack([loss_sum_global, grad_norm_tensor.double()]).tolist()
        loss = loss_sum_value / tokens_global
        if scaler.is_enabled():
            # scaler.step skips optimizer.step when unscale_ found an inf or nan, and update() then lowers
            # the scale. step() returns None either way, so a lowered scale is how a skip is recognised.
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            applied = scaler.get_scale() >= scale_before
            if not applied:
                skip_reason = "non-finite gradient (GradScaler lowered its scale)"
        elif math.isfinite(grad_norm):
            optimizer.step()
            applied = True
        else:
            skip_reason = "non-finite gradient"
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss, tokens_global, examples_global, applied, grad_norm, skip_reason, lr, micro_batches=len(micro_batches)
    )
