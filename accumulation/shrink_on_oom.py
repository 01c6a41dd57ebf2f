"""batch.on_oom = "shrink": a step that runs out of memory is redone with micro-batches of fewer rows.

train.py's build (accumulation/run/build.py) imports this only when the config asks: the StepSetup's strategy is
then ShrinkOnOutOfMemory, and the step function `optimizer_step_shrinking_on_oom`, which takes optimizer_step's
arguments; on torch.OutOfMemoryError in the micro-batches of any rank, every rank redoes the step from its start
with micro-batches of the next smaller m (the largest divisor of m up to m/2: A grows, the examples do not
change), gradients cleared and the dropout generators restored. `StepResult.micro_batch_size` is the m that
succeeded, which the caller keeps. Micro-batches must all have m rows with any padding rows last (as
step_batch makes them). One process or DDP only (FSDP2 and pipeline stages refuse the setting).

How the ranks agree: a rank that ran out of memory stops running micro-batches and joins the gradient all-reduce
of the others' last backward with a one-row forward and backward of its last micro-batch, weighted by zero (the
gradients are thrown away anyway). Then one all-reduce of the out-of-memory flags, after the micro-batches and
before the step's boundary, tells every rank whether to redo the step: all shrink alike, before anything was
unscaled or updated. In the backward of the last micro-batch DDP has already sent some gradient buckets and cannot
take them back: there the error becomes a RuntimeError, and the launcher ends every rank.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import MicroBatch, divisors
from accumulation.step import DataParallel, MicroBatchLoss, StepResult, StepSetup, Strategy, optimizer_step


def smaller_micro_batch_size(micro_batch_size: int) -> int | None:
    """The micro-batch size to retry with after running out of memory: the largest divisor of m up to m/2 (half
    of an even m), or None for m = 1. A divisor of m, so each micro-batch splits into whole smaller ones, and
    A·m per rank stays the same."""
    smaller = [d for d in divisors(micro_batch_size) if d <= micro_batch_size // 2]
    return smaller[-1] if smaller else None


def split_micro_batches(micro_batches: list[MicroBatch], micro_batch_size: int) -> list[MicroBatch]:
    """Each micro-batch cut into consecutive pieces of `micro_batch_size` rows, in order.

    Because micro-batch k of a rank holds the k-th run of m of its positions (micro_batch_slices), piece j of
    it holds exactly what micro-batch k·(m/m') + j holds at m': the same micro-batches train.py would build
    at the smaller size, padding included. Padding rows must come last in each micro-batch (as
    step_batch puts them), so a piece's real examples are what is left of the micro-batch's.
    """
    pieces = []
    for micro_batch in micro_batches:
        rows = micro_batch.labels.shape[0]
        if rows % micro_batch_size != 0:
            raise ValueError(f"a micro-batch of {rows} rows does not split into pieces of {micro_batch_size}")
        pieces += [
            micro_batch.rows(slice(first, first + micro_batch_size)) for first in range(0, rows, micro_batch_size)
        ]
    return pieces


class OutOfMemoryOnSomeRank(Exception):
    """Some rank ran out of memory in this step's micro-batches: every rank redoes the step."""


class ShrinkOnOutOfMemory(Strategy):
    """DataParallel's micro-batches, with an out-of-memory error caught, joined and shared (see above)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.data_parallel = DataParallel(model)  # D and the norm's shares are DataParallel's
        self.replicas = self.data_parallel.replicas

    def squared_norm_share(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        return self.data_parallel.squared_norm_share(gradients)

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> torch.Tensor:
        last = len(micro_batches) - 1
        loss_sum_local = torch.zeros((), dtype=torch.float64, device=loss.device)
        out_of_memory = False
        ddp = isinstance(self.model, DistributedDataParallel)
        for k, micro_batch in enumerate(micro_batches):
            syncing = k == last and ddp
            try:
                with self.model.no_sync() if k < last and ddp else contextlib.nullcontext():
                    loss_sum = loss.forward(self.model, micro_batch)
                    try:
                        loss.backward(loss_sum)
                    except torch.OutOfMemoryError as error:
                        if syncing:  # not an OutOfMemoryError any more, so nobody tries to recover
                            raise RuntimeError(
                                "out of memory in the backward that all-reduces the gradients, which DDP cannot take "
                                "back; set batch.micro_batch_size smaller"
                            ) from error
                        raise
            except torch.OutOfMemoryError:
                if micro_batch.labels.shape[0] == 1:
                    raise
                out_of_memory = True
            if out_of_memory:  # outside the except clause: its traceback no longer holds the activations
                self.join_the_others(micro_batches[last], loss)
                break
            loss_sum_local += loss_sum.detach()
        # Every rank, out of memory or not, reaches this all-reduce after its micro-batches: all learn it together.
        flags = torch.tensor([float(out_of_memory)], device=loss.device)
        if dist.is_initialized():
            dist.all_reduce(flags)
        if flags.item() > 0:  # a read-back of the flag: the price of this option, once per step
            raise OutOfMemoryOnSomeRank
        return loss_sum_local

    def join_the_others(self, last_micro_batch: MicroBatch, loss: MicroBatchLoss) -> None:
        """The other ranks, not knowing yet, run their last micro-batch, whose backward all-reduces the gradients:
        this rank joins with one row of its last micro-batch, weighted by zero (a syncing forward: outside no_sync)."""
        if loss.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed micro-batch's activations are free by now; hand them back
        if isinstance(self.model, DistributedDataParallel):
            (loss.forward(self.model, last_micro_batch.rows(slice(0, 1))) * 0.0).backward()


def optimizer_step_shrinking_on_oom(
    setup: StepSetup, micro_batches: list[MicroBatch], optimizer, **step_options
) -> StepResult:
    """optimizer_step, redone with smaller micro-batches while some rank runs out of memory. `setup.strategy` must
    be ShrinkOnOutOfMemory (accumulation/run/build.py builds it for batch.on_oom = "shrink"); `step_options`:
    optimizer_step's global_counts, stop_requested and before_read_back."""
    if not isinstance(setup.strategy, ShrinkOnOutOfMemory):
        raise TypeError(
            "the out-of-memory retry runs ShrinkOnOutOfMemory's micro-batches: build the StepSetup with "
            "strategy=ShrinkOnOutOfMemory(module) (one process or DDP; FSDP2 and pipeline stages cannot be retried)"
        )
    dropout_states = generator_states(setup.device)
    while True:
        try:
            return optimizer_step(setup, micro_batches, optimizer, **step_options)
        except OutOfMemoryOnSomeRank:
            micro_batch_size = micro_batches[0].labels.shape[0]
            smaller = smaller_micro_batch_size(micro_batch_size)
            if smaller is None:
                raise torch.OutOfMemoryError(
                    f"out of memory with micro-batches of {micro_batch_size} row on some rank"
                ) from None
            optimizer.zero_grad(set_to_none=True)
            restore_generator_states(dropout_states, setup.device)
            micro_batches = split_micro_batches(micro_batches, smaller)


def generator_states(device: torch.device) -> list[torch.Tensor]:
    """The generators dropout draws from: the CPU's and, on CUDA, the device's (host-side copies, no sync)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def restore_generator_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
