"""The data order at scale: a permutation of the row ids per epoch, computed position by position, so that
10**11 rows cost what 10 do. Small row counts are checked exhaustively, a count too large to materialize
by sampling, with an inverse written here from the Feistel network's definition."""

import tracemalloc

import numpy as np
import pytest
import torch

from accumulation.data import sources as data
from accumulation.data.rows import RawExample, mix64
from accumulation.data.step_tools import build_micro_batches, epoch_permutation

HUGE_ROWS = 10**11  # 800 GB as an int64 permutation: only sampling can check it


def inverse_row_positions(num_rows: int, seed: int, epoch: int, row_ids: np.ndarray) -> np.ndarray:
    """The positions whose row ids are `row_ids`: the Feistel rounds undone in reverse order, each round
    (L, R) -> (R, L xor F(R)) inverted as (L', R') -> (R' xor F(L'), L'), walking back while out of range."""
    keys, half_bits = data.feistel_round_keys(seed, epoch), data.feistel_half_bits(num_rows)
    shift, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)

    def inverse(values):
        left, right = values >> shift, values & mask
        for key in keys[::-1]:
            left, right = right ^ (mix64(left ^ key) & mask), left
        return (left << shift) | right

    values = inverse(row_ids.astype(np.uint64))
    while (values >= num_rows).any():
        values[values >= num_rows] = inverse(values[values >= num_rows])
    return values.astype(np.int64)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 1000, 4097, 100_003])
def test_every_epoch_is_a_permutation_of_all_rows(num_rows):
    orders = [epoch_permutation(num_rows, seed=5, epoch=epoch) for epoch in range(3)]
    for order in orders:
        assert order.dtype == torch.int64
        assert torch.equal(order.sort().values, torch.arange(num_rows))
    if num_rows >= 5:  # 5! = 120 orders: two epochs (or two seeds) agreeing would be a bug, not chance
        assert not torch.equal(orders[0], orders[1])
        assert not torch.equal(orders[0], epoch_permutation(num_rows, seed=6, epoch=0))


def test_the_order_looks_shuffled():
    """The row at position 0 over 16,000 epochs of 8 rows: each of the 8 about equally often (chi-square;
    the same test gives 88 with four Feistel rounds and 943 with two), and in a long epoch, neighbouring
    positions hardly ever hold neighbouring rows."""
    first_rows = torch.stack([data.epoch_row_ids(8, 1, epoch, torch.arange(1)) for epoch in range(16_000)])
    counts = torch.bincount(first_rows[:, 0], minlength=8).double()
    chi_square = ((counts - 2000) ** 2 / 2000).sum().item()
    assert chi_square < 24.3  # the 0.999 quantile of chi-square with 7 degrees of freedom
    order = epoch_permutation(100_003, seed=1, epoch=0)
    adjacent = (order[1:] - order[:-1]).abs() == 1
    assert adjacent.double().mean().item() < 1e-3  # a random order has ~2/num_rows of them


def test_sampled_positions_of_a_huge_epoch_map_to_distinct_rows_and_back():
    generator = np.random.default_rng(0)
    positions = np.unique(generator.integers(0, HUGE_ROWS, 20_000))
    positions = np.concatenate([[0, 1, HUGE_ROWS - 2, HUGE_ROWS - 1], positions])
    row_ids = data.epoch_row_ids(HUGE_ROWS, 7, 3, torch.from_numpy(positions)).numpy()
    assert ((0 <= row_ids) & (row_ids < HUGE_ROWS)).all()
    # Mapping back gives the positions again: on these samples the order is one-to-one.
    assert np.array_equal(inverse_row_positions(HUGE_ROWS, 7, 3, row_ids), positions)
    assert len(np.unique(row_ids)) == len(row_ids)


@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_steps_of_a_huge_epoch_take_consecutive_positions_and_the_tail_is_exact(tail):
    num_rows, global_batch_size = HUGE_ROWS + 300, 512  # 10**11 is a multiple of 512: 300 rows of tail
    steps = data.steps_per_epoch(num_rows, global_batch_size, tail)
    assert steps == HUGE_ROWS // 512 + (tail == "partial")
    for step in [0, 1, steps // 2, steps - 1, steps, 2 * steps + 5]:
        epoch, step_in_epoch = divmod(step, steps)
        ids = data.step_row_ids(num_rows, global_batch_size, seed=7, step=step, tail=tail)
        first = step_in_epoch * global_batch_size
        expected_size = min(global_batch_size, num_rows - first)  # 300 for the partial tail
        assert len(ids) == expected_size
        positions = inverse_row_positions(num_rows, 7, epoch, ids.numpy())
        assert np.array_equal(positions, np.arange(first, first + expected_size))


def test_the_order_of_a_huge_epoch_needs_no_memory_that_grows_with_the_rows():
    """Peak memory of a step's ids: the same for 10**3 and 10**11 rows (no table, no cache)."""

    def peak_bytes(num_rows):
        tracemalloc.start()
        data.step_row_ids(num_rows, 512, seed=1, step=3, tail="drop")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return peak

    data.step_row_ids(1000, 512, seed=1, step=3, tail="drop")  # warm-up: imports and first-call caches
    small, huge = peak_bytes(1000), peak_bytes(HUGE_ROWS)
    assert huge < 200_000 and huge < 2 * small + 50_000, (small, huge)


class IdRows:
    """HUGE_ROWS rows, each a function of its id alone: inputs and labels hold the id (the Rows interface)."""

    num_rows, seq_len = HUGE_ROWS, 2

    def examples(self, row_ids, step):
        ids = row_ids[:, None].expand(-1, self.seq_len)
        return ids.clone(), ids.clone()

    def supervised_counts(self, row_ids, step):
        return torch.full((len(row_ids),), self.seq_len)

    def raw_example(self, row_id, step):
        return RawExample(inputs=[row_id] * self.seq_len, targets=dict.fromkeys(range(self.seq_len), row_id))


@pytest.mark.parametrize("step", [0, 97_656_249, 10**9])
def test_a_huge_epochs_step_is_split_the_same_for_every_m_a_d(step):
    """G = 16 over (m, A, D) = (16,1,1), (4,4,1), (8,1,2), (1,4,4): the step's ids, each exactly once."""
    rows = IdRows()
    step_ids = data.step_row_ids(HUGE_ROWS, 16, seed=2, step=step, tail="drop")
    for micro_batch_size, world_size in [(16, 1), (4, 1), (8, 2), (1, 4)]:
        seen = []
        for rank in range(world_size):
            for batch in build_micro_batches(rows, step_ids, 16, micro_batch_size, world_size, rank, step=step):
                seen += batch.inputs[: batch.num_examples, 0].tolist()
        assert sorted(seen) == sorted(step_ids.tolist())
