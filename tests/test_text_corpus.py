"""The text corpus: top-level blocks, reading a folder or file, the validation split, the one-line errors,
and the standard-library corpus."""

import os
from pathlib import Path

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.config.config import DataConfig
from accumulation.data import path_sources, text_corpus
from accumulation.data import sources as data
from accumulation.data.rows import DataError
from accumulation.data.splits import Data, key_hash, row_fingerprint, validation_keys
from accumulation.data.step_tools import build_micro_batches
from tests.test_rows import build, supervised_targets, write

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

    root, files, skipped_files = path_sources.read_text_path(str(tmp_path))
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
    assert summary.fingerprint == row_fingerprint(corpus.train)
    assert "5 documents (2 without a target dropped)" in summary.describe()


def test_validation_split_is_by_file_deterministic_and_disjoint(tmp_path):
    names = [f"dir{index % 3}/file{index:02d}.txt" for index in range(40)]
    for name in names:
        write(tmp_path / name, f"the contents of {name}\n".encode())

    chosen = validation_keys(names, val_fraction=0.25)
    assert chosen == validation_keys(list(reversed(names)), val_fraction=0.25)  # not by position
    assert chosen == {name for name in names if key_hash(name) < 0.25}
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
    tiny_fraction = min(key_hash(name) for name in names) / 2
    assert validation_keys(names, tiny_fraction) == {min(names, key=key_hash)}
    assert validation_keys(names, 0) == set()
    assert validation_keys(["only.txt"], tiny_fraction) == set()


def test_a_single_file_is_split_at_the_newline_nearest_the_cut(tmp_path):
    text = b"".join(f"line {index:03d}\n".encode() for index in range(100))  # 100 lines of 9 bytes
    path = write(tmp_path / "one.txt", text)
    corpus = build(str(path), seq_len=32, val_fraction=0.1)
    # (1 - 0.1) * 900 = 810 is the end of line 90: the last 10 lines are validation.
    assert supervised_targets(corpus.train) == text[:810][1:]
    assert supervised_targets(corpus.val) == text[810:][1:]
    assert corpus.summary.files == 1

    assert path_sources.split_at_newline(b"aaaa\nbbbbbbbbbbbbb\ncc", 0.5) == (b"aaaa\n", b"bbbbbbbbbbbbb\ncc")
    assert path_sources.split_at_newline(b"no newline at all", 0.5) == (b"no newli", b"ne at all")
    # The final newline would leave an empty tail, so the cut falls at byte round(0.75 * 27) = 20.
    assert path_sources.split_at_newline(b"ends with its only newline\n", 0.25) == (
        b"ends with its only n",
        b"ewline\n",
    )

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


def test_files_without_a_target_take_no_part_in_the_split(tmp_path):
    # One real file beside an empty one and a 1-byte one: the real file is split at a newline as if it were
    # alone, instead of an empty file becoming the whole validation set.
    text = b"".join(f"line {index:03d}\n".encode() for index in range(100))  # 100 lines of 9 bytes
    write(tmp_path / "real.txt", text)
    write(tmp_path / "empty.txt", b"")
    write(tmp_path / "one_byte.txt", b"x")
    corpus = build(str(tmp_path), seq_len=32, val_fraction=0.1)
    assert supervised_targets(corpus.train) == text[:810][1:]  # (1 - 0.1) * 900 = 810, as for the lone file
    assert supervised_targets(corpus.val) == text[810:][1:]
    assert corpus.summary.files == 3


def test_a_split_that_leaves_training_or_validation_without_rows_is_an_error(tmp_path):
    write(tmp_path / "a.txt", b"some text\n")
    write(tmp_path / "b.txt", b"more text\n")
    assert_data_error("all of it fell into the validation split.*lower data.val_fraction", str(tmp_path), 0.9999)
    tiny_tail = write(tmp_path / "one.txt", b"a long first line of text\nx")
    assert_data_error(r"validation split .* has no text to predict.*data.val_fraction=0", str(tiny_tail), 0.01)


def test_the_standard_library_asked_for_a_mask_is_an_error_and_a_folder_named_stdlib_is_not_read(tmp_path, monkeypatch):
    # The default path (build_data's "stdlib" in bytes) is left for path_sources, which refuses masks on text;
    # "stdlib" names the embedded corpus there too, never a folder of token files of that name.
    (tmp_path / "stdlib").mkdir()
    (tmp_path / "stdlib" / "train.bin").write_bytes(b"\0" * 64)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r'data.task="masked": .stdlib. is not a folder of token files'):
        data.build_data(DataConfig(task="masked"), model_vocab_size=0, seed=0)


def test_a_missing_standard_library_or_a_special_file_is_an_error(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_data_error(rf"{fifo}.*neither a file nor a folder", str(fifo))
    monkeypatch.setattr(text_corpus, "stdlib_root", lambda: tmp_path / "no-stdlib")
    assert_data_error(rf"not installed at {tmp_path / 'no-stdlib'}; set data.source", "stdlib")


# ---------------------------------------------------------------------------------------------------
# The standard-library corpus
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus() -> Data:
    return build("stdlib", seq_len=64, val_fraction=0.05)


def test_stdlib_corpus_is_the_standard_library_without_tests_or_packages(stdlib_corpus):
    root, files, skipped_files = text_corpus.read_stdlib()
    paths = [file.relative_path for file in files]
    assert paths == sorted(paths)
    assert "argparse.py" in paths and "json/decoder.py" in paths
    assert not any(set(path.split("/")) & {"site-packages", "test", "tests", "idle_test"} for path in paths)
    assert len(files) > 300
    summary = stdlib_corpus.summary
    assert (summary.files, summary.skipped_files) == (len(files), skipped_files)
    assert summary.bytes == sum(len(file.data) for file in files)


def test_stdlib_rows_reproduce_its_top_level_blocks(stdlib_corpus):
    root, files, _ = text_corpus.read_stdlib()
    chosen = validation_keys([file.relative_path for file in files], 0.05)
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
    (batch,) = build_micro_batches(rows, step_ids, 64, 64, world_size=1, rank=0, step=0)
    targets_per_row = rows.lengths[step_ids].long() - 1
    positions = torch.arange(rows.seq_len)
    padding = positions >= targets_per_row[:, None]
    assert padding.any()
    assert (batch.labels[padding] == IGNORE_INDEX).all()
    assert (batch.labels[~padding] != IGNORE_INDEX).all()
    assert int((batch.labels != IGNORE_INDEX).sum()) == int(targets_per_row.sum())
