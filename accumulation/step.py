"""One optimizer step from one rank's micro-batches: exact token-weighted gradient accumulation.

The objective of a step is the mean loss over every supervised token of the global batch:

    L = (1 / N) · Σ_r Σ_k S_rk

where S_rk is the *sum* of per-token losses of micro-batch k on data-parallel replica r and N counts the supervised
tokens (or the unit its objective declares, GlobalCounts.unit) of all micro-batches of all replicas. Micro-batches
may hold very different token counts (padding, short documents); a mean of per-micro-batch means would weight a
token of a short one more. Here every token counts once.

Backward adds gradients into `.grad` (a SUM over micro-batches), and the data-parallel reduction then *averages*
over the D replicas (DDP's all-reduce, FSDP2's reduce-scatter). So each replica backpropagates

    loss_rk = S_rk · D / N,   and   (1 / D) · Σ_r Σ_k ∇(S_rk · D / N) = (1 / N) · Σ_r Σ_k ∇S_rk = ∇L.

N is known before the first forward and costs no collective: the data order is a pure function of (seed, step, G),
so every rank counts the step's supervised targets from its row ids on the host (train.py's `global_counts`).

One step function serves every layout; how the micro-batches run is a Strategy's (below): DataParallel (one
process or DDP), FullyShardedDataParallel (parallel/fsdp.py), Pipeline (parallel/pipeline.py). What stays the same
from step to step (the module, the device, the loss, the scaler, the clip, the autocast dtype, the strategy) is one
StepSetup, built once per run (accumulation/run/build.py's build_training for train.py, the checker and the scripts).

The loss: `loss_sum_fn(outputs, labels, **extras)` returns the SUM of the supervised targets' losses; the extras are
the micro-batch's per-row tensors (MicroBatch.extras; none for most losses). None: `module(inputs, labels, **extras)`
returns S itself (the forward and the loss compiled as one region, models/forward_and_loss.py).
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, counts_over_replicas


@dataclass
class StepResult:
    """What one optimizer step did. The caller steps the scheduler and adds this to its counters."""

    loss: float  # the objective L above: Σ S / N (the mean over supervised targets by default); nan without targets
    tokens: int  # supervised targets in this step, all replicas
    examples: int  # real examples in this step, all replicas (padding rows excluded)
    applied: bool  # whether the optimizer update was applied
    grad_norm: float  # total gradient norm before clipping (of the unscaled gradient)
    skip_reason: str | None  # why the update was not applied, when it was not
    lr: float  # learning rate of the optimizer's first parameter group during this step
    micro_batches: int  # forward+backward passes on this rank (A)
    micro_batch_size: int = 0  # rows per micro-batch (m); smaller than configured after an out-of-memory retry
    stop_requested: bool = False  # whether any rank's stop_requested() said True at this step's boundary
    loss_scale: float = 1.0  # the GradScaler's scale this step's losses were multiplied by (1.0 without one)
    normaliser: float = 0.0  # N, in `unit`: the supervised targets (= tokens) unless the objective declares another
    unit: str = "targets"


def token_cross_entropy_sum(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default loss: S, the SUM of cross-entropy over supervised targets (labels != -100). `outputs`: logits with
    the classes last ([rows, seq_len, vocab] with labels [rows, seq_len], or [rows, classes] with labels [rows]),
    computed in at least float32 (autocast's bf16/fp16 logits are upcast; float64 stays float64)."""
    outputs = outputs.to(torch.promote_types(outputs.dtype, torch.float32))
    logits = outputs.reshape(-1, outputs.shape[-1])
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def squared_norm(gradients: list[torch.Tensor]) -> torch.Tensor:
    """‖g‖² over a list of tensors, float64, on their device (a zero on the host for an empty list)."""
    return torch.nn.utils.get_total_norm(gradients).double().square()


@dataclass
class MicroBatchLoss:
    """What every strategy does with one micro-batch: S_rk from the loss, and ∇(S_rk · D / N) into `.grad`."""

    loss_sum_fn: Callable | None  # None: the module computes S itself, module(inputs, labels, **extras)
    multiplier: float  # D / N
    scaler: torch.amp.GradScaler
    device: torch.device
    autocast_dtype: torch.dtype | None

    def autocast(self):
        # The loss runs under autocast too, as in nanoGPT's loop; cross-entropy runs in fp32 either way.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def forward(self, module: torch.nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        """S_rk of one micro-batch. The outputs are never bound to a name: a name would keep the logits
        [m, seq_len, vocab] alive through the backward, though the loss keeps what it needs."""
        batch = micro_batch.to(self.device)
        with self.autocast():
            if self.loss_sum_fn is None:
                return module(batch.inputs, batch.labels, **batch.extras)
            return self.loss_sum_fn(module(batch.inputs), batch.labels, **batch.extras)

    def weighted(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """S_rk · D / N, times the GradScaler's scale: what is backpropagated."""
        return self.scaler.scale(loss_sum * self.multiplier)

    def backward(self, loss_sum: torch.Tensor) -> None:
        self.weighted(loss_sum).backward()  # adds ∇(S_rk · D / N) (times the scale) into .grad


class Strategy(Protocol):
    """How one rank runs its micro-batches: `run_micro_batches` does each one's forward and backward through the
    MicroBatchLoss (S_rk, then ∇(S_rk · D / N) into .grad), the gradient sync off but for the last, and returns
    this rank's Σ_k S_rk (float64, detached); `squared_norm_share` is this rank's share of ‖∇L‖² (float64): the
    shares of all ranks sum to it."""

    replicas: int  # D: the data-parallel replicas whose gradients are averaged

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> torch.Tensor: ...

    def squared_norm_share(self, gradients: list[torch.Tensor]) -> torch.Tensor: ...


class DataParallel(Strategy):
    """The default strategy: one process, or DistributedDataParallel where every rank is one replica."""

    def __init__(self, model: torch.nn.Module):
        self.replicas = dist.get_world_size() if dist.is_initialized() else 1  # D
        if self.replicas > 1 and not isinstance(model, DistributedDataParallel):
            raise TypeError("over several ranks: a DistributedDataParallel model, or the strategy of its wrapper")
        self.model = model

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> torch.Tensor:
        last = len(micro_batches) - 1
        loss_sum_local = torch.zeros((), dtype=torch.float64, device=loss.device)  # a scalar: float64 is free
        for k, micro_batch in enumerate(micro_batches):
            # DDP all-reduces in the backward of the last micro-batch only. The forward must be inside no_sync
            # too: DDP decides at forward time whether the coming backward synchronises.
            in_no_sync = k < last and isinstance(self.model, DistributedDataParallel)
            with self.model.no_sync() if in_no_sync else contextlib.nullcontext():
                loss_sum = loss.forward(self.model, micro_batch)  # S_rk
                loss.backward(loss_sum)
            loss_sum_local += loss_sum.detach()
        return loss_sum_local

    def squared_norm_share(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        # Every replica holds the same averaged gradient: D equal shares sum to ‖g‖².
        return squared_norm(gradients) / self.replicas


@dataclass
class StepSetup:
    """What every optimizer step of a run shares, built once: optimizer_step's first argument."""

    module: torch.nn.Module  # what runs each micro-batch: the model as training wraps it (compiled, in DDP over
    # more than one rank, sharded by FSDP2, or this rank's pipeline stage), with its loss inside when compiled
    device: torch.device  # where the micro-batches go and the step's float64 scalars live
    loss_sum_fn: Callable | None = token_cross_entropy_sum  # S of (outputs, labels, **extras); None: module returns S
    scaler: torch.amp.GradScaler | None = None  # fp16's GradScaler; None: a disabled one (every scale is 1)
    grad_clip: float = 0.0  # the largest L2 norm of the whole unscaled gradient ∇L (the loss's unit per parameter
    # unit); a larger one is scaled down to it; 0: no clipping
    autocast_dtype: torch.dtype | None = None  # torch.bfloat16 or torch.float16 autocast; None: plain fp32
    strategy: Strategy | None = None  # how the micro-batches run; None: DataParallel(module)

    def __post_init__(self):
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=False)
        if self.strategy is None:
            self.strategy = DataParallel(self.module)


def optimizer_step(
    setup: StepSetup,
    micro_batches: list[MicroBatch],
    optimizer: torch.optim.Optimizer,
    *,
    global_counts: GlobalCounts | None = None,
    stop_requested: Callable[[], bool] | None = None,
    before_read_back: Callable[[], None] | None = None,
) -> StepResult:
    """One accumulation group (this rank's A micro-batches) and at most one optimizer update.

    `setup`: the run's module, device, loss, scaler, clip, autocast dtype and strategy (StepSetup above).
    Every rank calls this with as many micro-batches: the collectives are matched across ranks. `global_counts`:
    the step's targets and examples over all replicas, when the caller knows them. `stop_requested`: asked at the
    boundary; its answer travels in the boundary's all-reduce, so all ranks learn it at the same step.
    `before_read_back`: host work (train.py builds the next step's batches) run while the device works."""
    if not micro_batches:
        raise ValueError("an optimizer step needs at least one micro-batch")
    strategy, scaler, device = setup.strategy, setup.scaler, setup.device

    # 1. The global denominator N, before any forward.
    if global_counts is None:  # the fallback: one collective on host-side counts
        global_counts = counts_over_replicas(micro_batches, strategy.replicas, device)
    # A step without a supervised token still runs its micro-batches (adding exactly zero) so that all ranks take
    # part in the same collectives; its update is skipped. N = 0 becomes 1 only to avoid dividing by zero.
    multiplier = strategy.replicas / (global_counts.n or 1)  # D / N
    loss = MicroBatchLoss(setup.loss_sum_fn, multiplier, scaler, device, setup.autocast_dtype)

    # 2. The micro-batches, gradient sync off but for the last: Σ_k ∇(S_rk · D / N) in .grad, averaged over D.
    loss_sum_local = strategy.run_micro_batches(micro_batches, loss)
    # Only for the log: a sum still attached to autograd would chain every micro-batch's graph to it until
    # the step ends, and no value would show it; so this flag read, which costs nothing, guards it.
    assert not loss_sum_local.requires_grad, "the logged loss sum must be accumulated detached"

    # 3. The boundary: ONE float64 all-reduce carries the loss sum (for the exact logged loss), the stop flag and
    # the squared gradient norm, assembled from each rank's share (a stage, a shard, or one of D equal copies).
    # The norm is of the gradient still times the scale; the scale is a power of two, so dividing the norm by it
    # is exact. The flag is filled on the device (no host-to-device copy).
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    stop_here = stop_requested is not None and stop_requested()
    norm_share = strategy.squared_norm_share([p.grad for p in parameters]).to(loss_sum_local.device)
    summed = torch.stack([loss_sum_local, loss_sum_local.new_full((), float(stop_here)), norm_share])
    if dist.is_initialized():
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    scale = scaler.scale(loss_sum_local.new_ones(()))  # 1 without a scaler (public API; get_scale() would sync)
    grad_norm_tensor = summed[2].sqrt() / scale

    # 4. Unscale, clip, update: all queued on the device before the read-back.
    if scaler.is_enabled() and parameters:
        # One decision for all ranks: a rank holding only part of the gradient (a stage, a shard) marks its own
        # part non-finite when the whole is, so that every rank's unscale_ finds it and lowers its scale alike.
        part = parameters[0].grad
        part = part.to_local() if hasattr(part, "to_local") else part  # an FSDP2 DTensor: this rank's shard
        part.view(-1)[:1].add_(torch.where(torch.isfinite(grad_norm_tensor), 0.0, math.inf))
    scaler.unscale_(optimizer)  # once per step, so clipping sees true gradient values
    if setup.grad_clip > 0:  # scale every gradient by grad_clip / (norm + 1e-6) when that is below 1
        torch.nn.utils.clip_grads_with_norm_(parameters, setup.grad_clip, grad_norm_tensor)
    update_queued = False
    if global_counts.tokens > 0 and all(group.get("fused") for group in optimizer.param_groups):
        from accumulation.update_on_device import queue_update_unless_non_finite

        update_queued = queue_update_unless_non_finite(optimizer, scaler, grad_norm_tensor)
    lr = optimizer.param_groups[0]["lr"]
    if before_read_back is not None:
        before_read_back()
    # The step's one read-back of device values (on CUDA the host waits here for the step's work).
    loss_sum_value, stops, grad_norm, loss_scale = torch.stack([summed[0], summed[1], grad_norm_tensor, scale]).tolist()

    # 5. At most one update, or the reason for none.
    loss_value, applied, skip_reason = update_or_skip(
        optimizer, scaler, loss_sum_value, global_counts, grad_norm, update_queued
    )
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss_value,
        global_counts.tokens,
        global_counts.examples,
        applied,
        grad_norm,
        skip_reason,
        lr,
        micro_batches=len(micro_batches),
        micro_batch_size=micro_batches[0].labels.shape[0],
        stop_requested=stops > 0,
        loss_scale=loss_scale,
        normaliser=global_counts.n,
        unit=global_counts.unit,
    )


def update_or_skip(optimizer, scaler, loss_sum_value: float, counts: GlobalCounts, grad_norm: float, update_queued):
    """(the step's loss Σ S / N, whether its update was applied, why not). `update_queued`: the update (and the
    scaler's) is already on the device, applied exactly when the norm is finite; here only the outcome is told."""
    if counts.tokens == 0:
        scaler.update()
        return math.nan, False, "no supervised tokens in the step"
    # The norm is non-finite exactly when some gradient is inf or nan (or, for finite gradients beyond 1e19, when
    # their squares overflow); the mark above then makes the GradScaler's found-inf agree. A finite norm: the
    # scaler's step() applies the update (optimizer.step() when the scaler is off). A non-finite one: no step;
    # update() still sees the found-inf and lowers the scale. Every rank has the same norm: the same decision.
    applied = math.isfinite(grad_norm)
    if applied and not update_queued:
        scaler.step(optimizer)
    if not update_queued:
        scaler.update()
    skip_reason = None
    if not applied:
        skip_reason = "non-finite gradient" + (" (GradScaler lowered its scale)" if scaler.is_enabled() else "")
    return loss_sum_value / counts.n, applied, skip_reason
