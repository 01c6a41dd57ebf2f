"""The embedded demo corpus: text files (or the standard library) as documents.

By default a token is one byte (vocabulary 256), so text is never decoded for training; it is only checked
to be UTF-8 so that binary files do not slip in. With data.tokenizer each document is encoded by that
tokenizer instead. Every target of every document is supervised.

    data.source  ->  text files  ->  train/validation split by file  ->  documents  ->  rows (data.make_rows)
        data.layout "documents": each document cut into rows of its own, the last one padded
        data.layout "packed":    the documents of a split joined into one, cut into full rows (packed)

A fork that trains on other data replaces this module; accumulation/data/sources.py stays.
"""

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accumulation.data.locate import find_token_files
from accumulation.data.memory import memory_limit_bytes
from accumulation.data.rows import BYTE_VOCAB_SIZE, DataError, make_rows
from accumulation.data.splits import Data, data_from_rows, validation_keys

# Memory the text path takes per byte of text, its peak while the rows are built (the bytes, their copies
# as documents and packed, and the row tables), rounded up from the figure docs/data.md gives. Text is read
# whole; token files are not.
TEXT_MEMORY_BYTES_PER_BYTE = 16

# Folders of the standard library that are left out of the "stdlib" corpus: installed third-party
# packages, and test suites (large, repetitive, and full of deliberately odd code).
STDLIB_EXCLUDED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass
class TextFile:
    relative_path: str  # '/'-separated, relative to the source folder; the file name for a single file
    data: bytes


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


def not_text_advice(path: Path) -> str:
    """Why a single file is no text, and where to point data.source instead: its folder when the file is one
    of the token files a folder of them is read as (train.bin, an llm.c shard)."""
    if find_token_files(str(path.parent)) is not None:
        return (
            f" but a token file (it holds binary token ids); token files are read as their folder: "
            f"set data.source={str(path.parent)!r}"
        )
    return " (it contains a NUL byte or is not valid UTF-8); point data.source at a UTF-8 text file or a folder of them"


def check_text_fits_in_memory(source: str, paths: list[Path]) -> None:
    """Refuse text that cannot fit: it is read whole, and reading it would end in a MemoryError traceback or
    the kernel's OOM killer. Token files are memory-mapped and never read whole."""
    text_bytes = sum(path.stat().st_size for path in paths)
    limit_bytes, limit = memory_limit_bytes()
    needed_bytes = TEXT_MEMORY_BYTES_PER_BYTE * text_bytes
    if needed_bytes > limit_bytes:
        raise DataError(
            f"data.source {source!r}: {text_bytes / 2**30:,.2f} GiB of text, read whole, needs about "
            f"{needed_bytes / 2**30:,.1f} GiB ({TEXT_MEMORY_BYTES_PER_BYTE} bytes per byte), more than the "
            f"{limit_bytes / 2**30:,.1f} GiB of {limit}; write it as token files once, which are memory-mapped "
            f"and never read whole: python scripts/operations/prepare_data.py INPUT OUT_DIR (it reads a folder or "
            f"a .jsonl file one document at a time; split one large file into several), then data.source=OUT_DIR"
        )


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


def folder_file_paths(root: Path) -> list[Path]:
    """Every regular file below `root`, recursively, sorted by relative path."""
    paths = [path for path in root.rglob("*") if path.is_file()]
    return sorted(paths, key=lambda path: path.relative_to(root).as_posix())


def read_text_files(source: str) -> tuple[Path, list[TextFile], int]:
    """The source's root, its text files in sorted order, and how many non-text files were skipped.

    "stdlib" is this interpreter's standard library; any other string is a path to a text file or to a
    folder. In a folder (and in the standard library) non-text files are skipped and counted; a single
    file that is not text is an error.
    """
    if source == "stdlib":
        root = stdlib_root()
        if not root.is_dir():
            raise DataError(
                f"the standard library's source is not installed at {root}; set data.source to a text file or folder"
            )
        paths = stdlib_file_paths(root)
    else:
        root = Path(source)
        if not root.exists():
            raise DataError(
                f"data.source {source!r} does not exist; set it to a text file or folder, a .jsonl file, a folder of "
                f'token files (scripts/operations/prepare_data.py writes them), or "stdlib"'
            )
        if root.is_file():
            check_text_fits_in_memory(source, [root])
            data = read_bytes(root, source)
            if not is_text(data):
                raise DataError(f"data.source {source!r} is not a text file{not_text_advice(root)}")
            return root, [TextFile(root.name, data)], 0
        if not root.is_dir():
            raise DataError(f"data.source {source!r} is neither a file nor a folder; point it at a text file or folder")
        paths = folder_file_paths(root)
        check_text_fits_in_memory(source, paths)

    files = []
    skipped_files = 0
    for path in paths:
        data = read_bytes(path, source)
        if is_text(data):
            files.append(TextFile(path.relative_to(root).as_posix(), data))
        else:
            skipped_files += 1
    return root, files, skipped_files


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


def split_at_newline(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """Split one file into (train, validation): the tail after the newline nearest to (1 - val_fraction)·size.

    The newline stays with the training part. A newline that is the file's last byte is not a candidate
    (it would leave the tail empty); with no candidate the cut is at the byte position itself.
    """
    target = round((1 - val_fraction) * len(data))
    candidates = []
    before = data.rfind(b"\n", 0, target)
    if before != -1:
        candidates.append(before + 1)
    after = data.find(b"\n", target, len(data) - 1)
    if after != -1:
        candidates.append(after + 1)
    cut = min(candidates, key=lambda position: abs(position - target)) if candidates else target
    return data[:cut], data[cut:]


def documents_of(data: bytes, is_python_source: bool) -> list[bytes]:
    """A Python file of the standard library gives one document per top-level block; any other file is one."""
    return split_top_level_blocks(data) if is_python_source else [data]


def packed(documents: list, seq_len: int, separator: list[int]) -> list:
    """The documents as one, each preceded by `separator`, cut to 1 + k·seq_len tokens so that make_rows
    gives k full rows, no padding; the last, incomplete row's tokens are left out.

    Bytes have no separator token (separator is []), so byte documents are joined as they are (text files
    and the standard library's blocks mostly end in a newline); a tokenizer's end-of-text token separates
    its documents, as in GPT-2's training data."""
    if documents and isinstance(documents[0], bytes):
        joined = b"".join(documents)
    else:
        joined = np.concatenate([np.concatenate([separator, document]) for document in documents] or [[]])
    full_rows = max(0, (len(joined) - 1) // seq_len)
    return [joined[: 1 + full_rows * seq_len]] if full_rows else []


def tokenized(documents: list[bytes], tokenizer) -> list[np.ndarray]:
    """Each document's ids under `tokenizer` (a Hugging Face Tokenizer)."""
    encodings = tokenizer.encode_batch([document.decode("utf-8") for document in documents], add_special_tokens=False)
    return [np.array(encoding.ids, dtype=np.int64) for encoding in encodings]


def load_text(source: str, seq_len: int, val_fraction: float, packed_layout: bool = False, tokenizer=None) -> Data:
    """Read `source`, split it into training and validation by file, and cut both into rows: one
    document per row (padded), or with packed_layout every split's documents joined into full rows.
    Tokens are bytes, or the ids of `tokenizer` when one is given.

    With two or more files the split is by a hash of each file's path (data.validation_keys); a lone file
    is split at a newline (split_at_newline). val_fraction == 0 means no validation set.
    """
    root, files, skipped_files = read_text_files(source)
    is_python_source = source == "stdlib"

    train_documents: list[bytes] = []
    val_documents: list[bytes] = []
    val_files = 0
    # A file under 2 bytes holds no target (a target needs a token before it), so it takes no part in the
    # split: an empty file beside one real file must not become the whole validation set.
    files_with_targets = [file for file in files if len(file.data) >= 2]
    if len(files_with_targets) == 1 and val_fraction > 0:
        [lone_file] = files_with_targets
        train_part, val_part = split_at_newline(lone_file.data, val_fraction)
        train_documents += documents_of(train_part, is_python_source)
        val_documents += documents_of(val_part, is_python_source)
        val_files = 1
        for file in files:  # the files without a target: documents that make_rows drops, counted in the summary
            if file is not lone_file:
                train_documents += documents_of(file.data, is_python_source)
    else:
        chosen = validation_keys([file.relative_path for file in files_with_targets], val_fraction)
        for file in files:
            documents = documents_of(file.data, is_python_source)
            if file.relative_path in chosen:
                val_documents += documents
                val_files += 1
            else:
                train_documents += documents

    all_documents = train_documents + val_documents  # bytes, counted below
    vocab_size, separator = BYTE_VOCAB_SIZE, []
    if tokenizer is not None:
        from accumulation.data.tokenizer import end_of_text_token

        vocab_size = tokenizer.get_vocab_size()
        separator = [] if end_of_text_token(tokenizer) is None else [end_of_text_token(tokenizer)]
        train_documents, val_documents = tokenized(train_documents, tokenizer), tokenized(val_documents, tokenizer)
    if packed_layout:
        train_documents = packed(train_documents, seq_len, separator)
        val_documents = packed(val_documents, seq_len, separator)
    train = make_rows(train_documents, seq_len, vocab_size)
    val = make_rows(val_documents, seq_len, vocab_size)
    if train.num_rows + val.num_rows == 0:
        raise DataError(
            f"data.source {source!r} has no usable text (no text file with at least 2 bytes); "
            f'add UTF-8 text to {root} or set data.source="stdlib"'
        )
    return data_from_rows(
        source,
        train,
        val,
        val_fraction,
        root=str(root),
        files=len(files),
        val_files=val_files,
        skipped_files=skipped_files,
        bytes=sum(len(file.data) for file in files),
        documents=len(all_documents),
        dropped_documents=sum(1 for document in all_documents if len(document) < 2),
        truncated_documents=0,  # a long document is cut into several rows, never truncated
        layout="packed" if packed_layout else "documents",
        vocab_from="bytes" if tokenizer is None else "data.tokenizer",
    )
