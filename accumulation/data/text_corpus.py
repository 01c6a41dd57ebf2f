"""The embedded demo corpus (data.source = "stdlib", the default), and what every text source shares: text files
as documents, split by file, cut into rows (docs/data.md). A user's text file or folder is read by path_sources.py."""

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from accumulation.data.rows import BYTE_VOCAB_SIZE, DataError, make_rows
from accumulation.data.splits import Data, data_from_rows, validation_keys

# Folders of the standard library that are left out of the "stdlib" corpus: installed third-party
# packages, and test suites (large, repetitive, and full of deliberately odd code).
STDLIB_EXCLUDED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass
class TextFile:
    relative_path: str  # '/'-separated, relative to the source folder; the file name for a single file
    data: bytes


@dataclass
class TextSplit:
    """A text source read and split in two: what its rows and its summary are made from."""

    root: Path  # the folder (or the file) data.source resolved to
    files: list[TextFile]  # its text files, in sorted order
    skipped_files: int  # non-text files left out
    train_documents: list[bytes]
    val_documents: list[bytes]
    val_files: int  # files in the validation split (1 for a lone file split within itself)


def is_text(data: bytes) -> bool:
    """Text means valid UTF-8 without NUL bytes (NUL is the usual sign of a binary file)."""
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_bytes(path: Path, source: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataError(
            f"cannot read {path} ({error.strerror or error}); make it readable or remove it from data.source {source!r}"
        ) from None


def read_text_files(root: Path, paths: list[Path], source: str) -> tuple[list[TextFile], int]:
    """The text files among `paths` (files below `root`), in order, and how many non-text files were skipped."""
    files = []
    skipped_files = 0
    for path in paths:
        data = read_bytes(path, source)
        if is_text(data):
            files.append(TextFile(path.relative_to(root).as_posix(), data))
        else:
            skipped_files += 1
    return files, skipped_files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_file_paths(root: Path) -> list[Path]:
    """Every *.py file below the standard library, sorted by relative path, without the excluded folders."""
    paths = []
    for folder, subfolders, file_names in os.walk(root):
        # Pruning in place stops os.walk from descending into site-packages, which can be huge.
        subfolders[:] = [name for name in subfolders if name not in STDLIB_EXCLUDED_FOLDERS]
        paths.extend(Path(folder, name) for name in file_names if name.endswith(".py"))
    return sorted(paths, key=lambda path: path.relative_to(root).as_posix())


def read_stdlib() -> tuple[Path, list[TextFile], int]:
    """The standard library's root, its text files in sorted order, and how many non-text files were skipped."""
    root = stdlib_root()
    if not root.is_dir():
        raise DataError(
            f"the standard library's source is not installed at {root}; set data.source to a text file or folder"
        )
    return root, *read_text_files(root, stdlib_file_paths(root), "stdlib")


def split_top_level_blocks(text: bytes) -> list[bytes]:
    """Split Python source into its top-level blocks, which joined give back `text` exactly.

    Rule: a new block starts at a line whose first character is not whitespace (code, a decorator or a
    comment) when the line before it is blank (empty or only whitespace). A comment or decorator
    that heads a definition therefore stays with it, and the blank lines after a block belong to it.
    Leading blank lines never form a block of their own.
    """
    blocks = []
    block_lines: list[bytes] = []
    block_has_content = False
    previous_blank = False
    for line in text.splitlines(keepends=True):
        blank = not line.strip()
        starts_at_column_0 = not blank and not line[:1].isspace()
        if starts_at_column_0 and previous_blank and block_has_content:
            blocks.append(b"".join(block_lines))
            block_lines = []
            block_has_content = False
        block_lines.append(line)
        block_has_content = block_has_content or not blank
        previous_blank = blank
    if block_lines:
        blocks.append(b"".join(block_lines))
    return blocks


def split_by_file(root: Path, files: list[TextFile], skipped_files: int, val_fraction: float, is_python_source: bool):
    """The files split into training and validation documents by a hash of each file's path (validation_keys),
    so that a file keeps its side when others are added; val_fraction == 0 means no validation set."""
    # A file under 2 bytes holds no target, so it takes no part in the split: it never becomes the validation set.
    chosen = validation_keys([file.relative_path for file in files if len(file.data) >= 2], val_fraction)
    split = TextSplit(root, files, skipped_files, train_documents=[], val_documents=[], val_files=0)
    for file in files:
        # A Python file of the standard library gives one document per top-level block; any other file is one.
        documents = split_top_level_blocks(file.data) if is_python_source else [file.data]
        if file.relative_path in chosen:
            split.val_documents += documents
            split.val_files += 1
        else:
            split.train_documents += documents
    return split


def text_data(source: str, split: TextSplit, seq_len: int, val_fraction: float, packed_layout: bool, tokenizer) -> Data:
    """Cut both splits' documents into rows: one document per row (padded), or with packed_layout every split's
    documents joined into full rows. Tokens are bytes, or the ids of `tokenizer` when one is given."""
    train_documents, val_documents = split.train_documents, split.val_documents
    all_documents = train_documents + val_documents  # bytes, counted below
    vocab_size, separator = BYTE_VOCAB_SIZE, []
    if tokenizer is not None:
        from accumulation.data.tokenizer import end_of_text_token, tokenized

        vocab_size = tokenizer.get_vocab_size()
        separator = [] if end_of_text_token(tokenizer) is None else [end_of_text_token(tokenizer)]
        train_documents, val_documents = tokenized(train_documents, tokenizer), tokenized(val_documents, tokenizer)
    if packed_layout:
        from accumulation.data.packing import packed

        train_documents = packed(train_documents, seq_len, separator)
        val_documents = packed(val_documents, seq_len, separator)
    train = make_rows(train_documents, seq_len, vocab_size)
    val = make_rows(val_documents, seq_len, vocab_size)
    if train.num_rows + val.num_rows == 0:
        raise DataError(
            f"data.source {source!r} has no usable text (no text file with at least 2 bytes); "
            f'add UTF-8 text to {split.root} or set data.source="stdlib"'
        )
    return data_from_rows(
        source,
        train,
        val,
        val_fraction,
        root=str(split.root),
        files=len(split.files),
        val_files=split.val_files,
        skipped_files=split.skipped_files,
        bytes=sum(len(file.data) for file in split.files),
        documents=len(all_documents),
        dropped_documents=sum(1 for document in all_documents if len(document) < 2),
        truncated_documents=0,  # a long document is cut into several rows, never truncated
        layout="packed" if packed_layout else "documents",
        vocab_from="bytes" if tokenizer is None else "data.tokenizer",
    )


def load_stdlib(seq_len: int, val_fraction: float, packed_layout: bool = False, tokenizer=None) -> Data:
    """The standard library's Python files, split by file, each top-level block a document (the default data)."""
    root, files, skipped_files = read_stdlib()
    split = split_by_file(root, files, skipped_files, val_fraction, is_python_source=True)
    return text_data("stdlib", split, seq_len, val_fraction, packed_layout, tokenizer)
