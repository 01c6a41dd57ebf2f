"""The data order: each step's row ids, a pure function of (seed, step), a new permutation every epoch."""

import pytest
import torch

from accumulation.data import sources as data
from accumulation.data.rows import DataError
from accumulation.data.step_tools import epoch_permutation

# ---------------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------------


def epoch_ids(num_rows, global_batch_size, seed, epoch, tail) -> list[torch.Tensor]:
    steps = data.steps_per_epoch(num_rows, global_batch_size, tail)
    return [
        data.step_row_ids(num_rows, global_batch_size, seed, step, tail)
        for step in range(epoch * steps, (epoch + 1) * steps)
    ]


def test_step_row_ids_is_a_pure_function_of_its_arguments():
    first = data.step_row_ids(1000, 32, seed=7, step=45, tail="drop")
    second = data.step_row_ids(1000, 32, seed=7, step=45, tail="drop")
    assert first.dtype == torch.int64
    assert torch.equal(first, second)
    first[:] = -1  # the caller owns what it gets back
    assert torch.equal(data.step_row_ids(1000, 32, seed=7, step=45, tail="drop"), second)
    assert not torch.equal(data.step_row_ids(1000, 32, seed=8, step=45, tail="drop"), second)
    assert not torch.equal(data.step_row_ids(1000, 32, seed=7, step=46, tail="drop"), second)


def test_each_epoch_is_a_new_permutation_of_all_rows_with_partial_tail():
    num_rows, global_batch_size = 103, 10
    assert data.steps_per_epoch(num_rows, global_batch_size, "partial") == 11
    assert data.rows_dropped_per_epoch(num_rows, global_batch_size, "partial") == 0
    epochs = [epoch_ids(num_rows, global_batch_size, seed=3, epoch=epoch, tail="partial") for epoch in range(3)]
    for steps in epochs:
        assert [len(ids) for ids in steps] == [10] * 10 + [3]
        assert sorted(torch.cat(steps).tolist()) == list(range(num_rows))  # no id leaks into the next epoch
    assert not torch.equal(torch.cat(epochs[0]), torch.cat(epochs[1]))
    assert torch.equal(torch.cat(epochs[2]), epoch_permutation(num_rows, 3, 2))


def test_drop_tail_uses_full_steps_and_leaves_the_rest_of_each_permutation():
    num_rows, global_batch_size = 103, 10
    assert data.steps_per_epoch(num_rows, global_batch_size, "drop") == 10
    assert data.rows_dropped_per_epoch(num_rows, global_batch_size, "drop") == 3
    for epoch in range(3):
        steps = epoch_ids(num_rows, global_batch_size, seed=3, epoch=epoch, tail="drop")
        assert [len(ids) for ids in steps] == [10] * 10
        permutation = epoch_permutation(num_rows, 3, epoch)
        assert torch.equal(torch.cat(steps), permutation[:100])
        # The same epoch with tail "partial" uses the same permutation, plus one step with the last 3 rows.
        last_partial_step = data.step_row_ids(num_rows, global_batch_size, 3, epoch * 11 + 10, "partial")
        assert torch.equal(last_partial_step, permutation[100:])


def test_a_corpus_smaller_than_one_global_batch_needs_a_partial_tail():
    with pytest.raises(DataError, match=r"has 5 rows, fewer than one global batch of 8.*batch.tail=\"partial\""):
        data.step_row_ids(5, 8, seed=0, step=0, tail="drop")
    ids = data.step_row_ids(5, 8, seed=0, step=3, tail="partial")
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="tail must be one of"):
        data.step_row_ids(5, 8, seed=0, step=0, tail="pad")
