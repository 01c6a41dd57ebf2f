"""Tests for accumulation/data.py: documents, rows, the validation split, the data order, micro-batches."""

import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from accumulation import data
from accumulation.batching import IGNORE_INDEX
from accumulation.data import DataError


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def rows_of(document: bytes, seq_len: int) -> int:
    """Rows a document needs: one per seq_len of its len - 1 targets, none without a target."""
    return math.ceil((len(document) - 1) / seq_len) if len(document) >= 2 else 0


def supervised_targets(rows: data.RowSet) -> bytes:
    """Every supervised target of every row, in row order: bytes 1..length-1 of each row."""
    positions = torch.arange(rows.seq_len + 1)
    supervised = (positions >= 1) & (positions < rows.lengths[:, None].long())
    return rows.tokens[supervised].numpy().tobytes()


def real_examples(micro_batches) -> Counter:
    """The multiset of real (inputs, labels) rows, checking on the way that padding rows carry nothing."""
    examples = Counter()
    for batch in micro_batches:
        for row in range(batch.inputs.shape[0]):
            if row < batch.num_examples:
                examples[(batch.inputs[row].numpy().tobytes(), batch.labels[row].numpy().tobytes())] += 1
            else:
                assert (batch.inputs[row] == 0).all()
                assert (batch.labels[row] == IGNORE_INDEX).all()
    return examples


# ---------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------


def test_rows_of_one_document_overlap_by_one_token_and_pad_the_last():
    rows = data.make_rows([b"abcdefghij"], seq_len=4)  # 10 bytes, 9 targets -> rows of 5, 5, 2 tokens
    assert rows.tokens.dtype == torch.uint8
    assert rows.tokens.tolist() == [list(b"abcde"), list(b"efghi"), [ord("i"), ord("j"), 0, 0, 0]]
    assert rows.lengths.tolist() == [5, 5, 2]
    assert rows.supervised_tokens().tolist() == [4, 4, 1]


@pytest.mark.parametrize("seq_len", [1, 3, 8, 64])
def test_rows_round_trip_every_document_and_never_cross_into_the_next(seq_len):
    documents = [b"x", b"", b"hello world\n", b"ab", b"0123456789" * 7, b"z" * (2 * seq_len + 1)]
    rows = data.make_rows(documents, seq_len)

    assert rows.num_rows == sum(rows_of(document, seq_len) for document in documents)
    assert rows.tokens.shape == (rows.num_rows, seq_len + 1)
    assert ((rows.lengths >= 2) & (rows.lengths <= seq_len + 1)).all()
    # Concatenating the supervised targets of a document's rows gives back document[1:], for every document.
    assert supervised_targets(rows) == b"".join(document[1:] for document in documents)
    # Padding bytes are zero, and each row's inputs start where the document's text is.
    positions = torch.arange(seq_len + 1)
    assert (rows.tokens[positions >= rows.lengths[:, None].long()] == 0).all()
    first_row = 0
    for document in documents:
        for row in range(rows_of(document, seq_len)):
            length = int(rows.lengths[first_row + row])
            assert rows.tokens[first_row + row, :length].numpy().tobytes() == document[row * seq_len :][:length]
        first_row += rows_of(document, seq_len)


def test_no_documents_give_an_empty_row_set():
    rows = data.make_rows([b"", b"a"], seq_len=8)
    assert rows.num_rows == 0
    assert rows.tokens.shape == (0, 9)


def test_fingerprint_sees_tokens_lengths_and_seq_len():
    rows = data.make_rows([b"some text for a row\n"], seq_len=8)
    assert data.row_fingerprint(rows) == data.row_fingerprint(data.make_rows([b"some text for a row\n"], seq_len=8))
    assert data.row_fingerprint(rows) != data.row_fingerprint(data.make_rows([b"some text for a row!"], seq_len=8))
    assert data.row_fingerprint(rows) != data.row_fingerprint(data.make_rows([b"some text for a row\n"], seq_len=7))
    assert len(data.row_fingerprint(rows)) == 16


# ---------------------------------------------------------------------------------------------------
# Top-level blocks
# ---------------------------------------------------------------------------------------------------


def test_top_level_blocks_start_after_a_blank_line_and_keep_every_byte():
    source = (
        b"\n"
        b'"""Module docstring."""\n'
        b"import os\n"
        b"\n"
        b"\n"
        b"# A comment that heads the decorated function.\n"
        b"@decorator\n"
        b"def f():\n"
        b"    x = 1\n"
        b"    \n"
        b"    return x\n"
        b"\n"
        b"class C:\n"
        b"    pass\n"
        b"CONSTANT = 2\n"
    )
    blocks = data.split_top_level_blocks(source)
    assert b"".join(blocks) == source
    assert blocks == [
        b'\n"""Module docstring."""\nimport os\n\n\n',
        b"# A comment that heads the decorated function.\n@decorator\ndef f():\n    x = 1\n    \n    return x\n\n",
        b"class C:\n    pass\nCONSTANT = 2\n",
    ]


# ---------------------------------------------------------------------------------------------------
# Reading sources and the validation split
# ---------------------------------------------------------------------------------------------------


def test_folder_reads_text_files_recursively_in_sorted_order_and_skips_binaries(tmp_path):
    write(tmp_path / "b.txt", b"second file\n")
    write(tmp_path / "a" / "z.txt", b"first file, in a subfolder\n")
    write(tmp_path / "c.bin", b"binary\0data")
    write(tmp_path / "d.txt", b"latin-1 \xe9 is not UTF-8\n")
    write(tmp_path / "e.txt", "UTF-8 is fine: é\n".encode())

    root, files, skipped_files = data.read_text_files(str(tmp_path))
    assert root == tmp_path
    assert [file.relative_path for file in files] == ["a/z.txt", "b.txt", "e.txt"]
    assert skipped_files == 2

    corpus = data.load_corpus(str(tmp_path), seq_len=4, val_fraction=0)
    assert corpus.val is None
    assert corpus.summary.files == 3
    assert corpus.summary.skipped_files == 2
    assert corpus.summary.documents == 3
    assert "2 non-text skipped" in corpus.summary.describe()
    # Each file is one document, in sorted path order.
    assert supervised_targets(corpus.train) == b"".join(file.data[1:] for file in files)


def test_summary_numbers_are_consistent(tmp_path):
    contents = [b"a", b"", b"bc", b"line one\nline two\n", b"x" * 37]
    for index, content in enumerate(contents):
        write(tmp_path / f"file{index}.txt", content)
    corpus = data.load_corpus(str(tmp_path), seq_len=8, val_fraction=0)
    summary = corpus.summary
    assert summary.bytes == sum(len(content) for content in contents)
    assert summary.documents == 5
    assert summary.dropped_documents == 2
    assert summary.train_rows == 1 + 3 + 5
    assert summary.val_rows == 0
    assert (summary.min_supervised_tokens, summary.max_supervised_tokens) == (1, 8)
    label_positions = summary.train_rows * 8
    supervised = sum(len(content) - 1 for content in contents if len(content) >= 2)
    assert summary.padding_fraction == pytest.approx(1 - supervised / label_positions)
    assert summary.fingerprint == data.row_fingerprint(corpus.train)


def test_validation_split_is_by_file_deterministic_and_disjoint(tmp_path):
    names = [f"dir{index % 3}/file{index:02d}.txt" for index in range(40)]
    for name in names:
        write(tmp_path / name, f"the contents of {name}\n".encode())

    chosen = data.validation_paths(names, val_fraction=0.25)
    assert chosen == data.validation_paths(list(reversed(names)), val_fraction=0.25)  # not by position
    assert chosen == {name for name in names if data.path_hash(name) < 0.25}
    assert 0 < len(chosen) < len(names)

    corpus = data.load_corpus(str(tmp_path), seq_len=16, val_fraction=0.25)
    again = data.load_corpus(str(tmp_path), seq_len=16, val_fraction=0.25)
    assert corpus.summary == again.summary
    assert torch.equal(corpus.val.tokens, again.val.tokens)
    assert corpus.summary.val_files == len(chosen)
    train_text = b"".join((tmp_path / name).read_bytes()[1:] for name in sorted(names) if name not in chosen)
    val_text = b"".join((tmp_path / name).read_bytes()[1:] for name in sorted(names) if name in chosen)
    assert supervised_targets(corpus.train) == train_text
    assert supervised_targets(corpus.val) == val_text


def test_an_empty_validation_split_takes_the_file_with_the_smallest_hash():
    names = ["a.txt", "b.txt", "c.txt"]
    tiny_fraction = min(data.path_hash(name) for name in names) / 2
    assert data.validation_paths(names, tiny_fraction) == {min(names, key=data.path_hash)}
    assert data.validation_paths(names, 0) == set()
    assert data.validation_paths(["only.txt"], tiny_fraction) == set()


def test_a_single_file_is_split_at_the_newline_nearest_the_cut(tmp_path):
    text = b"".join(f"line {index:03d}\n".encode() for index in range(100))  # 100 lines of 9 bytes
    path = write(tmp_path / "one.txt", text)
    corpus = data.load_corpus(str(path), seq_len=32, val_fraction=0.1)
    # (1 - 0.1) * 900 = 810 is the end of line 90: the last 10 lines are validation.
    assert supervised_targets(corpus.train) == text[:810][1:]
    assert supervised_targets(corpus.val) == text[810:][1:]
    assert corpus.summary.files == 1

    assert data.split_at_newline(b"aaaa\nbbbbbbbbbbbbb\ncc", 0.5) == (b"aaaa\n", b"bbbbbbbbbbbbb\ncc")
    assert data.split_at_newline(b"no newline at all", 0.5) == (b"no newli", b"ne at all")
    # The final newline would leave an empty tail, so the cut falls at byte round(0.75 * 27) = 20.
    assert data.split_at_newline(b"ends with its only newline\n", 0.25) == (b"ends with its only n", b"ewline\n")

    no_validation = data.load_corpus(str(path), seq_len=32, val_fraction=0)
    assert no_validation.val is None
    assert supervised_targets(no_validation.train) == text[1:]


# ---------------------------------------------------------------------------------------------------
# Errors: one line that names the path and the fix
# ---------------------------------------------------------------------------------------------------


def assert_data_error(match: str, source: str, val_fraction: float = 0.0) -> None:
    with pytest.raises(DataError, match=match) as raised:
        data.load_corpus(source, seq_len=8, val_fraction=val_fraction)
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_a_missing_path_is_an_error(tmp_path):
    assert_data_error(rf"{tmp_path / 'nowhere'}.*does not exist.*\"stdlib\"", str(tmp_path / "nowhere"))


def test_a_single_binary_file_is_an_error(tmp_path):
    path = write(tmp_path / "image.png", b"\x89PNG\r\n\x1a\n\0\0\0")
    assert_data_error(rf"{path}.*not a text file.*UTF-8", str(path))
    path = write(tmp_path / "latin1.txt", b"caf\xe9\n")
    assert_data_error(rf"{path}.*not a text file", str(path))


def test_an_unreadable_file_is_an_error_naming_it(tmp_path, monkeypatch):
    write(tmp_path / "fine.txt", b"readable text\n")
    locked = write(tmp_path / "locked.txt", b"you may not read this\n")
    read_bytes = Path.read_bytes

    def refuse_locked(path: Path) -> bytes:  # chmod does not stop root, so refuse the read here
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", refuse_locked)
    assert_data_error(rf"cannot read {locked} \(Permission denied\); make it readable", str(tmp_path))


@pytest.mark.parametrize(
    "contents",
    [{}, {"empty.txt": b""}, {"a.txt": b"a", "b/c.txt": b"\n", "d.txt": b""}, {"binary.bin": b"\0\1\2\3"}],
    ids=["empty folder", "only empty files", "only 1-byte documents", "only binary files"],
)
def test_a_source_without_usable_text_is_an_error(tmp_path, contents):
    for name, content in contents.items():
        write(tmp_path / name, content)
    assert_data_error(rf"{tmp_path}.*has no usable text", str(tmp_path))


def test_a_split_that_leaves_training_or_validation_without_rows_is_an_error(tmp_path):
    write(tmp_path / "a.txt", b"some text\n")
    write(tmp_path / "b.txt", b"more text\n")
    assert_data_error("all its text fell into the validation split.*lower data.val_fraction", str(tmp_path), 0.9999)
    tiny_tail = write(tmp_path / "one.txt", b"a long first line of text\nx")
    assert_data_error(r"validation split .* has no text to predict.*data.val_fraction=0", str(tiny_tail), 0.01)


@pytest.mark.parametrize("val_fraction", [-0.1, 1.0, 1.5])
def test_val_fraction_must_be_in_0_1(tmp_path, val_fraction):
    path = write(tmp_path / "a.txt", b"text\n")
    assert_data_error(r"data.val_fraction must be in \[0, 1\)", str(path), val_fraction)


# ---------------------------------------------------------------------------------------------------
# The standard-library corpus
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus() -> data.Corpus:
    return data.load_corpus("stdlib", seq_len=64, val_fraction=0.05)


def test_stdlib_corpus_is_the_standard_library_without_tests_or_packages(stdlib_corpus):
    root, files, skipped_files = data.read_text_files("stdlib")
    paths = [file.relative_path for file in files]
    assert paths == sorted(paths)
    assert "argparse.py" in paths and "json/decoder.py" in paths
    assert not any(set(path.split("/")) & {"site-packages", "test", "tests", "idle_test"} for path in paths)
    assert len(files) > 300
    summary = stdlib_corpus.summary
    assert (summary.files, summary.skipped_files) == (len(files), skipped_files)
    assert summary.bytes == sum(len(file.data) for file in files)


def test_stdlib_rows_reproduce_its_top_level_blocks(stdlib_corpus):
    root, files, _ = data.read_text_files("stdlib")
    chosen = data.validation_paths([file.relative_path for file in files], 0.05)
    train_blocks, val_blocks = [], []
    for file in files:
        blocks = data.split_top_level_blocks(file.data)
        (val_blocks if file.relative_path in chosen else train_blocks).extend(blocks)
    assert 0 < len(chosen) < len(files)
    assert stdlib_corpus.summary.documents == len(train_blocks) + len(val_blocks)
    assert supervised_targets(stdlib_corpus.train) == b"".join(block[1:] for block in train_blocks)
    assert supervised_targets(stdlib_corpus.val) == b"".join(block[1:] for block in val_blocks)


def test_stdlib_rows_have_varying_supervised_tokens(stdlib_corpus):
    summary = stdlib_corpus.summary
    supervised = stdlib_corpus.train.supervised_tokens()
    assert summary.min_supervised_tokens < summary.median_supervised_tokens <= summary.max_supervised_tokens == 64
    assert summary.min_supervised_tokens == int(supervised.min())
    assert len(supervised.unique()) > 32
    assert summary.padding_fraction == pytest.approx(1 - supervised.sum().item() / (summary.train_rows * 64))
    assert 0 < summary.padding_fraction < 0.5
    assert (summary.train_rows, summary.val_rows) == (stdlib_corpus.train.num_rows, stdlib_corpus.val.num_rows)
    assert stdlib_corpus.train.tokens.dtype == torch.uint8  # one byte per token keeps memory small
    assert f"{summary.train_rows:,} training rows" in summary.describe()


def test_stdlib_padding_is_never_supervised(stdlib_corpus):
    rows = stdlib_corpus.train
    step_ids = torch.arange(0, rows.num_rows, 97)[:64]
    (batch,) = data.build_micro_batches(rows, step_ids, 64, 64, world_size=1, rank=0)
    targets_per_row = rows.lengths[step_ids].long() - 1
    positions = torch.arange(rows.seq_len)
    padding = positions >= targets_per_row[:, None]
    assert padding.any()
    assert (batch.labels[padding] == IGNORE_INDEX).all()
    assert (batch.labels[~padding] != IGNORE_INDEX).all()
    assert int((batch.labels != IGNORE_INDEX).sum()) == int(targets_per_row.sum())


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
    data.epoch_permutation.cache_clear()
    second = data.step_row_ids(1000, 32, seed=7, step=45, tail="drop")
    assert first.dtype == torch.int64
    assert torch.equal(first, second)
    first[:] = -1  # the caller owns what it gets back; the cached permutation is unchanged
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
    generator = torch.Generator().manual_seed(3 * 1_000_003 + 2)  # the documented seeding
    assert torch.equal(torch.cat(epochs[2]), torch.randperm(num_rows, generator=generator))


def test_drop_tail_uses_full_steps_and_leaves_the_rest_of_each_permutation():
    num_rows, global_batch_size = 103, 10
    assert data.steps_per_epoch(num_rows, global_batch_size, "drop") == 10
    assert data.rows_dropped_per_epoch(num_rows, global_batch_size, "drop") == 3
    for epoch in range(3):
        steps = epoch_ids(num_rows, global_batch_size, seed=3, epoch=epoch, tail="drop")
        assert [len(ids) for ids in steps] == [10] * 10
        permutation = data.epoch_permutation(num_rows, 3, epoch)
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


# ---------------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------------

LAYOUTS = [(8, 1, 1), (2, 4, 1), (4, 1, 2), (1, 4, 2)]  # (m, A, D), all with G = 8


@pytest.fixture(scope="module")
def small_rows() -> data.RowSet:
    documents = [f"document {index}: ".encode() + b"abcdefghijklmnopqrstuvwxyz"[: index % 26] for index in range(30)]
    return data.make_rows(documents, seq_len=12)


def all_ranks(rows, step_ids, micro_batch_size, accumulation, world_size) -> list[list]:
    batches = [
        data.build_micro_batches(rows, step_ids, 8, micro_batch_size, world_size, rank) for rank in range(world_size)
    ]
    for rank_batches in batches:
        assert len(rank_batches) == accumulation
        assert all(batch.inputs.shape == (micro_batch_size, rows.seq_len) for batch in rank_batches)
    return batches


@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_a_step_sees_the_same_examples_for_every_m_a_d(small_rows, tail):
    steps = data.steps_per_epoch(small_rows.num_rows, 8, tail)
    for step in range(2 * steps):  # two epochs, with a partial step in each when tail is "partial"
        step_ids = data.step_row_ids(small_rows.num_rows, 8, seed=11, step=step, tail=tail)
        (reference,) = data.build_micro_batches(small_rows, step_ids, 8, 8, 1, 0)
        expected = real_examples([reference])
        assert sum(expected.values()) == len(step_ids) == reference.num_examples
        for micro_batch_size, accumulation, world_size in LAYOUTS:
            batches = all_ranks(small_rows, step_ids, micro_batch_size, accumulation, world_size)
            flat = [batch for rank_batches in batches for batch in rank_batches]
            assert real_examples(flat) == expected
            assert sum(batch.num_examples for batch in flat) == len(step_ids)


def test_inputs_and_labels_are_the_row_shifted_by_one(small_rows):
    step_ids = torch.tensor([3, 0, 17, 5])
    (batch,) = data.build_micro_batches(small_rows, step_ids, 4, 4, 1, 0)
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
        data.build_micro_batches(small_rows, torch.arange(9), 8, 2, 2, 0)


@pytest.mark.parametrize("micro_batch_size, world_size", [(4, 1), (3, 2), (5, 3), (64, 2)])
def test_eval_micro_batches_cover_every_row_once_over_all_ranks(small_rows, micro_batch_size, world_size):
    per_rank = [
        list(data.eval_micro_batches(small_rows, micro_batch_size, world_size, rank)) for rank in range(world_size)
    ]
    expected_count = math.ceil(math.ceil(small_rows.num_rows / micro_batch_size) / world_size)
    assert [len(batches) for batches in per_rank] == [expected_count] * world_size
    flat = [batch for batches in per_rank for batch in batches]
    assert all(batch.inputs.shape == (micro_batch_size, small_rows.seq_len) for batch in flat)
    (everything,) = data.build_micro_batches(
        small_rows, torch.arange(small_rows.num_rows), small_rows.num_rows, small_rows.num_rows, 1, 0
    )
    assert real_examples(flat) == real_examples([everything])
    supervised = sum(int((batch.labels != IGNORE_INDEX).sum()) for batch in flat)
    assert supervised == int(small_rows.supervised_tokens().sum())


def test_a_missing_standard_library_or_a_special_file_is_an_error(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_data_error(rf"{fifo}.*neither a file nor a folder", str(fifo))
    monkeypatch.setattr(data, "stdlib_root", lambda: tmp_path / "no-stdlib")
    assert_data_error(rf"not installed at {tmp_path / 'no-stdlib'}; set data.source", "stdlib")


def test_data_order_and_eval_arguments_are_checked(small_rows):
    with pytest.raises(ValueError, match="step must be >= 0"):
        data.step_row_ids(10, 2, seed=0, step=-1, tail="drop")
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        data.step_row_ids(10, 0, seed=0, step=0, tail="partial")
    with pytest.raises(DataError, match="the training split has no rows"):
        data.step_row_ids(0, 2, seed=0, step=0, tail="partial")
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        next(data.eval_micro_batches(small_rows, 4, world_size=2, rank=2))
