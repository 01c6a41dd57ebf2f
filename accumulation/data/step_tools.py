"""A step's pieces built one at a time, for the scripts and tests that look at them apart (the teaching cases,
the benchmarks, the GPU checks): a whole epoch's order, a step's counts, this rank's micro-batches of given row
ids. Training builds all of them at once with accumulation/data/sources.py's step_batch.
"""

import torch

from accumulation.batching import GlobalCounts, MicroBatch, micro_batch_slices
from accumulation.data.rows import Rows
from accumulation.data.sources import epoch_row_ids, micro_batch


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch `epoch`'s whole order of row ids, materialized: for small row counts (tests, illustrations)."""
    return epoch_row_ids(num_rows, seed, epoch, torch.arange(num_rows))


def step_counts(rows: Rows, row_ids: torch.Tensor, step: int) -> GlobalCounts:
    """N (supervised targets) and the real examples of step `step`, whose rows are `row_ids`, over all ranks,
    counted on the host: every rank knows the whole step's ids, so none needs a collective to learn them."""
    return GlobalCounts(tokens=int(rows.supervised_counts(row_ids, step).sum()), examples=len(row_ids))


def build_micro_batches(
    rows: Rows,
    step_ids: torch.Tensor,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    rank: int,
    *,
    step: int,
) -> list[MicroBatch]:
    """This rank's A micro-batches of step `step`, each of exactly micro_batch_size rows.

    `step_ids` are the step's row ids (step_row_ids); micro_batch_slices says which of them this rank
    feeds to each micro-batch. A partial step has fewer than G ids, and the rows it lacks become padding,
    so every rank always runs the same number of micro-batches of the same shape.
    """
    if len(step_ids) > global_batch_size:
        raise ValueError(f"a step has at most {global_batch_size} row ids, got {len(step_ids)}")
    slices = micro_batch_slices(global_batch_size, micro_batch_size, world_size, rank)
    return [micro_batch(rows, step_ids[positions], micro_batch_size, step) for positions in slices]
