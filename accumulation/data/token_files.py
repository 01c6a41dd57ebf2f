"""Token files: the data people already have, memory-mapped and packed into full rows.

Two formats, both a flat sequence of token ids per file, documents already concatenated:

    nanoGPT    a folder holding train.bin and val.bin: raw little-endian uint16 token ids, nothing else
    llm.c      shards named *_train_*.bin and *_val_*.bin (a folder of them, or a glob): a header of 256
               little-endian int32 (header[0] = 20240520, the magic; header[1] = 1 for uint16 tokens,
               2 for uint32; header[2] = the number of tokens), then the tokens

Files are opened with numpy.memmap and never read whole: a row reads its seq_len + 1 tokens when a step
asks for it, so memory and start-up time do not grow with the data. Start-up reads each file's header
and size and a few sampled blocks of tokens (the resume fingerprint hashes those, and checks their ids
against the vocabulary); every row is checked again when it is read, with one max over its tokens.

Layout: packed. Row i of a file is its tokens [i·seq_len, i·seq_len + seq_len + 1): consecutive rows
share one token (the last input of a row is the first input of the next), so each of the file's T - 1
targets is supervised exactly once, by (T - 1) // seq_len rows; the last < seq_len targets of a file
are left out, so no row is padded. Rows never cross from one file into the next.

The vocabulary comes from meta.json beside the files ({"vocab_size": N}, which scripts/operations/prepare_data.py
writes), or from nanoGPT's meta.pkl, read with an unpickler that builds plain containers only (dicts,
lists, strings, numbers) and refuses any class, so a hostile pickle cannot run code. model.vocab_size > 0
is used when neither is there.
"""

import hashlib
import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accumulation.data.rows import DataError, RawExample, next_token_example
from accumulation.data.splits import Data, DataSummary

LLMC_MAGIC = 20240520
LLMC_HEADER_INT32 = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INT32
LLMC_TOKEN_TYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # header[1], the version -> token type
NANOGPT_TOKEN_TYPE = np.dtype("<u2")

# The fingerprint and the start-up vocabulary check read this many blocks of this many tokens per file,
# evenly spaced from its first token to its last.
SAMPLED_BLOCKS_PER_FILE = 4
SAMPLED_BLOCK_TOKENS = 4096
# Training token files totalling at most this many bytes are hashed whole at start-up, so that a resume can tell
# an edit in place from a copy that only lost its modification time (its cost: docs/data.md).
WHOLE_FILE_HASH_MAX_BYTES = 2**30
HASH_READ_BYTES = 2**24


@dataclass
class TokenFile:
    path: Path
    tokens: np.ndarray  # 1-D memmap of the file's token ids, little-endian uint16 or uint32
    header: bytes  # the llm.c header; b"" for a nanoGPT file


@dataclass
class TokenSource:
    format: str  # "nanoGPT" or "llm.c"
    root: Path  # the folder of the files (meta.json lives here)
    train: list[TokenFile]
    val: list[TokenFile]


# ---------------------------------------------------------------------------------------------------
# Finding and opening the files
# ---------------------------------------------------------------------------------------------------


def open_nanogpt_file(path: Path) -> TokenFile:
    """train.bin or val.bin: raw little-endian uint16, so the byte count must be even."""
    size = path.stat().st_size
    if size % NANOGPT_TOKEN_TYPE.itemsize:
        raise DataError(
            f"{path}: {size:,} bytes, an odd count, but a nanoGPT file is uint16 token ids (2 bytes each); "
            f"the file is truncated or not a nanoGPT token file"
        )
    if size == 0:
        raise DataError(f"{path}: empty (no tokens); write the split again, or set data.val_fraction=0 for val.bin")
    return TokenFile(path, np.memmap(path, dtype=NANOGPT_TOKEN_TYPE, mode="r"), b"")


def open_llmc_shard(path: Path) -> TokenFile:
    """An llm.c shard: its header checked against the format and the file's size, its tokens memory-mapped."""
    size = path.stat().st_size
    if size < LLMC_HEADER_BYTES:
        raise DataError(
            f"{path}: {size:,} bytes, shorter than the {LLMC_HEADER_BYTES}-byte header of an llm.c shard; "
            f"the file is truncated or not an llm.c shard"
        )
    with open(path, "rb") as file:
        header = file.read(LLMC_HEADER_BYTES)
    magic, version, token_count = np.frombuffer(header, dtype="<i4")[:3].tolist()
    if magic != LLMC_MAGIC:
        raise DataError(f"{path}: header magic {magic}, expected {LLMC_MAGIC}; this is not an llm.c token shard")
    if version not in LLMC_TOKEN_TYPES:
        raise DataError(
            f"{path}: header version {version}, expected 1 (uint16 tokens) or 2 (uint32 tokens); "
            f"the shard was written by a tool this loader does not know"
        )
    token_type = LLMC_TOKEN_TYPES[version]
    expected_size = LLMC_HEADER_BYTES + token_count * token_type.itemsize
    if token_count <= 0:
        raise DataError(f"{path}: the header announces {token_count} tokens; an empty shard, write it again")
    if size != expected_size:
        problem = "truncated" if size < expected_size else "longer than its header says"
        raise DataError(
            f"{path}: {problem}: the header announces {token_count:,} tokens of {token_type.itemsize} bytes, "
            f"{expected_size:,} bytes with the header, but the file has {size:,}; write the shard again"
        )
    tokens = np.memmap(path, dtype=token_type, mode="r", offset=LLMC_HEADER_BYTES, shape=(token_count,))
    return TokenFile(path, tokens, header)


def open_token_files(found: tuple, source: str, with_validation: bool) -> TokenSource:
    """The token files that find_token_files (accumulation/data/locate.py) `found` for data.source `source`, opened
    and checked (headers and sizes only). Without validation (data.val_fraction = 0) the validation files are left
    alone: neither opened nor checked."""
    token_format, folder, train_paths, val_paths = found
    if not train_paths:
        raise DataError(
            f"data.source {source!r}: llm.c shards without a training split (no *_train_*.bin); add training shards"
        )
    open_file = open_nanogpt_file if token_format == "nanoGPT" else open_llmc_shard
    val_files = [open_file(path) for path in val_paths] if with_validation else []
    return TokenSource(token_format, folder, [open_file(path) for path in train_paths], val_files)


# ---------------------------------------------------------------------------------------------------
# The vocabulary
# ---------------------------------------------------------------------------------------------------


class PlainContainersUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings and numbers only: find_class is how a pickle reaches any
    class or function (and so any code), and here it always refuses."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain containers are allowed")


def read_meta(folder: Path) -> tuple[dict, Path] | None:
    """meta.json, else nanoGPT's meta.pkl (plain containers only), as a dict; None when neither exists."""
    json_path, pickle_path = folder / "meta.json", folder / "meta.pkl"
    try:
        if json_path.is_file():
            meta = json.loads(json_path.read_text(encoding="utf-8"))
            path = json_path
        elif pickle_path.is_file():
            meta = PlainContainersUnpickler(io.BytesIO(pickle_path.read_bytes())).load()
            path = pickle_path
        else:
            return None
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as error:
        raise DataError(f"cannot read the vocabulary from {folder} ({error}); fix the file or delete it") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected an object with vocab_size, got {type(meta).__name__}")
    return meta, path


def token_vocab_size(source: TokenSource, asked_vocab_size: int) -> tuple[int, str]:
    """(vocabulary size, where it came from): meta.json / meta.pkl beside the files, else model.vocab_size."""
    found = read_meta(source.root)
    if found is not None:
        meta, path = found
        vocab_size = meta.get("vocab_size")
        if type(vocab_size) is not int or vocab_size < 1:
            raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r}")
        return vocab_size, path.name
    if asked_vocab_size > 0:
        return asked_vocab_size, "model.vocab_size"
    raise DataError(
        f"{source.root}: token files without meta.json (or meta.pkl) say nothing of their vocabulary; "
        f"set model.vocab_size (e.g. 50304 for GPT-2's 50,257 tokens) or write meta.json with vocab_size"
    )


def check_token_ids(token_file: TokenFile, first: int, tokens: np.ndarray, vocab_size: int, vocab_from: str) -> None:
    """A DataError naming the file when a token id in `tokens` (the file's tokens from `first` on) is too large."""
    if len(tokens) and int(tokens.max()) >= vocab_size:  # one pass in the common case; the rest only for the message
        offset = int(np.argmax(tokens >= vocab_size))
        token_id = int(tokens[offset])
        if vocab_from == "model.vocab_size":  # no meta.json: the setting governs the check
            advice = f"set model.vocab_size to the tokenizer's vocabulary size (more than {token_id})"
        else:  # meta.json (or meta.pkl) governs the check; model.vocab_size only widens the model beyond it
            advice = (
                f"{vocab_from} governs this check, not model.vocab_size: write the tokenizer's vocabulary size (more "
                f"than {token_id}) as vocab_size in {token_file.path.parent / 'meta.json'} (read before meta.pkl)"
            )
        raise DataError(
            f"{token_file.path}: token {first + offset:,} has id {token_id}, not below the vocabulary "
            f"size {vocab_size} from {vocab_from}; {advice}"
        )


def sampled_blocks(token_file: TokenFile) -> list[tuple[int, np.ndarray]]:
    """(first token, tokens) of SAMPLED_BLOCKS_PER_FILE blocks, evenly spaced, the first and last included."""
    count = len(token_file.tokens)
    block = min(SAMPLED_BLOCK_TOKENS, count)
    firsts = np.linspace(0, count - block, SAMPLED_BLOCKS_PER_FILE).astype(np.int64)
    return [(int(first), np.asarray(token_file.tokens[first : first + block])) for first in np.unique(firsts)]


# ---------------------------------------------------------------------------------------------------
# Packed rows
# ---------------------------------------------------------------------------------------------------


class PackedTokenRows:
    """Rows of seq_len + 1 tokens read from memory-mapped token files (the Rows interface of data/rows.py)."""

    def __init__(self, files: list[TokenFile], seq_len: int, vocab_size: int, vocab_from: str):
        self.files, self._seq_len, self.vocab_size, self.vocab_from = files, seq_len, vocab_size, vocab_from
        rows_per_file = [max(0, (len(token_file.tokens) - 1) // seq_len) for token_file in files]
        self.first_rows = np.concatenate([[0], np.cumsum(rows_per_file)]).astype(np.int64)  # [files + 1]

    @property
    def num_rows(self) -> int:
        return int(self.first_rows[-1])

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def window(self, row_id: int) -> np.ndarray:
        """The row's seq_len + 1 tokens, read from its file (and checked against the vocabulary)."""
        if not 0 <= row_id < self.num_rows:
            raise IndexError(f"row {row_id} is outside 0..{self.num_rows - 1}")
        file_index = int(np.searchsorted(self.first_rows, row_id, side="right")) - 1
        token_file = self.files[file_index]
        first = (row_id - int(self.first_rows[file_index])) * self._seq_len
        tokens = np.asarray(token_file.tokens[first : first + self._seq_len + 1])
        check_token_ids(token_file, first, tokens, self.vocab_size, self.vocab_from)
        return tokens

    # The rows are the same at every step: `step` is accepted (the Rows interface) and not used.

    def examples(self, row_ids: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) int64 [len(row_ids), seq_len]: every target supervised, nothing padded."""
        tokens = np.empty((len(row_ids), self._seq_len + 1), dtype=np.int64)
        for row, row_id in enumerate(row_ids.tolist()):
            tokens[row] = self.window(row_id)
        tokens = torch.from_numpy(tokens)
        return tokens[:, :-1], tokens[:, 1:]

    def supervised_counts(self, row_ids: torch.Tensor, step: int = 0) -> torch.Tensor:
        """int64 [len(row_ids)]: seq_len for every row; a packed row has no padding and no prompt."""
        return torch.full((len(row_ids),), self._seq_len, dtype=torch.int64)

    def raw_example(self, row_id: int, step: int = 0) -> RawExample:
        """Next-token prediction on a plain window of the file: no prompt, every target supervised."""
        return next_token_example([], self.window(int(row_id)).tolist(), self._seq_len)


def sampled_block_bytes(token_file: TokenFile) -> bytes:
    """The sampled blocks of a file as the fingerprint and the file stamps hash them: each block's first token
    index, then its tokens as little-endian uint32."""
    return b"".join(
        f"{first}:".encode() + tokens.astype("<u4").tobytes() for first, tokens in sampled_blocks(token_file)
    )


def token_fingerprint(token_format: str, files: list[TokenFile], seq_len: int) -> str:
    """16 hex digits of sha256 over the format, seq_len and, per file, its header, token count and sampled
    blocks (tokens hashed as little-endian uint32): what resume checks, read without a pass over the data."""
    digest = hashlib.sha256(f"{token_format} seq_len {seq_len}".encode())
    for token_file in files:
        digest.update(token_file.header + f" {len(token_file.tokens)} tokens".encode())
        digest.update(sampled_block_bytes(token_file))
    return digest.hexdigest()[:16]


def whole_file_sha256(path: Path) -> str:
    """16 hex digits of sha256 over every byte of the file, read in blocks of 16 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(HASH_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()[:16]


def file_stamps(files: list[TokenFile]) -> tuple[dict, ...]:
    """What resume compares per file to notice an edit in place. The fingerprint samples a few blocks, so an
    edit between them (the same length, other tokens) escapes it. When the files total at most
    WHOLE_FILE_HASH_MAX_BYTES, every byte is hashed (`sha256`), which decides alone: a copy that lost its
    modification time resumes, any edit is refused. Larger data is not read whole at every start (10^11
    tokens are minutes of reading), so there `sha256` is None and the size and modification time in
    nanoseconds stand in, which any write changes, at the cost of one stat; a copy that does not keep
    modification times then looks changed too, and the refusal says so. A file is named by its position
    among the training files, not its path, so the same files reached by another spelling or moved resume."""
    whole = sum(token_file.path.stat().st_size for token_file in files) <= WHOLE_FILE_HASH_MAX_BYTES
    stamps = []
    for token_file in files:
        status = token_file.path.stat()
        sampled = hashlib.sha256(sampled_block_bytes(token_file))
        stamps.append(
            {
                "path": str(token_file.path),
                "bytes": status.st_size,
                "mtime_ns": status.st_mtime_ns,
                "sampled_sha256": sampled.hexdigest()[:16],
                "sha256": whole_file_sha256(token_file.path) if whole else None,
            }
        )
    return tuple(stamps)


def load_token_files(source: TokenSource, config_source: str, seq_len: int, val_fraction: float, vocab: int) -> Data:
    """Packed rows of the training and validation files; `vocab` is model.vocab_size (0 = from meta.json)."""
    vocab_size, vocab_from = token_vocab_size(source, vocab)
    for token_file in source.train + source.val:  # the start-up check reads the sampled blocks only
        for first, tokens in sampled_blocks(token_file):
            check_token_ids(token_file, first, tokens, vocab_size, vocab_from)
    train = PackedTokenRows(source.train, seq_len, vocab_size, vocab_from)
    val = PackedTokenRows(source.val, seq_len, vocab_size, vocab_from)
    split_files = {"nanoGPT": "train.bin", "llm.c": "*_train_*.bin shards"}
    if train.num_rows == 0:
        raise DataError(
            f"data.source {config_source!r}: the training split ({split_files[source.format]}) has fewer than "
            f"seq_len + 1 = {seq_len + 1} tokens in every file, so no row; lower data.seq_len or add tokens"
        )
    if val_fraction > 0 and val.num_rows == 0:
        missing = "val.bin" if source.format == "nanoGPT" else "*_val_*.bin shards"
        raise DataError(
            f"data.source {config_source!r}: the validation split ({missing}) is missing or shorter than "
            f"seq_len + 1 = {seq_len + 1} tokens; add it, or set data.val_fraction=0 to train without validation"
        )
    files = source.train + source.val if val_fraction > 0 else source.train
    summary = DataSummary(
        source=config_source,
        root=str(source.root),
        seq_len=seq_len,
        vocab_size=vocab_size,
        files=len(files),
        val_files=len(source.val) if val_fraction > 0 else 0,
        skipped_files=0,
        bytes=sum(token_file.path.stat().st_size for token_file in files),
        documents=0,
        dropped_documents=0,
        truncated_documents=0,
        train_rows=train.num_rows,
        val_rows=val.num_rows if val_fraction > 0 else 0,
        min_supervised_tokens=seq_len,
        median_supervised_tokens=float(seq_len),
        max_supervised_tokens=seq_len,
        padding_fraction=0.0,
        prompt_fraction=0.0,
        fingerprint=token_fingerprint(source.format, source.train, seq_len),
        layout="packed",
        format=f"{source.format} token files",
        tokens=sum(len(token_file.tokens) for token_file in files),
        vocab_from=vocab_from,
        val_rows_read=val.num_rows if val_fraction > 0 else 0,
        file_stamps=file_stamps(source.train),
    )
    return Data(train=train, val=val if val_fraction > 0 else None, summary=summary, vocab_size=vocab_size)
