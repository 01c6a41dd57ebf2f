"""Byte-level data: documents from text files, rows of seq_len + 1 tokens, and the data order.

A token is one byte (vocabulary 256), so text is never decoded for training; it is only checked to be
UTF-8 so that binary files do not slip in.

The pipeline, in the order the functions below appear:
    source  ->  text files  ->  train/validation split by file  ->  documents  ->  rows (RowSet)
and, every optimizer step:
    (seed, step, global_batch_size)  ->  row ids of the step  ->  this rank's micro-batches
"""

import functools
import hashlib
import math
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accumulation.batching import IGNORE_INDEX, MicroBatch, micro_batch_slices

# Folders of the standard library that are left out of the "stdlib" corpus: installed third-party
# packages, and test suites (large, repetitive, and full of deliberately odd code).
STDLIB_EXCLUDED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

# Each epoch's permutation comes from a generator seeded with seed * EPOCH_SEED_STRIDE + epoch.
EPOCH_SEED_STRIDE = 1_000_003

TAILS = ("drop", "partial")


class DataError(ValueError):
    """A problem with the user's data, worded as one line that names the path and the fix."""


# ---------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------


@dataclass
class RowSet:
    """Training or validation rows, stored compactly (one byte per token).

    tokens   uint8 [num_rows, seq_len + 1]: the row's bytes, then zeros after its real length
    lengths  int32 [num_rows]: real tokens in the row, 2..seq_len + 1

    A row of `length` real tokens supervises `length - 1` next-token targets: input position j predicts
    token j + 1 for j < length - 1.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    def supervised_tokens(self) -> torch.Tensor:
        """int64 [num_rows]: next-token targets of each row."""
        return self.lengths.long() - 1


def make_rows(documents: list[bytes], seq_len: int) -> RowSet:
    """Cut every document into rows of seq_len + 1 tokens with stride seq_len.

    Row i of a document covers bytes [i·seq_len, i·seq_len + seq_len + 1): consecutive rows share one
    byte, the last input of one row being the first input of the next, so each of the document's L - 1
    targets is supervised exactly once, by ceil((L - 1) / seq_len) rows. A row never crosses into the next
    document; the last row of a document is right-padded with zeros. Documents shorter than 2 bytes give no rows.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    tokens_per_row = seq_len + 1
    kept = [document for document in documents if len(document) >= 2]
    document_bytes = np.array([len(document) for document in kept], dtype=np.int64)
    document_starts = np.cumsum(document_bytes) - document_bytes  # offsets in the concatenation
    row_counts = (document_bytes - 2) // seq_len + 1  # ceil((L - 1) / seq_len) for every document at once

    # For every row: its document, its index within that document, and so its start and length.
    row_document = np.repeat(np.arange(len(kept)), row_counts)
    first_row_of_document = np.cumsum(row_counts) - row_counts
    row_in_document = np.arange(int(row_counts.sum())) - first_row_of_document[row_document]
    offset_in_document = row_in_document * seq_len
    row_starts = document_starts[row_document] + offset_in_document
    lengths = np.minimum(tokens_per_row, document_bytes[row_document] - offset_in_document)

    # Trailing zeros so that every row start has a full window; the window of a document's last row runs
    # into the next document (or these zeros), and everything past the row's length is zeroed below.
    concatenated = np.frombuffer(b"".join(kept) + bytes(tokens_per_row), dtype=np.uint8)
    windows = np.lib.stride_tricks.sliding_window_view(concatenated, tokens_per_row)
    tokens = windows[row_starts]  # fancy indexing copies: a fresh uint8 array, no int64 intermediate
    tokens[np.arange(tokens_per_row) >= lengths[:, None]] = 0
    return RowSet(tokens=torch.from_numpy(tokens), lengths=torch.from_numpy(lengths.astype(np.int32)))


def row_fingerprint(rows: RowSet) -> str:
    """First 16 hex digits of sha256 over the rows' shape, tokens and lengths.

    A checkpoint stores it so that resuming on different data (another source, seq_len or split) is noticed.
    """
    digest = hashlib.sha256()
    digest.update(f"{tuple(rows.tokens.shape)}".encode())
    digest.update(rows.tokens.numpy().tobytes())
    digest.update(rows.lengths.numpy().astype("<i4").tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------------


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
                f'data.source {source!r} does not exist; set it to a text file, a folder of text files, or "stdlib"'
            )
        if root.is_file():
            data = read_bytes(root, source)
            if not is_text(data):
                raise DataError(
                    f"data.source {source!r} is not a text file (it contains a NUL byte or is not valid UTF-8); "
                    f"point data.source at a UTF-8 text file or a folder of them"
                )
            return root, [TextFile(root.name, data)], 0
        if not root.is_dir():
            raise DataError(f"data.source {source!r} is neither a file nor a folder; point it at a text file or folder")
        paths = folder_file_paths(root)

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


# ---------------------------------------------------------------------------------------------------
# Validation split
# ---------------------------------------------------------------------------------------------------


def path_hash(relative_path: str) -> float:
    """A stable hash of a path in [0, 1): crc32 is the same on every machine and Python version."""
    return zlib.crc32(relative_path.encode("utf-8")) / 2**32


def validation_paths(relative_paths: list[str], val_fraction: float) -> set[str]:
    """The files whose path hash falls below val_fraction.

    Hashing the path (not the position in the listing) keeps a file on its side of the split when
    other files are added or removed. When nothing falls below val_fraction but there are at least two
    files, the file with the smallest hash is used, so that a small corpus still has a validation set.
    """
    if val_fraction == 0:
        return set()
    chosen = {path for path in relative_paths if path_hash(path) < val_fraction}
    if not chosen and len(relative_paths) >= 2:
        chosen = {min(relative_paths, key=path_hash)}
    return chosen


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


# ---------------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------------


@dataclass
class CorpusSummary:
    source: str  # data.source as given
    root: str  # the file or folder it resolved to
    seq_len: int
    files: int  # text files used, training and validation
    val_files: int  # of those, files in the validation split (0 or 1 for a single file split at a newline)
    skipped_files: int  # non-text files left out
    bytes: int  # bytes of the text files used
    documents: int
    dropped_documents: int  # documents under 2 bytes: nothing to predict
    train_rows: int
    val_rows: int
    min_supervised_tokens: int  # per training row
    median_supervised_tokens: float
    max_supervised_tokens: int
    padding_fraction: float  # padding positions / all label positions, training rows
    fingerprint: str  # row_fingerprint of the training rows

    def describe(self) -> str:
        skipped = f" ({self.skipped_files} non-text skipped)" if self.skipped_files else ""
        dropped = f" ({self.dropped_documents:,} under 2 bytes dropped)" if self.dropped_documents else ""
        validation = f"{self.val_rows:,} validation rows" if self.val_rows else "no validation set"
        location = self.source if self.source == self.root else f"{self.source} ({self.root})"
        return (
            f"data {location}: {self.files:,} files{skipped}, {self.bytes / 1e6:.1f} MB, "
            f"{self.documents:,} documents{dropped}; {self.train_rows:,} training rows and {validation} "
            f"of seq_len {self.seq_len}, supervised tokens per training row "
            f"min {self.min_supervised_tokens} / median {self.median_supervised_tokens:g} "
            f"/ max {self.max_supervised_tokens}, "
            f"{100 * self.padding_fraction:.1f}% padding; fingerprint {self.fingerprint}"
        )


@dataclass
class Corpus:
    train: RowSet
    val: RowSet | None  # None when val_fraction == 0
    summary: CorpusSummary


def documents_of(data: bytes, is_python_source: bool) -> list[bytes]:
    """A Python file of the standard library gives one document per top-level block; any other file is one."""
    return split_top_level_blocks(data) if is_python_source else [data]


def load_corpus(source: str, seq_len: int, val_fraction: float) -> Corpus:
    """Read `source`, split it into training and validation by file, and cut both into rows.

    With two or more files the split is by file (validation_paths); a lone file is split at a newline
    (split_at_newline). val_fraction == 0 means no validation set.
    """
    if not 0 <= val_fraction < 1:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    root, files, skipped_files = read_text_files(source)
    is_python_source = source == "stdlib"

    train_documents: list[bytes] = []
    val_documents: list[bytes] = []
    val_files = 0
    if len(files) == 1 and val_fraction > 0:
        train_part, val_part = split_at_newline(files[0].data, val_fraction)
        train_documents += documents_of(train_part, is_python_source)
        val_documents += documents_of(val_part, is_python_source)
        val_files = 1
    else:
        chosen = validation_paths([file.relative_path for file in files], val_fraction)
        for file in files:
            documents = documents_of(file.data, is_python_source)
            if file.relative_path in chosen:
                val_documents += documents
                val_files += 1
            else:
                train_documents += documents

    train = make_rows(train_documents, seq_len)
    val = make_rows(val_documents, seq_len)
    if train.num_rows + val.num_rows == 0:
        raise DataError(
            f"data.source {source!r} has no usable text (no text file with at least 2 bytes); "
            f'add UTF-8 text to {root} or set data.source="stdlib"'
        )
    if train.num_rows == 0:
        raise DataError(
            f"data.source {source!r}: all its text fell into the validation split (data.val_fraction={val_fraction}); "
            f"lower data.val_fraction or add more files"
        )
    if val_fraction > 0 and val.num_rows == 0:
        raise DataError(
            f"data.source {source!r}: the validation split (data.val_fraction={val_fraction}) has no text to predict; "
            f"raise data.val_fraction, add more text, or set data.val_fraction=0"
        )

    all_documents = train_documents + val_documents
    supervised = train.supervised_tokens()
    summary = CorpusSummary(
        source=source,
        root=str(root),
        seq_len=seq_len,
        files=len(files),
        val_files=val_files,
        skipped_files=skipped_files,
        bytes=sum(len(file.data) for file in files),
        documents=len(all_documents),
        dropped_documents=sum(1 for document in all_documents if len(document) < 2),
        train_rows=train.num_rows,
        val_rows=val.num_rows,
        min_supervised_tokens=int(supervised.min()),
        median_supervised_tokens=float(np.median(supervised.numpy())),
        max_supervised_tokens=int(supervised.max()),
        padding_fraction=1 - int(supervised.sum()) / (train.num_rows * seq_len),
        fingerprint=row_fingerprint(train),
    )
    return Corpus(train=train, val=val if val_fraction > 0 else None, summary=summary)


# ---------------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------------


def steps_per_epoch(num_rows: int, global_batch_size: int, tail: str) -> int:
    """Optimizer steps in one pass over the rows.

    "drop": num_rows // G full steps; the last num_rows % G rows of each epoch's permutation are unused.
    "partial": ceil(num_rows / G); the last step of an epoch has num_rows % G rows when that is not 0.
    """
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")
    if num_rows < 1:
        raise DataError("the training split has no rows; add text to data.source")
    if tail == "drop" and num_rows < global_batch_size:
        raise DataError(
            f"the training data has {num_rows} rows, fewer than one global batch of {global_batch_size}; "
            f'use a smaller batch.global_batch_size, a smaller data.seq_len, more text, or batch.tail="partial"'
        )
    if tail == "drop":
        return num_rows // global_batch_size
    return math.ceil(num_rows / global_batch_size)


def rows_dropped_per_epoch(num_rows: int, global_batch_size: int, tail: str) -> int:
    """Rows of each epoch that no step uses: num_rows % G with tail "drop", none with "partial"."""
    full_steps = steps_per_epoch(num_rows, global_batch_size, tail)
    return num_rows - full_steps * global_batch_size if tail == "drop" else 0


@functools.lru_cache(maxsize=2)
def epoch_permutation(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of all row ids in epoch `epoch`: torch.randperm from a generator seeded with
    seed * 1_000_003 + epoch (reduced mod 2**64, the range manual_seed accepts).

    Cached, because every step of an epoch reads the same permutation; callers must not modify it.
    """
    generator = torch.Generator()
    generator.manual_seed((seed * EPOCH_SEED_STRIDE + epoch) % 2**64)
    return torch.randperm(num_rows, generator=generator)


def step_row_ids(num_rows: int, global_batch_size: int, seed: int, step: int, tail: str) -> torch.Tensor:
    """int64 row ids of optimizer step `step` (counted from 0 over the whole run).

    A function of (num_rows, G, seed, step, tail) only, so m, A, D and resuming cannot change it. Step s
    belongs to epoch s // steps_per_epoch and takes the next G positions of that epoch's permutation; a
    partial last step takes what is left and no row leaks into the next epoch.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    steps_in_epoch = steps_per_epoch(num_rows, global_batch_size, tail)
    epoch, step_in_epoch = divmod(step, steps_in_epoch)
    first = step_in_epoch * global_batch_size
    # The slice stops at the end of the permutation: that is what makes a partial last step shorter.
    return epoch_permutation(num_rows, seed, epoch)[first : first + global_batch_size].clone()


# ---------------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------------


def micro_batch(rows: RowSet, row_ids: torch.Tensor, micro_batch_size: int) -> MicroBatch:
    """Inputs and labels for `row_ids`, then padding rows up to micro_batch_size.

    A padding row has inputs 0 and no supervised label, so every micro-batch has the same shape and
    padding adds nothing to the loss or to num_examples.
    """
    num_real = len(row_ids)
    tokens = rows.tokens[row_ids].long()  # int64 copy of these rows only
    targets_per_row = rows.lengths[row_ids].long() - 1
    inputs = torch.zeros(micro_batch_size, rows.seq_len, dtype=torch.long)
    labels = torch.full((micro_batch_size, rows.seq_len), IGNORE_INDEX, dtype=torch.long)
    inputs[:num_real] = tokens[:, :-1]
    supervised = torch.arange(rows.seq_len) < targets_per_row[:, None]
    labels[:num_real] = torch.where(supervised, tokens[:, 1:], IGNORE_INDEX)
    return MicroBatch(inputs=inputs, labels=labels, num_examples=num_real)


def build_micro_batches(
    rows: RowSet,
    step_ids: torch.Tensor,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    rank: int,
) -> list[MicroBatch]:
    """This rank's A micro-batches of one step, each of exactly micro_batch_size rows.

    `step_ids` are the step's row ids (step_row_ids); micro_batch_slices says which of them this rank
    feeds to each micro-batch. A partial step has fewer than G ids, and the rows it lacks become padding,
    so every rank always runs the same number of micro-batches of the same shape.
    """
    if len(step_ids) > global_batch_size:
        raise ValueError(f"a step has at most {global_batch_size} row ids, got {len(step_ids)}")
    slices = micro_batch_slices(global_batch_size, micro_batch_size, world_size, rank)
    return [micro_batch(rows, step_ids[positions], micro_batch_size) for positions in slices]


def eval_micro_batch_count(num_rows: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches each rank runs over the validation rows: all ranks run the same number."""
    total = math.ceil(num_rows / micro_batch_size)
    return math.ceil(total / world_size)


def eval_micro_batches(rows: RowSet, micro_batch_size: int, world_size: int, rank: int) -> Iterator[MicroBatch]:
    """This rank's share of the validation rows, in fixed-size micro-batches, built one at a time.

    The rows are cut, in order, into micro-batches of micro_batch_size (the last one padded); rank r
    takes those whose index % world_size == r. Ranks with fewer real micro-batches get all-padding ones,
    so every rank yields eval_micro_batch_count(...) micro-batches and collectives line up. Summing
    token losses and supervised tokens over all ranks gives the loss over the whole split.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    for k in range(eval_micro_batch_count(rows.num_rows, micro_batch_size, world_size)):
        first = (k * world_size + rank) * micro_batch_size
        row_ids = torch.arange(min(first, rows.num_rows), min(first + micro_batch_size, rows.num_rows))
        yield micro_batch(rows, row_ids, micro_batch_size)
