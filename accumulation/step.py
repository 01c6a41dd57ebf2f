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

N is known before the first forward and costs no collective: the data order is a pure function of (seed,
step, G), so every rank can count the whole step's supervised targets from the step's row ids on the host
(train.py passes them as `global_counts`). A fork whose data loader does not know the global batch leaves
`global_counts` out; then each rank counts its own labels and one all-reduce sums the counts.

This file is the whole contract a fork relies on. A fork may change the model (any `forward(inputs) ->
outputs`), the loss (any `loss_sum_fn(outputs, labels)` that returns the SUM of the losses of the supervised
targets; it runs under the forward's autocast) and the data (any labels with -100 where there is no target,
of any shape); the algebra above holds for all of them, because it only needs per-target sums and the count
N of supervised targets. (model.loss = "chunked" is one such pair: a module returning hidden states, and a
loss that applies the output head itself, accumulation/chunked_loss.py.) `loss_sum_fn=None` says the model
computes S itself, `model(inputs, labels) -> S`: that is how the forward and the loss compile as one region
(accumulation/models/factory.py, ForwardAndLoss).
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

from accumulation.batching import (
    IGNORE_INDEX,
    Inputs,
    MicroBatch,
    map_inputs,
    smaller_micro_batch_size,
    split_micro_batches,
)


@dataclass(frozen=True)
class GlobalCounts:
    """What the whole step holds over all ranks, counted on the host before the first forward."""

    tokens: int  # supervised targets (N)
    examples: int  # real examples (padding rows excluded)


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
    micro_batches: int  # forward+backward passes on this rank (A) of the attempt that counted
    micro_batch_size: int = 0  # rows per micro-batch of that attempt (m); smaller than given after an OOM
    stop_requested: bool = False  # whether any rank's stop_requested() said True at this step's boundary
    loss_scale: float = 1.0  # the GradScaler's scale this step's losses were multiplied by (1.0 without one)


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
    """D for this step: here every rank is a data-parallel replica (dist.pipeline_stages = 1). With pipeline
    stages D is world size / P (accumulation/parallel/mesh.py), and train.py runs the step of
    accumulation/parallel/pipeline.py instead."""
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


def to_device(micro_batch: MicroBatch, device: torch.device) -> tuple[Inputs, torch.Tensor]:
    """Copy a micro-batch's inputs (each tensor of them) and labels to `device`. From pinned host memory (train.py
    pins on CUDA) the copy is asynchronous: the host does not wait for it, and the GPU runs it just before the
    forward."""
    return (
        map_inputs(lambda tensor: tensor.to(device, non_blocking=True), micro_batch.inputs),
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
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = token_cross_entropy_sum,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    global_counts: GlobalCounts | None = None,
    stop_requested: Callable[[], bool] | None = None,
    shrink_on_oom: bool = False,
    before_read_back: Callable[[], None] | None = None,
) -> StepResult:
    """Run one accumulation group (this rank's A micro-batches) and at most one optimizer update.

    `model` is the DDP-wrapped (or fully_shard-ed) model when more than one rank trains, the plain module otherwise; its
    outputs go to `loss_sum_fn(outputs, micro_batch.labels)`, which must return the SUM of the losses of
    the supervised targets. `scaler` is a GradScaler for fp16, or None. `grad_clip` > 0 clips the total
    gradient norm. Every rank must call this with the same number of micro-batches: the syncing backward
    and the boundary all-reduce are matched across ranks.

    `global_counts`: the step's supervised targets and real examples over all ranks, when the caller knows
    them (train.py counts them from the step's row ids); left out, the ranks count their labels and sum
    the counts with one all-reduce. A wrong count silently scales the update: tests compare both paths.

    `stop_requested`: asked once, at the boundary after the micro-batches (so a signal that arrived during
    them counts for this step); its answer travels in the boundary's one all-reduce (no collective of its
    own), and `StepResult.stop_requested` says whether any rank asked, so all ranks stop after the same step.

    `shrink_on_oom`: on torch.OutOfMemoryError in the micro-batches, redo the step from its start with
    micro-batches of half the rows (the largest divisor of m up to m/2; A grows, the examples do not change),
    gradients cleared and the RNG restored; `StepResult.micro_batch_size` is the m that succeeded, which the
    caller keeps. Micro-batches must all have m rows with any padding rows last (as build_micro_batches
    makes them). See recover_from_out_of_memory below for how ranks agree.

    `before_read_back`: host work to overlap with the device's (train.py builds and pins the next step's
    micro-batches there), called once, after the step's work, and with a fused optimizer its update, is queued
    and before the step's one read-back, where on a GPU the host would otherwise wait.
    """
    if not micro_batches:
        raise ValueError("an optimizer step needs at least one micro-batch")
    world_size = data_parallel_size()
    if world_size > 1 and not isinstance(model, (DistributedDataParallel, FSDPModule)):
        raise TypeError("with more than one rank the model must be wrapped in DistributedDataParallel or fully_shard")
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False)

    # The step's four parts stay together here, in the order they run: each holds the maths of one stage (N, the
    # micro-batches, the boundary's one all-reduce and read-back, the update), and the boundary's values feed the
    # retry and the update. The micro-batch loop, the out-of-memory retry and the update are functions of their own.

    # 1. The global denominator N, before any forward.
    if global_counts is None:  # the fallback: one collective on host-side counts
        tokens_local = sum(count_supervised_tokens(mb.labels) for mb in micro_batches)
        examples_local = sum(mb.num_examples for mb in micro_batches)
        global_counts = GlobalCounts(*all_reduce_ints([tokens_local, examples_local], device))
    tokens_global = global_counts.tokens
    # A step without a supervised token has no loss to average. Its micro-batches still run (every sum is
    # empty, so they add exactly zero) so that all ranks take part in the same collectives, and the update
    # is skipped below. max(N, 1) only avoids dividing by zero.
    loss_multiplier = world_size / max(tokens_global, 1)
    rng_at_start = dropout_generator_states(device) if shrink_on_oom else None

    while True:
        # 2. The micro-batches (run_micro_batches): this rank's loss sum, or the flag that it ran out of memory.
        loss_sum_local, out_of_memory = run_micro_batches(
            model, micro_batches, device, loss_sum_fn, loss_multiplier, scaler, autocast_dtype, shrink_on_oom
        )

        # 3. The boundary: ONE float64 all-reduce carries the loss sum (for the exact logged loss), the stop flag
        # and the OOM flag; it is read back once, together with the gradient norm.
        # The flags are filled on the device (no host-to-device copy); a sum over ranks > 0 means some rank set one.
        stop_here = stop_requested is not None and stop_requested()
        summed = torch.stack(
            [
                loss_sum_local,
                loss_sum_local.new_full((), float(stop_here)),
                loss_sum_local.new_full((), float(out_of_memory)),
            ]
        )
        if dist.is_initialized():
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        # The scale rides along in the same read-back (scaling a one is public API; get_scale() would sync).
        summed = torch.cat([summed, scaler.scale(loss_sum_local.new_ones(1))])
        lr = optimizer.param_groups[0]["lr"]
        # A rank that ran out of memory knows the step is redone: its gradients are not worth a look.
        unscaled = tokens_global > 0 and not out_of_memory
        # The update is queued before the read-back when its skip can be decided on the device: a fused
        # optimizer, and no out-of-memory retry that the read-back could still call for. (Not under FSDP2: its
        # parameters are DTensor shards, and the fused kernels' device flag next to them is untested here.)
        update_queued = (
            unscaled and not shrink_on_oom and skips_on_the_device(optimizer) and not isinstance(model, FSDPModule)
        )
        if unscaled:
            scaler.unscale_(optimizer)  # once per step, so clipping sees true gradient values
            grad_norm_tensor = gradient_norm(model, grad_clip)
            summed = torch.cat([summed, grad_norm_tensor.double().reshape(1)])
        if update_queued:
            queue_update_unless_non_finite(optimizer, scaler, grad_norm_tensor)
        if before_read_back is not None:
            before_read_back()
            before_read_back = None  # once per step, also when an out-of-memory error redoes it
        # The step's one read-back of device values (on CUDA the host waits here for the step's work, and from
        # here on the queued update runs while the host does the step's bookkeeping).
        loss_sum_value, stops, out_of_memory_ranks, loss_scale, *grad_norm = summed.tolist()
        if out_of_memory_ranks == 0:
            break
        # Some rank ran out of memory: every rank saw it in the same all-reduce, so all shrink alike.
        micro_batches = shrink_for_retry(micro_batches, optimizer, scaler, unscaled, rng_at_start, device)

    # 4. At most one update, or the reason for none.
    grad_norm = grad_norm[0] if grad_norm else 0.0
    loss, applied, skip_reason = update_or_skip(
        optimizer, scaler, loss_sum_value, tokens_global, grad_norm, update_queued
    )
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss,
        tokens_global,
        global_counts.examples,
        applied,
        grad_norm,
        skip_reason,
        lr,
        micro_batches=len(micro_batches),
        micro_batch_size=micro_batches[0].labels.shape[0],
        stop_requested=stops > 0,
        loss_scale=loss_scale,
    )


def update_or_skip(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss_sum_value: float,
    tokens_global: int,
    grad_norm: float,
    update_queued: bool = False,
) -> tuple[float, bool, str | None]:
    """The step's mean loss, whether its update was applied, and why not. `loss_sum_value` is the sum of every
    rank's token losses, `tokens_global` the step's N, `grad_norm` the unscaled gradient's total norm.
    `update_queued`: queue_update_unless_non_finite already queued the update (and the scaler's update) on the
    device, applied exactly when the norm is finite: here only the outcome is told."""
    applied, skip_reason = False, None
    if tokens_global == 0:
        skip_reason = "no supervised tokens in the step"
        loss = math.nan
    else:
        loss = loss_sum_value / tokens_global
        # The norm is non-finite exactly when some unscaled gradient is inf or nan (or, for finite gradients
        # beyond 1e19, when their squares overflow). A finite norm means finite gradients, so the GradScaler's
        # own inf check (from unscale_) finds nothing and its step() applies the update: `applied` is what
        # happened, with no read of the scale. A non-finite norm: no step; update() still sees the scaler's
        # found-inf and lowers the scale.
        applied = math.isfinite(grad_norm)
        if applied and not update_queued:
            scaler.step(optimizer)  # optimizer.step() when the scaler is off
        elif not applied and scaler.is_enabled():
            skip_reason = "non-finite gradient (GradScaler lowered its scale)"
        elif not applied:
            skip_reason = "non-finite gradient"
        if not update_queued:
            scaler.update()
    return loss, applied, skip_reason


def skips_on_the_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can skip its own update on a device flag: PyTorch's fused implementations (fused
    AdamW, which train.py uses on CUDA; fused SGD) take the flag GradScaler hands them, found_inf."""
    return all(group.get("fused") for group in optimizer.param_groups)


def queue_update_unless_non_finite(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_norm: torch.Tensor
) -> None:
    """The step's update queued with no read of the device: applied exactly when the gradient norm is finite.

    A fused optimizer's step() reads two attributes, the ones GradScaler.step sets for it: `grad_scale` (None:
    the gradients are already unscaled, as unscale_ left them) and `found_inf`, a device flag; when it is 1 the
    fused kernels leave the weights, the moments and the step counters as they were. The flag here is "the norm
    is not finite", which holds whenever the GradScaler's own inf check (from unscale_) found something, and
    also in the one case it cannot see (finite gradients beyond 1e19 whose squares overflow): the same rule as
    update_or_skip's. scaler.update() then lowers or grows the scale from its own check, on the device too."""
    optimizer.grad_scale = None
    optimizer.found_inf = torch.logical_not(torch.isfinite(grad_norm)).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
    scaler.update()


def run_micro_batches(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    device: torch.device,
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loss_multiplier: float,
    scaler: torch.amp.GradScaler,
    autocast_dtype: torch.dtype | None,
    shrink_on_oom: bool,
) -> tuple[torch.Tensor, bool]:
    """Forward and backward of each micro-batch (accumulate), the all-reduce only in the last one's backward.
    Returns this rank's loss sum (float64, on the device) and whether it ran out of memory (shrink_on_oom).
    Nothing here reads a value back to the host (the loss sums stay on the device), so on a GPU the host keeps
    queueing copies and kernels while earlier ones still run."""
    last = len(micro_batches) - 1
    loss_sum_local = torch.zeros((), dtype=torch.float64, device=device)  # a scalar: float64 costs nothing
    out_of_memory = False
    for k, micro_batch in enumerate(micro_batches):
        try:
            loss_sum = accumulate(
                model, micro_batch, device, k < last, loss_sum_fn, loss_multiplier, scaler, autocast_dtype
            )
        except torch.OutOfMemoryError:
            if not shrink_on_oom or micro_batch.labels.shape[0] == 1:
                raise
            out_of_memory = True
        if out_of_memory:
            break
        loss_sum_local += loss_sum.detach()
    # Only for the log: a sum still attached to autograd would chain every micro-batch's graph to it until
    # the step ends, and no value would show it; so this flag read, which costs nothing, guards it.
    assert not loss_sum_local.requires_grad, "the logged loss sum must be accumulated detached"
    if out_of_memory:  # outside the except clause: its traceback no longer holds the activations
        recover_from_out_of_memory(model, micro_batches[last], device, loss_sum_fn)
    return loss_sum_local, out_of_memory


def shrink_for_retry(
    micro_batches: list[MicroBatch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    unscaled: bool,
    rng_at_start: list[torch.Tensor],
    device: torch.device,
) -> list[MicroBatch]:
    """After an out-of-memory error on some rank: the step's state put back as it was at its start, and the
    same rows in micro-batches of the next smaller m (A grows, the examples do not change)."""
    micro_batch_size = micro_batches[0].labels.shape[0]
    smaller = smaller_micro_batch_size(micro_batch_size)
    if smaller is None:
        raise torch.OutOfMemoryError(f"out of memory with micro-batches of {micro_batch_size} row on some rank")
    if unscaled and scaler.is_enabled():
        # unscale_ was recorded for this optimizer; update() with the unchanged scale forgets it and leaves
        # the scale and its growth count as they were at the step's start. (A read-back; OOMs are rare.)
        scaler.update(new_scale=scaler.get_scale())
    optimizer.zero_grad(set_to_none=True)
    restore_dropout_generator_states(rng_at_start, device)
    return split_micro_batches(micro_batches, smaller)


def accumulate(
    model: torch.nn.Module,
    micro_batch: MicroBatch,
    device: torch.device,
    skip_sync: bool,
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loss_multiplier: float,
    scaler: torch.amp.GradScaler,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Forward and backward of one micro-batch, adding ∇(S_rk · D / N) (times the scale) into `.grad`; returns S_rk.

    DDP all-reduces gradients during the backward of the boundary (last) micro-batch only. The forward must be
    inside no_sync too: DDP decides at forward time whether the coming backward synchronises."""
    inputs, labels = to_device(micro_batch, device)
    if isinstance(model, FSDPModule):
        # FSDP2's no_sync: gradients accumulate unsharded until the last micro-batch's backward
        # reduce-scatters their sum with ReduceOp.AVG (fp32 and bf16; a SUM and a division by D otherwise),
        # so rank r keeps shard r of (1/D)·Σ_q Σ_k ∇(S_qk·D/N) = ∇L: DDP's mean, the same ×D compensation.
        model.set_requires_gradient_sync(not skip_sync)
    skip_sync = skip_sync and isinstance(model, DistributedDataParallel)
    with model.no_sync() if skip_sync else contextlib.nullcontext():
        # The loss runs under autocast too, as in nanoGPT's loop: an output head inside the loss (the chunked
        # loss) multiplies in the autocast dtype, and cross-entropy runs in fp32 either way (autocast's rule for it).
        # The outputs are never bound to a name here: a name would keep the logits [m, seq_len, vocab] alive
        # through the backward, though the loss has what it needs (cross-entropy keeps its log-softmax only).
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss_sum = loss_sum_of(model, inputs, labels, loss_sum_fn)  # S_rk
        try:
            scaler.scale(loss_sum * loss_multiplier).backward()  # ∇(S_rk · D / N), times the scale
        except torch.OutOfMemoryError as error:
            if not skip_sync and isinstance(model, DistributedDataParallel):
                # Not an OutOfMemoryError any more, so nobody tries to recover: the other ranks wait for gradient
                # buckets this rank will never send (see recover_from_out_of_memory).
                raise RuntimeError(
                    "out of memory in the backward that all-reduces the gradients, which DDP cannot take back; "
                    "set batch.micro_batch_size smaller"
                ) from error
            raise
    return loss_sum


def recover_from_out_of_memory(
    model: torch.nn.Module, last_micro_batch: MicroBatch, device: torch.device, loss_sum_fn: Callable
) -> None:
    """After an OOM in some micro-batch, let the other ranks finish their step; the step is redone after it.

    Under DDP the other ranks, not knowing yet, run their last micro-batch, whose backward all-reduces the
    gradients, and then the boundary all-reduce. This rank must join both, in that order, or everyone hangs.
    It joins the gradient all-reduce with a one-row forward and backward of its last micro-batch, weighted by
    zero (the gradients are thrown away anyway; one row keeps the memory small); then the boundary all-reduce
    carries its OOM flag, and every rank redoes the step with smaller micro-batches. This holds for an OOM in
    any forward, and in a backward inside no_sync. (A model with buffers would broadcast them again in the
    joining forward after an OOM in the last forward; DDP only broadcasts buffers a model has, and ours has none.)
    In the backward of the last micro-batch DDP has already sent some gradient buckets and cannot take them
    back: accumulate() raises there instead, and the launcher ends every rank.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the failed micro-batch's activations are free by now; hand them back
    if not isinstance(model, DistributedDataParallel):
        return  # one process: nothing to join
    first_row = map_inputs(lambda tensor: tensor[:1], last_micro_batch.inputs)
    inputs, labels = to_device(MicroBatch(first_row, last_micro_batch.labels[:1], 0), device)
    # a syncing forward: the backward below all-reduces like the other ranks' do
    (loss_sum_of(model, inputs, labels, loss_sum_fn) * 0.0).backward()


def loss_sum_of(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_sum_fn) -> torch.Tensor:
    """S of one micro-batch: loss_sum_fn(model(inputs), labels), or model(inputs, labels) when the model computes
    its loss itself (loss_sum_fn is None)."""
    return model(inputs, labels) if loss_sum_fn is None else loss_sum_fn(model(inputs), labels)


def dropout_generator_states(device: torch.device) -> list[torch.Tensor]:
    """The generators dropout draws from: the CPU's and, on CUDA, the device's (host-side copies, no sync)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def restore_dropout_generator_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
