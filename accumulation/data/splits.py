"""What a data source hands back: the training and validation splits (`Data`), their summary for the run header
and for resume (`DataSummary`), and the split itself, by a hash of each file's or example's key (docs/data.md)."""

import hashlib
import zlib
from dataclasses import dataclass

import numpy as np

from accumulation.data.rows import DataError, Rows, RowSet

# Rows hashed at a time by row_fingerprint, so that widening tokens to uint32 never copies a whole split.
FINGERPRINT_CHUNK_ROWS = 65_536


def row_fingerprint(rows: RowSet) -> str:
    """First 16 hex digits of sha256 over the rows' shape, token values, lengths and supervision mask, which
    resume compares. Tokens are hashed as little-endian uint32 whatever their storage type (token_dtype), so the
    fingerprint is a function of the token values alone."""
    digest = hashlib.sha256()
    digest.update(f"{tuple(rows.tokens.shape)}".encode())
    tokens = rows.tokens.numpy()
    for first in range(0, rows.num_rows, FINGERPRINT_CHUNK_ROWS):
        digest.update(tokens[first : first + FINGERPRINT_CHUNK_ROWS].astype("<u4").tobytes())
    digest.update(rows.lengths.numpy().astype("<i4").tobytes())
    digest.update(rows.supervised.numpy().tobytes())  # one byte, 0 or 1, per position
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Validation split
# ---------------------------------------------------------------------------------------------------


def key_hash(key: str) -> float:
    """A stable hash of a string in [0, 1): crc32 is the same on every machine and Python version."""
    return zlib.crc32(key.encode("utf-8")) / 2**32


def validation_keys(keys: list[str], val_fraction: float) -> set[str]:
    """The keys (file paths, example lines) whose hash falls below val_fraction (docs/data.md); when none does
    but there are at least two distinct keys, the key with the smallest hash, so a small source still validates."""
    if val_fraction == 0:
        return set()
    chosen = {key for key in keys if key_hash(key) < val_fraction}
    if not chosen and len(set(keys)) >= 2:
        chosen = {min(keys, key=key_hash)}
    return chosen


# ---------------------------------------------------------------------------------------------------
# The data of a run
# ---------------------------------------------------------------------------------------------------


@dataclass
class DataSummary:
    """What the run header prints about the data and what resume compares (the fingerprint, the file stamps).
    Every source gives the first group; the language-model fields after it only where they mean something
    (a custom source of images leaves them at their defaults: accumulation/data/custom.py)."""

    source: str  # data.source as given
    train_rows: int
    val_rows: int  # rows in the validation split
    fingerprint: str  # what resume compares: row_fingerprint of the training rows, or token_fingerprint
    min_supervised_tokens: int  # supervised targets per training row
    median_supervised_tokens: float
    max_supervised_tokens: int
    targets: str = "tokens"  # what a supervised target is, in the header and the speed lines: "tokens", "targets"
    root: str = ""  # the file or folder it resolved to ("" = the source itself)
    seq_len: int = 0
    vocab_size: int = 0
    files: int = 0  # files used, training and validation
    val_files: int = 0  # of those, files in the validation split (0 or 1 for a single file split within itself)
    skipped_files: int = 0  # non-text files left out
    bytes: int = 0  # bytes of the files used
    documents: int = 0  # documents (text) or examples (JSONL lines) read; 0 for token files, which do not say
    dropped_documents: int = 0  # of those, with no target to predict: no rows
    truncated_documents: int = 0  # of those, cut short to one row of seq_len + 1 tokens
    padding_fraction: float = 0.0  # label positions past a row's last target / all label positions, training rows
    prompt_fraction: float = 0.0  # label positions whose target is prompt, not response / all, training rows
    layout: str = "documents"  # data.layout as resolved: "documents" or "packed"
    format: str = "text"  # "text", "JSONL", "nanoGPT token files", "llm.c token files", or a custom source's own
    tokens: int = 0  # token files: tokens in the files used
    vocab_from: str = "bytes"  # where the vocabulary size came from
    val_rows_read: int = 0  # rows a validation pass reads (data.val_rows); build_data sets it
    file_stamps: tuple = ()  # token files: each training file's stamp (token_files.file_stamps); resume compares them

    def describe(self) -> str:
        skipped = f" ({self.skipped_files} non-text skipped)" if self.skipped_files else ""
        losses = [f"{self.dropped_documents:,} without a target dropped"] if self.dropped_documents else []
        if self.truncated_documents:
            losses.append(f"{self.truncated_documents:,} truncated to seq_len")
        losses_text = f" ({', '.join(losses)})" if losses else ""
        contents = f"{self.tokens:,} tokens" if self.tokens else f"{self.documents:,} documents{losses_text}"
        validation = self.validation_text()
        location = self.source if self.source == self.root else f"{self.source} ({self.root})"
        prompt = f", {100 * self.prompt_fraction:.1f}% prompt" if self.prompt_fraction else ""
        kind = "" if self.format == "text" else f"{self.format}, "
        return (
            f"data {location}: {kind}{self.files:,} files{skipped}, {self.bytes / 1e6:.1f} MB, "
            f"{contents}; layout {self.layout}: {self.train_rows:,} training rows and {validation} "
            f"of seq_len {self.seq_len}, vocabulary {self.vocab_size} ({self.vocab_from}), supervised tokens per "
            f"training row min {self.min_supervised_tokens} / median {self.median_supervised_tokens:g} "
            f"/ max {self.max_supervised_tokens}, "
            f"{100 * self.padding_fraction:.1f}% padding{prompt}; fingerprint {self.fingerprint}"
        )

    def validation_text(self) -> str:
        if not self.val_rows:
            return "no validation set"
        if self.val_rows_read < self.val_rows:
            return f"{self.val_rows:,} validation rows (validation reads {self.val_rows_read:,} of them)"
        return f"{self.val_rows:,} validation rows"


@dataclass
class Data:
    train: Rows
    val: Rows | None  # None when val_fraction == 0
    summary: DataSummary
    vocab_size: int  # the data's vocabulary: 256 for byte tokens


def data_from_rows(source: str, train: RowSet, val: RowSet, val_fraction: float, **description) -> Data:
    """Check the split sizes, then bundle the rows with their summary: `description` gives the DataSummary fields
    that only the source knows (root, files, bytes, documents, ...); the rest is counted from the rows. (Each source
    first reports a source without any usable row in its own words.)"""
    if train.num_rows == 0:
        raise DataError(
            f"data.source {source!r}: all of it fell into the validation split (data.val_fraction={val_fraction}); "
            f"lower data.val_fraction or add more data"
        )
    if val_fraction > 0 and val.num_rows == 0:
        raise DataError(
            f"data.source {source!r}: the validation split (data.val_fraction={val_fraction}) has no text to "
            f"predict; raise data.val_fraction, add more data, or set data.val_fraction=0"
        )
    supervised = train.supervised_tokens()
    label_positions = train.num_rows * train.seq_len
    targets = int(train.lengths.long().sum()) - train.num_rows  # a row of length L has L - 1 targets
    summary = DataSummary(
        source=source,
        seq_len=train.seq_len,
        vocab_size=train.vocab_size,
        train_rows=train.num_rows,
        val_rows=val.num_rows,
        min_supervised_tokens=int(supervised.min()),
        median_supervised_tokens=float(np.median(supervised.numpy())),
        max_supervised_tokens=int(supervised.max()),
        padding_fraction=1 - targets / label_positions,
        prompt_fraction=(targets - int(supervised.sum())) / label_positions,
        fingerprint=row_fingerprint(train),
        val_rows_read=val.num_rows,
        **description,
    )
    return Data(train=train, val=val if val_fraction > 0 else None, summary=summary, vocab_size=train.vocab_size)
