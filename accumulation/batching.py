"""Batch arithmetic: global batch = m · A · D, which examples of a step go where, and what a step holds.

Words used throughout the project:
    m  micro_batch_size   examples per forward/backward on one rank
    A  accumulation_steps micro-batches per optimizer step on one rank
    D  world_size         data-parallel ranks
    G  global_batch_size  examples per optimizer step over all ranks, G = m · A · D
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Label value that marks a position without a target (padding). The loss ignores it, and it is not
# counted as a supervised token.
IGNORE_INDEX = -100


# What a model reads: one tensor [rows, ...] of any dtype (int64 token ids [rows, seq_len], float images
# [rows, C, H, W], feature vectors [rows, F]), or a tuple or a dict of such tensors (several per example), rows first.
Inputs = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


def map_inputs(function, inputs: Inputs) -> Inputs:
    """`function` applied to the inputs' tensor, or to each tensor of a tuple or dict of them."""
    if isinstance(inputs, dict):
        return {name: function(tensor) for name, tensor in inputs.items()}
    return tuple(function(tensor) for tensor in inputs) if isinstance(inputs, tuple) else function(inputs)


@dataclass
class MicroBatch:
    """What one rank feeds to one forward/backward pass. Tensors live on the host (CPU)."""

    inputs: Inputs  # [rows, ...]: int64 token ids [rows, seq_len], or any tensor(s) the model reads (see Inputs)
    labels: torch.Tensor  # int64 [rows, seq_len] next-token targets (or [rows], one per example), IGNORE_INDEX
    # where nothing is supervised
    num_examples: int  # real rows in this micro-batch (padding rows excluded)
    # Per-row or per-position tensors [rows, ...] the loss reads besides the labels (weights, advantages, old
    # log-probabilities), by name: each reaches the loss as a keyword, loss_sum_fn(outputs, labels, weights=...),
    # split with the rows wherever the rows are split. Empty for a loss that reads the labels alone.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, function) -> "MicroBatch":
        """`function` applied to every tensor (inputs, labels, extras); the example count kept."""
        extras = {name: function(tensor) for name, tensor in self.extras.items()}
        return MicroBatch(map_inputs(function, self.inputs), function(self.labels), self.num_examples, extras)

    def pinned(self) -> "MicroBatch":
        """A copy in page-locked host memory, from which a copy to a GPU runs asynchronously (CUDA only)."""
        return self.map(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> "MicroBatch":
        """The micro-batch on `device`. From pinned host memory (train.py pins on CUDA) the copy is asynchronous:
        the host does not wait for it, and the GPU runs it just before the forward."""
        return self.map(lambda tensor: tensor.to(device, non_blocking=True))

    def rows(self, selected: slice) -> "MicroBatch":
        """The rows `selected` of every tensor (extras included), and the real examples among them (padding
        rows come last)."""
        first, stop, _ = selected.indices(self.labels.shape[0])
        real = min(max(self.num_examples - first, 0), max(stop - first, 0))
        return MicroBatch(
            map_inputs(lambda tensor: tensor[selected], self.inputs),
            self.labels[selected],
            real,
            {name: tensor[selected] for name, tensor in self.extras.items()},
        )


@dataclass(frozen=True)
class GlobalCounts:
    """What the whole step holds over all replicas, counted on the host before the first forward."""

    tokens: int  # supervised targets
    examples: int  # real examples (padding rows excluded)
    normaliser: float | None = None  # N in the unit its objective declares (RL: sequences, groups); None: tokens
    unit: str = "targets"  # what N counts

    @property
    def n(self) -> float:
        return self.tokens if self.normaliser is None else self.normaliser


def count_supervised_tokens(labels: torch.Tensor) -> int:
    """Targets that count, whatever the shape of `labels`. They live on the host: no device read."""
    return int((labels != IGNORE_INDEX).sum())


def collective_device(device: torch.device) -> torch.device:
    """Where a tensor must be for a collective of the initialised process group: NCCL reduces device tensors only,
    gloo host tensors."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_ints(values: list[int], device: torch.device) -> list[int]:
    """Sum a few integers over all ranks with one collective (identity on a single process)."""
    if not dist.is_initialized():
        return list(values)
    summed = torch.tensor(values, dtype=torch.int64, device=collective_device(device))
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.tolist()


def counts_over_replicas(micro_batches: list[MicroBatch], replicas: int, device: torch.device) -> GlobalCounts:
    """The step's counts from this rank's micro-batches, summed over all ranks by one collective: for a caller that
    does not know them beforehand. The ranks of one replica (its pipeline stages) hold the same rows, so each
    replica is counted once."""
    tokens_local = sum(count_supervised_tokens(mb.labels) for mb in micro_batches)
    examples_local = sum(mb.num_examples for mb in micro_batches)
    ranks_per_replica = (dist.get_world_size() if dist.is_initialized() else 1) // replicas
    tokens_all, examples_all = all_reduce_ints([tokens_local, examples_local], device)
    return GlobalCounts(tokens_all // ranks_per_replica, examples_all // ranks_per_replica)


def divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """A = G / (m · D), which must be a positive whole number: nothing is ever rounded."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if global_batch_size % world_size != 0:
        lower = global_batch_size - global_batch_size % world_size
        options = [g for g in (lower, lower + world_size) if g > 0]
        raise ValueError(
            f"global batch {global_batch_size} cannot be split evenly over {world_size} ranks; "
            f"use a global batch that is a multiple of {world_size} "
            f"(e.g. {' or '.join(str(g) for g in options)})"
        )
    per_rank = global_batch_size // world_size
    if per_rank % micro_batch_size != 0:
        raise ValueError(
            f"global batch {global_batch_size} over {world_size} ranks is {per_rank} examples per rank, "
            f"which micro batch {micro_batch_size} does not divide; "
            f"micro_batch_size must be one of {divisors(per_rank)}"
        )
    return per_rank // (micro_batch_size)


def describe_batch(global_batch_size: int, micro_batch_size: int, world_size: int, pipeline_stages: int = 1) -> str:
    """The derivation as printed at start-up, e.g. 'global 32 = micro 4 x accum 4 x ranks 2'; with pipeline
    stages `world_size` is still the data-parallel size D, and the stages and ranks follow:
    'global 8 = micro 2 x accum 2 x replicas 2 examples per update; 2 pipeline stages, 4 ranks' (the words
    "examples per update" are the caller's)."""
    accum = accumulation_steps(global_batch_size, micro_batch_size, world_size)
    if pipeline_stages == 1:
        return f"global {global_batch_size} = micro {micro_batch_size} x accum {accum} x ranks {world_size}"
    return f"global {global_batch_size} = micro {micro_batch_size} x accum {accum} x replicas {world_size}"


def micro_batch_slices(global_batch_size: int, micro_batch_size: int, world_size: int, rank: int) -> list[slice]:
    """Positions, within the step's list of G example ids, that rank `rank` feeds to each of its A micro-batches.

    The layout is fixed and rank-major: rank r owns positions [r·m·A, (r+1)·m·A), and its micro-batch k
    takes the k-th run of m of them. Because the step's list of ids is chosen before the layout is applied,
    changing m, A or D regroups the same examples and never changes which examples a step sees.
    A partial final step simply has fewer ids than G: slices past its end select nothing, and the batch
    builder fills those rows with padding.
    """
    accum = accumulation_steps(global_batch_size, micro_batch_size, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    first = rank * micro_batch_size * accum
    return [slice(first + k * micro_batch_size, first + (k + 1) * micro_batch_size) for k in range(accum)]
