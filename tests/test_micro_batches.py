"""Micro-batches: a step sees the same examples for every (m, A, D), padding, evaluation batches, and the rows
interface with its RawExample reference."""

import math

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.data import rows as rows_module
from accumulation.data import sources as data
from accumulation.data.jsonl import make_example_rows
from accumulation.data.rows import DataError, RawExample, RowSet, labels_from_mask, make_rows
from accumulation.data.step_tools import build_micro_batches
from tests.test_rows import assert_rows_match_their_raw_examples, real_examples

# ---------------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------------

LAYOUTS = [(8, 1, 1), (2, 4, 1), (4, 1, 2), (1, 4, 2)]  # (m, A, D), all with G = 8


@pytest.fixture(scope="module")
def small_rows() -> RowSet:
    documents = [f"document {index}: ".encode() + b"abcdefghijklmnopqrstuvwxyz"[: index % 26] for index in range(30)]
    return make_rows(documents, seq_len=12)


@pytest.fixture(scope="module")
def example_rows() -> RowSet:
    """Prompt/response rows: prompts of 11 to 17 bytes, responses of 1 to 13, some truncated, some dropped."""
    examples = [
        (f"prompt {index}: ".encode() + b"?" * (index % 7), b"abcdefghijklmnopqrstuvwxyz"[: 1 + index % 13])
        for index in range(30)
    ]
    built = make_example_rows(examples, seq_len=12)
    assert built.truncated > 0 and built.dropped > 0
    return built.rows


@pytest.fixture(params=["documents", "prompt/response examples"])
def any_rows(request, small_rows, example_rows) -> RowSet:
    return small_rows if request.param == "documents" else example_rows


def all_ranks(rows, step_ids, micro_batch_size, accumulation, world_size) -> list[list]:
    batches = [
        build_micro_batches(rows, step_ids, 8, micro_batch_size, world_size, rank, step=0) for rank in range(world_size)
    ]
    for rank_batches in batches:
        assert len(rank_batches) == accumulation
        assert all(batch.inputs.shape == (micro_batch_size, rows.seq_len) for batch in rank_batches)
    return batches


@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_a_step_sees_the_same_examples_for_every_m_a_d(any_rows, tail):
    steps = data.steps_per_epoch(any_rows.num_rows, 8, tail)
    for step in range(2 * steps):  # two epochs, with a partial step in each when tail is "partial"
        step_ids = data.step_row_ids(any_rows.num_rows, 8, seed=11, step=step, tail=tail)
        (reference,) = build_micro_batches(any_rows, step_ids, 8, 8, 1, 0, step=0)
        expected = real_examples([reference])
        assert sum(expected.values()) == len(step_ids) == reference.num_examples
        for micro_batch_size, accumulation, world_size in LAYOUTS:
            batches = all_ranks(any_rows, step_ids, micro_batch_size, accumulation, world_size)
            flat = [batch for rank_batches in batches for batch in rank_batches]
            assert real_examples(flat) == expected
            assert sum(batch.num_examples for batch in flat) == len(step_ids)


def test_inputs_and_labels_are_the_row_shifted_by_one(small_rows):
    step_ids = torch.tensor([3, 0, 17, 5])
    (batch,) = build_micro_batches(small_rows, step_ids, 4, 4, 1, 0, step=0)
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64
    for row, row_id in enumerate(step_ids.tolist()):
        length = int(small_rows.lengths[row_id])
        tokens = small_rows.tokens[row_id].long()
        assert torch.equal(batch.inputs[row], tokens[:-1])
        assert torch.equal(batch.labels[row, : length - 1], tokens[1:length])
        assert (batch.labels[row, length - 1 :] == IGNORE_INDEX).all()


def test_a_partial_step_is_padded_so_every_rank_runs_the_same_micro_batches(small_rows):
    step_ids = torch.tensor([4, 9, 1])  # 3 of G = 8
    batches = all_ranks(small_rows, step_ids, micro_batch_size=2, accumulation=2, world_size=2)
    assert [[batch.num_examples for batch in rank_batches] for rank_batches in batches] == [[2, 1], [0, 0]]
    padding_only = batches[1][1]
    assert (padding_only.labels == IGNORE_INDEX).all() and (padding_only.inputs == 0).all()
    assert (batches[0][1].labels[1] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="at most 8 row ids"):
        build_micro_batches(small_rows, torch.arange(9), 8, 2, 2, 0, step=0)


@pytest.mark.parametrize("micro_batch_size, world_size", [(4, 1), (3, 2), (5, 3), (64, 2)])
def test_eval_micro_batches_cover_every_row_once_over_all_ranks(any_rows, micro_batch_size, world_size):
    per_rank = [
        list(data.eval_micro_batches(any_rows, micro_batch_size, world_size, rank)) for rank in range(world_size)
    ]
    expected_count = math.ceil(math.ceil(any_rows.num_rows / micro_batch_size) / world_size)
    assert [len(batches) for batches in per_rank] == [expected_count] * world_size
    flat = [batch for batches in per_rank for batch in batches]
    assert all(batch.inputs.shape == (micro_batch_size, any_rows.seq_len) for batch in flat)
    (everything,) = build_micro_batches(
        any_rows, torch.arange(any_rows.num_rows), any_rows.num_rows, any_rows.num_rows, 1, 0, step=0
    )
    assert real_examples(flat) == real_examples([everything])
    supervised = sum(int((batch.labels != IGNORE_INDEX).sum()) for batch in flat)
    assert supervised == int(any_rows.supervised_tokens().sum())


def test_supervised_counts_equal_the_labels_that_examples_gives(any_rows):
    # The host-side count every rank uses for N must be the count of labels the loss will actually see.
    row_ids = torch.randperm(any_rows.num_rows, generator=torch.Generator().manual_seed(3))[:7]
    _, labels = any_rows.examples(row_ids)
    assert any_rows.supervised_counts(row_ids).tolist() == (labels != IGNORE_INDEX).sum(dim=1).tolist()


def test_data_order_and_eval_arguments_are_checked(small_rows):
    with pytest.raises(ValueError, match="step must be >= 0"):
        data.step_row_ids(10, 2, seed=0, step=-1, tail="drop")
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        data.step_row_ids(10, 0, seed=0, step=0, tail="partial")
    with pytest.raises(DataError, match="the training split has no rows"):
        data.step_row_ids(0, 2, seed=0, step=0, tail="partial")
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        next(data.eval_micro_batches(small_rows, 4, world_size=2, rank=2))


# ---------------------------------------------------------------------------------------------------
# The rows interface and RawExample
# ---------------------------------------------------------------------------------------------------


def test_raw_examples_agree_with_the_loops_inputs_and_labels(any_rows):
    assert_rows_match_their_raw_examples(any_rows, list(range(any_rows.num_rows)))


def test_a_masking_bug_in_the_loops_path_is_caught_by_the_raw_example_reference(example_rows, monkeypatch):
    def supervise_the_prompt_too(targets: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
        return targets  # the classic SFT bug: the prompt is trained on

    monkeypatch.setattr(rows_module, "labels_from_mask", supervise_the_prompt_too)
    with pytest.raises(AssertionError):
        assert_rows_match_their_raw_examples(example_rows, list(range(example_rows.num_rows)))


class CountingRows:
    """A fork's rows, implementing only the interface: row i is the tokens i, i+1, ..., all supervised,
    except that the first target is masked as a one-token prompt."""

    num_rows = 5
    seq_len = 4

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = row_ids[:, None] + torch.arange(self.seq_len + 1)
        supervised = torch.arange(self.seq_len) >= 1
        return tokens[:, :-1], labels_from_mask(tokens[:, 1:], supervised.expand(len(row_ids), -1))

    def raw_example(self, row_id: int, step: int) -> RawExample:
        inputs = list(range(row_id, row_id + 4))
        return RawExample(inputs=inputs, targets={1: row_id + 2, 2: row_id + 3, 3: row_id + 4})


def test_the_interface_is_all_that_micro_batches_need():
    rows = CountingRows()
    (batch,) = build_micro_batches(rows, torch.tensor([4, 1]), 4, 4, world_size=1, rank=0, step=0)
    assert batch.num_examples == 2
    assert batch.inputs.tolist() == [[4, 5, 6, 7], [1, 2, 3, 4], [0] * 4, [0] * 4]
    assert batch.labels.tolist() == [[-100, 6, 7, 8], [-100, 3, 4, 5], [-100] * 4, [-100] * 4]
    assert_rows_match_their_raw_examples(rows, [0, 3])
    assert len(list(data.eval_micro_batches(rows, 2, world_size=2, rank=1))) == 2
