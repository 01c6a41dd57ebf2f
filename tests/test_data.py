"""Tests for the data: rows and their interface, the text corpus, JSONL examples, the data order, micro-batches."""

import dataclasses
import importlib.util
import json
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from accumulation import data, text_corpus
from accumulation import rows as rows_module
from accumulation.batching import IGNORE_INDEX
from accumulation.config import Config, DataConfig, load_config
from accumulation.data import DataError

REPO = Path(__file__).resolve().parent.parent
SFT_DATA = REPO / "data" / "sft_arithmetic.jsonl"


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def rows_of(document: bytes, seq_len: int) -> int:
    """Rows a document needs: one per seq_len of its len - 1 targets, none without a target."""
    return math.ceil((len(document) - 1) / seq_len) if len(document) >= 2 else 0


def build(source, seq_len: int, val_fraction: float) -> data.Data:
    """The data of a source, validation reading its whole split (data.val_rows = 0)."""
    settings = DataConfig(source=str(source), seq_len=seq_len, val_fraction=float(val_fraction), val_rows=0)
    defaults = Config()
    return data.build_data(settings, model_vocab_size=defaults.model.vocab_size, seed=defaults.run.seed)


def supervised_targets(rows: data.RowSet) -> bytes:
    """Every supervised target of every row, in row order, as the rows' supervision mask selects them."""
    return rows.tokens[:, 1:][rows.supervised].numpy().tobytes()


def reference_example(raw: data.RawExample, seq_len: int) -> tuple[list[int], list[int]]:
    """(inputs, labels) of a row written straight from the definition of RawExample, sharing no code with
    the loop: input j is inputs[j] (0 past them), label j is targets[j] (IGNORE_INDEX where there is none)."""
    inputs = (raw.inputs + [0] * seq_len)[:seq_len]
    labels = [raw.targets.get(j, IGNORE_INDEX) for j in range(seq_len)]
    return inputs, labels


def window_of(raw: data.RawExample) -> list[int]:
    """The tokens a next-token RawExample was cut from: its inputs, then the last position's target if it
    has one (a full row's last token is a target only)."""
    last = len(raw.inputs) - 1
    return raw.inputs + ([raw.targets[last]] if last in raw.targets else [])


def assert_rows_match_their_raw_examples(rows: data.RowSet, row_ids: list[int], step: int = 0) -> None:
    batch = data.micro_batch(rows, torch.tensor(row_ids), len(row_ids) + 1, step)  # one padding row too
    for row, row_id in enumerate(row_ids):
        inputs, labels = reference_example(rows.raw_example(row_id, step), rows.seq_len)
        assert batch.inputs[row].tolist() == inputs
        assert batch.labels[row].tolist() == labels


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
    assert rows.supervised.tolist() == [[True] * 4, [True] * 4, [True, False, False, False]]
    assert rows.supervised_tokens().tolist() == [4, 4, 1]
    assert rows.vocab_size == 256
    assert [rows.raw_example(row) for row in range(3)] == [
        data.RawExample(inputs=list(b"abcd"), targets=dict(enumerate(b"bcde"))),
        data.RawExample(inputs=list(b"efgh"), targets=dict(enumerate(b"fghi"))),
        data.RawExample(inputs=list(b"ij"), targets={0: ord("j")}),
    ]


@pytest.mark.parametrize("seq_len", [1, 3, 8, 64])
def test_rows_round_trip_every_document_and_never_cross_into_the_next(seq_len):
    documents = [b"x", b"", b"hello world\n", b"ab", b"0123456789" * 7, b"z" * (2 * seq_len + 1)]
    rows = data.make_rows(documents, seq_len)

    assert rows.num_rows == sum(rows_of(document, seq_len) for document in documents)
    assert rows.tokens.shape == (rows.num_rows, seq_len + 1)
    assert ((rows.lengths >= 2) & (rows.lengths <= seq_len + 1)).all()
    # Concatenating the supervised targets of a document's rows gives back document[1:], for every document.
    assert supervised_targets(rows) == b"".join(document[1:] for document in documents)
    # Every target a row has is supervised; padding bytes are zero; each row starts where its text is.
    assert torch.equal(rows.supervised, torch.arange(seq_len) < rows.lengths[:, None].long() - 1)
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
    assert rows.supervised.shape == (0, 8)


def test_fingerprint_sees_tokens_lengths_seq_len_and_the_mask_but_not_the_storage_width():
    rows = data.make_rows([b"some text for a row\n"], seq_len=8)
    fingerprint = data.row_fingerprint(rows)
    assert fingerprint == data.row_fingerprint(data.make_rows([b"some text for a row\n"], seq_len=8))
    assert fingerprint != data.row_fingerprint(data.make_rows([b"some text for a row!"], seq_len=8))
    assert fingerprint != data.row_fingerprint(data.make_rows([b"some text for a row\n"], seq_len=7))
    assert len(fingerprint) == 16
    shorter = rows.lengths.clone()
    shorter[-1] -= 1
    assert fingerprint != data.row_fingerprint(dataclasses.replace(rows, lengths=shorter))
    # The same tokens and lengths with one target taken out of supervision, as a prompt mask would.
    masked = rows.supervised.clone()
    masked[0, 0] = False
    assert fingerprint != data.row_fingerprint(dataclasses.replace(rows, supervised=masked))
    # Token values are hashed, not their storage: the same rows in uint16 have the same fingerprint.
    wide = dataclasses.replace(rows, tokens=rows.tokens.to(torch.uint16), vocab_size=300)
    assert fingerprint == data.row_fingerprint(wide)


@pytest.mark.parametrize(
    "vocab_size, dtype",
    [(1, torch.uint8), (256, torch.uint8), (257, torch.uint16), (2**16, torch.uint16), (2**16 + 1, torch.uint32)],
)
def test_token_storage_is_the_narrowest_type_that_fits_the_vocabulary(vocab_size, dtype):
    assert data.token_dtype(vocab_size) == dtype
    assert data.token_dtype(2**32) == torch.uint32
    for impossible in (0, 2**32 + 1):
        with pytest.raises(ValueError, match="vocab_size must be in 1..2\\*\\*32"):
            data.token_dtype(impossible)


def test_rows_of_a_larger_vocabulary_give_their_token_ids_back():
    rows = data.make_rows([b"abcdefg"], seq_len=4)
    wide_tokens = rows.tokens.long() * 1000  # ids up to 103,000: uint32 storage
    wide = dataclasses.replace(rows, tokens=wide_tokens.to(torch.uint32), vocab_size=200_000)
    inputs, labels = wide.examples(torch.tensor([1, 0]))
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [wide_tokens[1, :-1].tolist(), wide_tokens[0, :-1].tolist()]
    assert labels[0].tolist() == [102_000, 103_000, IGNORE_INDEX, IGNORE_INDEX]  # row 1 is "efg": 2 targets
    assert labels[1].tolist() == [98_000, 99_000, 100_000, 101_000]  # row 0 is "abcde"
    with pytest.raises(ValueError, match="tokens of a vocabulary of 256 are torch.uint8"):
        dataclasses.replace(rows, tokens=rows.tokens.to(torch.uint16))


# ---------------------------------------------------------------------------------------------------
# The text corpus: top-level blocks
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
    blocks = text_corpus.split_top_level_blocks(source)
    assert b"".join(blocks) == source
    assert blocks == [
        b'\n"""Module docstring."""\nimport os\n\n\n',
        b"# A comment that heads the decorated function.\n@decorator\ndef f():\n    x = 1\n    \n    return x\n\n",
        b"class C:\n    pass\nCONSTANT = 2\n",
    ]


# ---------------------------------------------------------------------------------------------------
# The text corpus: reading sources and the validation split
# ---------------------------------------------------------------------------------------------------


def test_folder_reads_text_files_recursively_in_sorted_order_and_skips_binaries(tmp_path):
    write(tmp_path / "b.txt", b"second file\n")
    write(tmp_path / "a" / "z.txt", b"first file, in a subfolder\n")
    write(tmp_path / "c.bin", b"binary\0data")
    write(tmp_path / "d.txt", b"latin-1 \xe9 is not UTF-8\n")
    write(tmp_path / "e.txt", "UTF-8 is fine: é\n".encode())

    root, files, skipped_files = text_corpus.read_text_files(str(tmp_path))
    assert root == tmp_path
    assert [file.relative_path for file in files] == ["a/z.txt", "b.txt", "e.txt"]
    assert skipped_files == 2

    corpus = build(str(tmp_path), seq_len=4, val_fraction=0)
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
    corpus = build(str(tmp_path), seq_len=8, val_fraction=0)
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
    assert (summary.prompt_fraction, summary.truncated_documents) == (0, 0)
    assert summary.vocab_size == corpus.vocab_size == 256
    assert summary.fingerprint == data.row_fingerprint(corpus.train)
    assert "5 documents (2 without a target dropped)" in summary.describe()


def test_validation_split_is_by_file_deterministic_and_disjoint(tmp_path):
    names = [f"dir{index % 3}/file{index:02d}.txt" for index in range(40)]
    for name in names:
        write(tmp_path / name, f"the contents of {name}\n".encode())

    chosen = data.validation_keys(names, val_fraction=0.25)
    assert chosen == data.validation_keys(list(reversed(names)), val_fraction=0.25)  # not by position
    assert chosen == {name for name in names if data.key_hash(name) < 0.25}
    assert 0 < len(chosen) < len(names)

    corpus = build(str(tmp_path), seq_len=16, val_fraction=0.25)
    again = build(str(tmp_path), seq_len=16, val_fraction=0.25)
    assert corpus.summary == again.summary
    assert torch.equal(corpus.val.tokens, again.val.tokens)
    assert corpus.summary.val_files == len(chosen)
    train_text = b"".join((tmp_path / name).read_bytes()[1:] for name in sorted(names) if name not in chosen)
    val_text = b"".join((tmp_path / name).read_bytes()[1:] for name in sorted(names) if name in chosen)
    assert supervised_targets(corpus.train) == train_text
    assert supervised_targets(corpus.val) == val_text


def test_an_empty_validation_split_takes_the_file_with_the_smallest_hash():
    names = ["a.txt", "b.txt", "c.txt"]
    tiny_fraction = min(data.key_hash(name) for name in names) / 2
    assert data.validation_keys(names, tiny_fraction) == {min(names, key=data.key_hash)}
    assert data.validation_keys(names, 0) == set()
    assert data.validation_keys(["only.txt"], tiny_fraction) == set()


def test_a_single_file_is_split_at_the_newline_nearest_the_cut(tmp_path):
    text = b"".join(f"line {index:03d}\n".encode() for index in range(100))  # 100 lines of 9 bytes
    path = write(tmp_path / "one.txt", text)
    corpus = build(str(path), seq_len=32, val_fraction=0.1)
    # (1 - 0.1) * 900 = 810 is the end of line 90: the last 10 lines are validation.
    assert supervised_targets(corpus.train) == text[:810][1:]
    assert supervised_targets(corpus.val) == text[810:][1:]
    assert corpus.summary.files == 1

    assert text_corpus.split_at_newline(b"aaaa\nbbbbbbbbbbbbb\ncc", 0.5) == (b"aaaa\n", b"bbbbbbbbbbbbb\ncc")
    assert text_corpus.split_at_newline(b"no newline at all", 0.5) == (b"no newli", b"ne at all")
    # The final newline would leave an empty tail, so the cut falls at byte round(0.75 * 27) = 20.
    assert text_corpus.split_at_newline(b"ends with its only newline\n", 0.25) == (b"ends with its only n", b"ewline\n")

    no_validation = build(str(path), seq_len=32, val_fraction=0)
    assert no_validation.val is None
    assert supervised_targets(no_validation.train) == text[1:]


# ---------------------------------------------------------------------------------------------------
# Errors: one line that names the path and the fix
# ---------------------------------------------------------------------------------------------------


def assert_data_error(match: str, source: str, val_fraction: float = 0.0) -> None:
    with pytest.raises(DataError, match=match) as raised:
        build(source, seq_len=8, val_fraction=val_fraction)
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
    assert_data_error("all of it fell into the validation split.*lower data.val_fraction", str(tmp_path), 0.9999)
    tiny_tail = write(tmp_path / "one.txt", b"a long first line of text\nx")
    assert_data_error(r"validation split .* has no text to predict.*data.val_fraction=0", str(tiny_tail), 0.01)


# ---------------------------------------------------------------------------------------------------
# The standard-library corpus
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus() -> data.Data:
    return build("stdlib", seq_len=64, val_fraction=0.05)


def test_stdlib_corpus_is_the_standard_library_without_tests_or_packages(stdlib_corpus):
    root, files, skipped_files = text_corpus.read_text_files("stdlib")
    paths = [file.relative_path for file in files]
    assert paths == sorted(paths)
    assert "argparse.py" in paths and "json/decoder.py" in paths
    assert not any(set(path.split("/")) & {"site-packages", "test", "tests", "idle_test"} for path in paths)
    assert len(files) > 300
    summary = stdlib_corpus.summary
    assert (summary.files, summary.skipped_files) == (len(files), skipped_files)
    assert summary.bytes == sum(len(file.data) for file in files)


def test_stdlib_rows_reproduce_its_top_level_blocks(stdlib_corpus):
    root, files, _ = text_corpus.read_text_files("stdlib")
    chosen = data.validation_keys([file.relative_path for file in files], 0.05)
    train_blocks, val_blocks = [], []
    for file in files:
        blocks = text_corpus.split_top_level_blocks(file.data)
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
    (batch,) = data.build_micro_batches(rows, step_ids, 64, 64, world_size=1, rank=0, step=0)
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
    assert torch.equal(torch.cat(epochs[2]), data.epoch_permutation(num_rows, 3, 2))


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


@pytest.fixture(scope="module")
def example_rows() -> data.RowSet:
    """Prompt/response rows: prompts of 11 to 17 bytes, responses of 1 to 13, some truncated, some dropped."""
    examples = [
        (f"prompt {index}: ".encode() + b"?" * (index % 7), b"abcdefghijklmnopqrstuvwxyz"[: 1 + index % 13])
        for index in range(30)
    ]
    built = data.make_example_rows(examples, seq_len=12)
    assert built.truncated > 0 and built.dropped > 0
    return built.rows


@pytest.fixture(params=["documents", "prompt/response examples"])
def any_rows(request, small_rows, example_rows) -> data.RowSet:
    return small_rows if request.param == "documents" else example_rows


def all_ranks(rows, step_ids, micro_batch_size, accumulation, world_size) -> list[list]:
    batches = [
        data.build_micro_batches(rows, step_ids, 8, micro_batch_size, world_size, rank, step=0)
        for rank in range(world_size)
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
        (reference,) = data.build_micro_batches(any_rows, step_ids, 8, 8, 1, 0, step=0)
        expected = real_examples([reference])
        assert sum(expected.values()) == len(step_ids) == reference.num_examples
        for micro_batch_size, accumulation, world_size in LAYOUTS:
            batches = all_ranks(any_rows, step_ids, micro_batch_size, accumulation, world_size)
            flat = [batch for rank_batches in batches for batch in rank_batches]
            assert real_examples(flat) == expected
            assert sum(batch.num_examples for batch in flat) == len(step_ids)


def test_inputs_and_labels_are_the_row_shifted_by_one(small_rows):
    step_ids = torch.tensor([3, 0, 17, 5])
    (batch,) = data.build_micro_batches(small_rows, step_ids, 4, 4, 1, 0, step=0)
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
        data.build_micro_batches(small_rows, torch.arange(9), 8, 2, 2, 0, step=0)


@pytest.mark.parametrize("micro_batch_size, world_size", [(4, 1), (3, 2), (5, 3), (64, 2)])
def test_eval_micro_batches_cover_every_row_once_over_all_ranks(any_rows, micro_batch_size, world_size):
    per_rank = [
        list(data.eval_micro_batches(any_rows, micro_batch_size, world_size, rank)) for rank in range(world_size)
    ]
    expected_count = math.ceil(math.ceil(any_rows.num_rows / micro_batch_size) / world_size)
    assert [len(batches) for batches in per_rank] == [expected_count] * world_size
    flat = [batch for batches in per_rank for batch in batches]
    assert all(batch.inputs.shape == (micro_batch_size, any_rows.seq_len) for batch in flat)
    (everything,) = data.build_micro_batches(
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


def test_a_missing_standard_library_or_a_special_file_is_an_error(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_data_error(rf"{fifo}.*neither a file nor a folder", str(fifo))
    monkeypatch.setattr(text_corpus, "stdlib_root", lambda: tmp_path / "no-stdlib")
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
        return tokens[:, :-1], data.labels_from_mask(tokens[:, 1:], supervised.expand(len(row_ids), -1))

    def raw_example(self, row_id: int, step: int) -> data.RawExample:
        inputs = list(range(row_id, row_id + 4))
        return data.RawExample(inputs=inputs, targets={1: row_id + 2, 2: row_id + 3, 3: row_id + 4})


def test_the_interface_is_all_that_micro_batches_need():
    rows = CountingRows()
    (batch,) = data.build_micro_batches(rows, torch.tensor([4, 1]), 4, 4, world_size=1, rank=0, step=0)
    assert batch.num_examples == 2
    assert batch.inputs.tolist() == [[4, 5, 6, 7], [1, 2, 3, 4], [0] * 4, [0] * 4]
    assert batch.labels.tolist() == [[-100, 6, 7, 8], [-100, 3, 4, 5], [-100] * 4, [-100] * 4]
    assert_rows_match_their_raw_examples(rows, [0, 3])
    assert len(list(data.eval_micro_batches(rows, 2, world_size=2, rank=1))) == 2


# ---------------------------------------------------------------------------------------------------
# JSONL examples
# ---------------------------------------------------------------------------------------------------


def jsonl(path: Path, *objects) -> Path:
    """A JSONL file with one line per object; a string is written as the line itself."""
    lines = [item if isinstance(item, str) else json.dumps(item) for item in objects]
    return write(path, ("\n".join(lines) + "\n").encode())


@dataclasses.dataclass
class Encoding:
    ids: list[int]


class WordTokenizer:
    """A stand-in for a Hugging Face Tokenizer, with the three methods the data layer calls: one id per
    space-separated word, and an end-of-text token. Lets the end token's place be tested without the
    optional tokenizers package (with it installed, tests/test_prepare_data.py checks a real BPE too)."""

    END = "<|endoftext|>"

    def __init__(self, words: list[str]):
        self.ids = {word: number for number, word in enumerate([self.END, *words])}

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list["Encoding"]:
        return [Encoding([self.ids[word] for word in text.split()]) for text in texts]

    def token_to_id(self, token: str):
        return self.ids.get(token)

    def get_vocab_size(self) -> int:
        return len(self.ids)


def test_the_end_token_ends_the_response_and_is_supervised(tmp_path):
    """A model must learn to stop: the end-of-text token follows the response, as a supervised target, in every
    row; it never follows the prompt (where no row would ever supervise it)."""
    from accumulation.jsonl import load_jsonl

    tokenizer = WordTokenizer(["what", "is", "two", "plus", "four", "three", "one"])
    lines = [{"prompt": "what is two plus two", "response": "four"}, {"prompt": "what is one", "response": "one"}]
    built = load_jsonl(str(jsonl(tmp_path / "sft.jsonl", *lines)), seq_len=16, val_fraction=0.0, tokenizer=tokenizer)
    end = tokenizer.token_to_id(WordTokenizer.END)
    _, labels = built.train.examples(torch.arange(built.train.num_rows))
    for row in range(built.train.num_rows):
        example = built.train.raw_example(row)
        targets = [example.targets[position] for position in sorted(example.targets)]
        prompt = example.inputs[: min(example.targets) + 1]  # the tokens before the first supervised target
        assert prompt and end not in prompt and targets[-1] == end
        supervised = labels[row][labels[row] != IGNORE_INDEX].tolist()
        assert supervised == targets  # the response and its end token, nothing of the prompt


def test_jsonl_rows_supervise_exactly_the_response(tmp_path):
    examples = [
        {"prompt": "Q: 2 + 2 =", "response": " 4\n"},
        {"text": "a whole document\n"},
        {"prompt": "", "response": "no prompt at all\n"},
        {"prompt": "Q: héllo =", "response": " wörld\n"},  # multi-byte UTF-8 in both
        {"prompt": "Q: long =", "response": " a response longer than the row\n"},  # truncated
    ]
    path = jsonl(tmp_path / "sft.jsonl", examples[0], "", examples[1], "   ", *examples[2:])  # blank lines skipped
    built = build(path, seq_len=20, val_fraction=0)
    rows = built.train
    assert built.val is None
    assert rows.num_rows == len(examples)
    for row, example in enumerate(examples):
        prompt = list(example.get("prompt", "").encode())
        response = list(example.get("response", example.get("text", "")).encode())
        assert rows.raw_example(row) == data.next_token_example(prompt, response, seq_len=20)
    assert_rows_match_their_raw_examples(rows, list(range(rows.num_rows)))

    # Written out for the first example: "Q: 2 + 2 =" is 10 bytes, so targets 1..9 are prompt.
    (batch,) = data.build_micro_batches(rows, torch.tensor([0]), 1, 1, world_size=1, rank=0, step=0)
    assert batch.inputs[0].tolist() == list(b"Q: 2 + 2 = 4\n") + [0] * 7
    assert batch.labels[0].tolist() == [IGNORE_INDEX] * 9 + list(b" 4\n") + [IGNORE_INDEX] * 8
    # A {"text"} line is supervised from its second byte on, like a document.
    assert supervised_targets(rows)[3 : 3 + 16] == b" whole document\n"
    assert rows.supervised_tokens().tolist() == [3, 16, 16, 8, 12]
    assert built.summary.truncated_documents == 1


def test_jsonl_truncates_long_examples_and_drops_those_left_without_a_target(tmp_path):
    path = jsonl(
        tmp_path / "sft.jsonl",
        {"prompt": "Q:", "response": " fits\n"},  # 8 bytes: fits in a row of 9
        {"prompt": "p", "response": "r" * 40},  # truncated to 9 bytes: 8 supervised targets remain
        {"prompt": "a prompt that fills the whole row", "response": " lost\n"},  # dropped: response cut off
        {"prompt": "no response", "response": ""},  # dropped: nothing supervised
        {"text": "x"},  # dropped: one token, no target
    )
    built = build(path, seq_len=8, val_fraction=0)
    summary = built.summary
    assert (summary.documents, summary.dropped_documents, summary.truncated_documents) == (5, 3, 1)
    assert summary.train_rows == built.train.num_rows == 2
    assert built.train.tokens[1].numpy().tobytes() == b"p" + b"r" * 8
    assert built.train.supervised_tokens().tolist() == [6, 8]
    assert "5 documents (3 without a target dropped, 1 truncated to seq_len)" in summary.describe()
    assert summary.prompt_fraction == pytest.approx(1 / (2 * 8))  # the target ":" (a prompt of 1 has none)
    assert summary.vocab_size == built.vocab_size == 256


def example_texts(rows: data.RowSet) -> list[bytes]:
    """The tokens of every row's RawExample, in row order."""
    return [bytes(window_of(rows.raw_example(row))) for row in range(rows.num_rows)]


def test_jsonl_validation_split_is_by_line_hash_and_stable_when_lines_are_added(tmp_path):
    examples = [{"prompt": f"Q{index} =", "response": f" answer {index}\n"} for index in range(60)]
    lines = [json.dumps(example) for example in examples]
    built = build(jsonl(tmp_path / "a.jsonl", *lines), seq_len=32, val_fraction=0.2)
    texts = [(example["prompt"] + example["response"]).encode() for example in examples]
    val_texts = [text for text, line in zip(texts, lines, strict=True) if data.key_hash(line) < 0.2]
    assert 0 < len(val_texts) < len(lines)
    assert example_texts(built.val) == val_texts
    assert example_texts(built.train) == [text for text in texts if text not in val_texts]

    # Forty lines more: every old line stays on its side of the split.
    more = lines + [json.dumps({"text": f"a new line {index}"}) for index in range(40)]
    grown = build(jsonl(tmp_path / "b.jsonl", *more), seq_len=32, val_fraction=0.2)
    assert [text for text in example_texts(grown.val) if text in texts] == val_texts

    # Two lines, a fraction too small for either: the line with the smallest hash is the validation set.
    pair = lines[:2]
    tiny_fraction = min(data.key_hash(line) for line in pair) / 2
    small = build(jsonl(tmp_path / "c.jsonl", *pair), seq_len=32, val_fraction=tiny_fraction)
    assert (small.train.num_rows, small.val.num_rows) == (1, 1)


BAD_LINES = {
    "bad JSON": ('{"prompt": "Q", "response": }', r"line 3: not valid JSON \(Expecting value at column 29\)"),
    "not an object": ('["Q", "A"]', r"line 3: an array, not an object"),
    "a bare string": ('"just text"', r"line 3: a string, not an object"),
    "missing response": ('{"prompt": "Q"}', r'line 3: has the keys \["prompt"\]'),
    "misspelt key": ('{"promt": "Q", "response": "A"}', r'line 3: has the keys \["promt", "response"\]'),
    "both kinds": ('{"text": "T", "prompt": "Q", "response": "A"}', r'line 3: has both "text" and "prompt"'),
    "number prompt": ('{"prompt": 12, "response": "A"}', r"line 3: 'prompt' is a number, not a string"),
    "null response": ('{"prompt": "Q", "response": null}', r"line 3: 'response' is null, not a string"),
    "list text": ('{"text": ["T"]}', r"line 3: 'text' is an array, not a string"),
    "lone surrogate": ('{"text": "\\ud800"}', r"line 3: 'text' holds a lone surrogate escape"),
}


@pytest.mark.parametrize("bad_line, message", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_malformed_jsonl_line_is_an_error_naming_the_file_and_line(tmp_path, bad_line, message):
    path = jsonl(tmp_path / "sft.jsonl", {"prompt": "Q", "response": "A"}, "", bad_line, {"text": "fine"})
    with pytest.raises(DataError, match=rf"data.source '{path}', {message}") as raised:
        build(path, seq_len=8, val_fraction=0)
    assert "\n" not in str(raised.value)


def test_jsonl_files_that_cannot_be_used_are_errors(tmp_path):
    not_utf8 = write(tmp_path / "latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"'{not_utf8}', line 2: not valid UTF-8"):
        build(not_utf8, seq_len=8, val_fraction=0)
    with pytest.raises(DataError, match=r"nowhere.jsonl' does not exist or is not a file"):
        build(tmp_path / "nowhere.jsonl", seq_len=8, val_fraction=0)
    for name, content in [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("short.jsonl", b'{"text": "x"}\n')]:
        with pytest.raises(DataError, match=r"has no example with a supervised target"):
            build(write(tmp_path / name, content), seq_len=8, val_fraction=0)
    lone = jsonl(tmp_path / "lone.jsonl", {"prompt": "Q", "response": "A long enough answer"})
    with pytest.raises(DataError, match=r"validation split .* has no text to predict"):
        build(lone, seq_len=8, val_fraction=0.01)


# ---------------------------------------------------------------------------------------------------
# The worked SFT example: configs/sft.toml on data/sft_arithmetic.jsonl
# ---------------------------------------------------------------------------------------------------


def test_the_sft_data_file_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("make_sft_data", REPO / "scripts" / "operations" / "make_sft_data.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.OUTPUT == SFT_DATA
    assert SFT_DATA.read_text(encoding="utf-8") == generator.contents()
    assert SFT_DATA.stat().st_size < 200_000


def test_configs_sft_toml_builds_its_data_without_truncation(monkeypatch):
    monkeypatch.chdir(REPO)  # data.source is relative to where train.py is started
    config = load_config(["--config", "configs/sft.toml"])
    assert config.data.source == "data/sft_arithmetic.jsonl"
    built = data.build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    summary = built.summary
    assert built.vocab_size == 256
    assert (summary.documents, summary.dropped_documents, summary.truncated_documents) == (2800, 0, 0)
    assert summary.train_rows + summary.val_rows == 2800 and summary.val_rows > 0
    assert data.steps_per_epoch(built.train.num_rows, config.batch.global_batch_size, config.batch.tail) > 50
    # Supervised tokens per row differ a lot, which is when token weighting matters.
    supervised = built.train.supervised_tokens()
    assert (int(supervised.min()), int(supervised.max())) == (3, 85)
    assert summary.prompt_fraction > 0.1
    rows = list(range(0, built.train.num_rows, 97))
    assert_rows_match_their_raw_examples(built.train, rows)
    assert all(bytes(window_of(built.train.raw_example(row))).endswith(b"\n") for row in rows)
