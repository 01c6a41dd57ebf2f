"""Turn text into token files that train.py memory-maps: python scripts/operations/prepare_data.py INPUT OUT_DIR

    INPUT     a text file (one document), a folder (each UTF-8 text file below it a document, in sorted order;
              other files skipped and counted), or a .jsonl file ({"text"} lines, or {"prompt", "response"}
              lines, whose two parts are joined into one document)
    OUT_DIR   a new (or empty) folder; it receives the token files and meta.json ({"vocab_size": N, ...}),
              and with --tokenizer bpe the trained tokenizer.json

    --format nanogpt   train.bin and val.bin, raw little-endian uint16 (nanoGPT's prepare.py output)
    --format llmc      llm.c shards <name>_train_NNNNNN.bin / <name>_val_NNNNNN.bin, a 256-int32 header
                       (magic 20240520, version 1 = uint16 or 2 = uint32, token count) then the tokens;
                       a new shard every --shard-tokens tokens
    --format both      OUT_DIR/nanogpt and OUT_DIR/llmc, each a complete source for data.source

    --tokenizer bytes  one token per UTF-8 byte, vocabulary 256 (no dependency); documents are joined as they
                       are, the byte vocabulary having no separator token
    --tokenizer bpe    a byte-level BPE of --vocab-size tokens trained here on INPUT with Hugging Face
                       `tokenizers` (pip install -r requirements-bpe.txt; nothing is downloaded); every
                       document is preceded by the special token <|endoftext|>, as in GPT-2's data

A document goes to validation when the crc32 hash of its key (its path in a folder, its line in JSONL)
falls below --val-fraction, so the split is stable when documents are added (data.validation_keys's rule;
a folder in which no path falls below it sends the one with the smallest hash, as the text source does).
A single text file is split at the newline nearest the cut (path_sources.split_at_newline), which reads
it whole; a folder or a JSONL file is read one document at a time, so give one of those for a corpus
larger than memory.
Everything is written under a temporary folder and moved into place at the end: a failed run leaves
nothing, and the staging folders of killed runs (.<OUT_DIR>.partial-<pid>, their process gone) are removed
by the next run. Bad input (or an OUT_DIR that cannot be written) is one line on stderr and exit status 2;
a full disk is one line and exit status 1.
"""

import argparse
import errno
import glob
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from accumulation.data.jsonl import parse_example
from accumulation.data.path_sources import folder_file_paths, split_at_newline
from accumulation.data.rows import DataError
from accumulation.data.splits import key_hash, validation_keys
from accumulation.data.text_corpus import is_text
from accumulation.data.token_files import LLMC_HEADER_INT32, LLMC_MAGIC

END_OF_TEXT = "<|endoftext|>"
BYTE_VOCAB_SIZE = 256
UINT16_VOCAB_LIMIT = 2**16  # nanoGPT files and llm.c version 1 hold ids 0..65535


class PrepareError(Exception):
    """Bad input or arguments, worded as one line (exit status 2)."""


class WriteError(Exception):
    """The output could not be written for want of space (exit status 1: the input is fine, the machine is not)."""


# A full disk or quota: not the input's fault, so not exit status 2.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
WRITE_ERROR_STATUS = 1


def write_error(error: OSError, out_dir: Path) -> Exception:
    """The one line for an OSError while the output was written: no space (WriteError), or a folder this
    user cannot write (PrepareError: OUT_DIR is the argument to change). Nothing of the output is kept."""
    where = error.filename or out_dir
    if error.errno in NO_SPACE_ERRNOS:
        return WriteError(
            f"{where}: the disk is full ({error.strerror}); nothing was kept (the partial output was removed); "
            f"free space or choose an OUT_DIR on another disk, and run the command again"
        )
    return PrepareError(
        f"cannot write {where} ({error.strerror or error}); choose an OUT_DIR in a folder you can write to"
    )


def remove_stale_partials(out_dir: Path) -> None:
    """Remove the staging folders (.<out>.partial-<pid>) that earlier runs for this OUT_DIR left when they were
    killed: those whose process no longer exists. A live one is another run's, and is left alone."""
    for staging in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.partial-*"):
        pid = staging.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass  # it exists, under another user


# ---------------------------------------------------------------------------------------------------
# Documents: (split, text) pairs, read one at a time
# ---------------------------------------------------------------------------------------------------


def documents(input_path: Path, val_fraction: float, skipped: list) -> Iterator[tuple[str, str]]:
    """("train" or "val", text) for every document of the input, in order."""
    if input_path.is_dir():
        paths = folder_file_paths(input_path)
        chosen = validation_keys([path.relative_to(input_path).as_posix() for path in paths], val_fraction)
        for path in paths:
            data = path.read_bytes()
            if not is_text(data):
                skipped.append(path)
                continue
            yield ("val" if path.relative_to(input_path).as_posix() in chosen else "train"), data.decode("utf-8")
    elif input_path.suffix == ".jsonl":
        with open(input_path, "rb") as file:
            for line_number, raw_line in enumerate(file, start=1):
                try:
                    line = raw_line.decode("utf-8").strip()
                except UnicodeDecodeError as error:
                    raise PrepareError(
                        f"{input_path}, line {line_number}: not valid UTF-8 (byte {error.start + 1} of the line); "
                        f"fix or remove the line"
                    ) from None
                if not line:
                    continue
                try:
                    prompt, response = parse_example(str(input_path), line_number, line)
                except DataError as error:
                    raise PrepareError(str(error)) from None
                split = "val" if key_hash(line) < val_fraction else "train"
                yield split, (prompt + response).decode("utf-8")
    else:
        data = input_path.read_bytes()
        if not is_text(data):
            raise PrepareError(f"{input_path}: not UTF-8 text (a NUL byte or invalid UTF-8); give a text file")
        train_part, val_part = split_at_newline(data, val_fraction) if val_fraction > 0 else (data, b"")
        yield "train", train_part.decode("utf-8")
        if val_part:
            yield "val", val_part.decode("utf-8")


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


def train_bpe(input_path: Path, vocab_size: int, val_fraction: float):
    """A byte-level BPE trained on the training documents (the validation split is never seen)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise PrepareError(
            "--tokenizer bpe needs the optional Hugging Face tokenizers package: pip install -r requirements-bpe.txt"
        ) from None
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: text is first mapped to its bytes, so every string can be encoded, with no unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    training_texts = (text for split, text in documents(input_path, val_fraction, []) if split == "train")
    tokenizer.train_from_iterator(training_texts, trainer)
    return tokenizer


def encoder_for(tokenizer):
    """text -> uint32 token ids: bytes, or <|endoftext|> then the BPE tokens."""
    if tokenizer is None:
        return lambda text: np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    return lambda text: np.array([end_of_text, *tokenizer.encode(text).ids], dtype=np.uint32)


# ---------------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------------


class NanoGPTWriter:
    """train.bin / val.bin: the tokens as raw little-endian uint16, appended as they come."""

    def __init__(self, folder: Path, vocab_size: int):
        if vocab_size > UINT16_VOCAB_LIMIT:
            raise PrepareError(f"nanoGPT files hold uint16 ids, and the vocabulary has {vocab_size}; use --format llmc")
        self.files = {split: open(folder / f"{split}.bin", "wb") for split in ("train", "val")}

    def write(self, split: str, tokens: np.ndarray) -> None:
        self.files[split].write(tokens.astype("<u2").tobytes())

    def close(self) -> None:
        for file in self.files.values():
            file.close()


class LlmcWriter:
    """llm.c shards: a header (count patched in when the shard is closed), then the tokens."""

    def __init__(self, folder: Path, name: str, vocab_size: int, shard_tokens: int):
        self.folder, self.name, self.shard_tokens = folder, name, shard_tokens
        self.version = 1 if vocab_size <= UINT16_VOCAB_LIMIT else 2
        self.token_type = "<u2" if self.version == 1 else "<u4"
        self.open_shards = {}  # split -> (file, tokens written)
        self.shard_counts = {"train": 0, "val": 0}

    def header(self, token_count: int) -> bytes:
        header = np.zeros(LLMC_HEADER_INT32, dtype="<i4")
        header[:3] = (LLMC_MAGIC, self.version, token_count)
        return header.tobytes()

    def write(self, split: str, tokens: np.ndarray) -> None:
        while len(tokens):
            if split not in self.open_shards:
                path = self.folder / f"{self.name}_{split}_{self.shard_counts[split]:06d}.bin"
                self.shard_counts[split] += 1
                file = open(path, "wb")
                file.write(self.header(0))
                self.open_shards[split] = (file, 0)
            file, written = self.open_shards[split]
            part = tokens[: self.shard_tokens - written]
            file.write(part.astype(self.token_type).tobytes())
            self.open_shards[split] = (file, written + len(part))
            tokens = tokens[len(part) :]
            if written + len(part) == self.shard_tokens:
                self.close_shard(split)

    def close_shard(self, split: str) -> None:
        file, written = self.open_shards.pop(split)
        file.seek(0)
        file.write(self.header(written))
        file.close()

    def close(self) -> None:
        for split in list(self.open_shards):
            self.close_shard(split)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def prepare(arguments: argparse.Namespace) -> dict:
    input_path, out_dir = Path(arguments.input), Path(arguments.out_dir)
    if not input_path.exists():
        raise PrepareError(f"{input_path} does not exist; give a text file, a folder of text files or a .jsonl file")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PrepareError(f"{out_dir} exists and is not an empty folder; choose a new OUT_DIR")
    if not 0 <= arguments.val_fraction < 1:
        raise PrepareError(f"--val-fraction must be >= 0 and < 1, got {arguments.val_fraction}")
    if arguments.tokenizer == "bpe" and not BYTE_VOCAB_SIZE < arguments.vocab_size <= 2**32:
        raise PrepareError(f"--vocab-size must exceed the 256 byte tokens, got {arguments.vocab_size}")
    if arguments.shard_tokens < 1:
        raise PrepareError(f"--shard-tokens must be a positive integer, got {arguments.shard_tokens}")

    tokenizer = None
    if arguments.tokenizer == "bpe":
        print(f"training a byte-level BPE of {arguments.vocab_size:,} tokens on {input_path} ...", file=sys.stderr)
        tokenizer = train_bpe(input_path, arguments.vocab_size, arguments.val_fraction)
    vocab_size = BYTE_VOCAB_SIZE if tokenizer is None else tokenizer.get_vocab_size()
    encode = encoder_for(tokenizer)

    remove_stale_partials(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    formats = ["nanogpt", "llmc"] if arguments.format == "both" else [arguments.format]
    folders = {name: (staging / name if arguments.format == "both" else staging) for name in formats}
    progress_line_open = False  # the progress line has no newline yet: an error must not be glued onto it
    try:
        for folder in folders.values():
            folder.mkdir(parents=True)
        writers = []
        if "nanogpt" in folders:
            writers.append(NanoGPTWriter(folders["nanogpt"], vocab_size))
        if "llmc" in folders:
            writers.append(LlmcWriter(folders["llmc"], input_path.stem, vocab_size, arguments.shard_tokens))
        counts = {"train": 0, "val": 0}
        skipped: list[Path] = []
        document_count, last_report = 0, 0.0
        for split, text in documents(input_path, arguments.val_fraction, skipped):
            tokens = encode(text)
            for writer in writers:
                writer.write(split, tokens)
            counts[split] += len(tokens)
            document_count += 1
            if time.monotonic() - last_report > 1:
                last_report = time.monotonic()
                print(f"\r{document_count:,} documents, {sum(counts.values()):,} tokens", end="", file=sys.stderr)
                progress_line_open = True
        for writer in writers:
            writer.close()
        if progress_line_open:
            print(file=sys.stderr)  # end the progress line
            progress_line_open = False
        if counts["train"] == 0:
            raise PrepareError(f"{input_path}: no text for the training split; add text or lower --val-fraction")
        if arguments.val_fraction > 0 and counts["val"] == 0:
            raise PrepareError(
                f"{input_path}: no document fell into the validation split (--val-fraction {arguments.val_fraction}); "
                f"raise it, or give --val-fraction 0 and train with data.val_fraction=0"
            )
        meta = {
            "vocab_size": vocab_size,
            "tokenizer": "bytes" if tokenizer is None else "tokenizer.json",
            "end_of_text_token": None if tokenizer is None else tokenizer.token_to_id(END_OF_TEXT),
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "documents": document_count,
            "skipped_files": len(skipped),
            "input": str(input_path),
        }
        for folder in folders.values():
            (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            if tokenizer is not None:
                tokenizer.save(str(folder / "tokenizer.json"))
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(staging, out_dir)
    except OSError as error:
        raise write_error(error, out_dir) from None
    finally:
        if progress_line_open:
            print(file=sys.stderr)  # end the progress line before the error that follows
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a text file, a folder of text files, or a .jsonl file")
    parser.add_argument("out_dir", help="a new or empty folder for the token files and meta.json")
    parser.add_argument("--format", choices=("nanogpt", "llmc", "both"), default="llmc")
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE tokens, <|endoftext|> included")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per llm.c shard")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    arguments = parse_arguments(argv)
    try:
        meta = prepare(arguments)
    except (PrepareError, UnicodeDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # before the output is staged: the input cannot be read
        print(f"error: {error.filename or arguments.input}: {error.strerror or error}", file=sys.stderr)
        return 2
    except WriteError as error:
        print(f"error: {error}", file=sys.stderr)
        return WRITE_ERROR_STATUS
    print(
        f"wrote {arguments.out_dir} ({arguments.format}): {meta['train_tokens']:,} training and "
        f"{meta['val_tokens']:,} validation tokens from {meta['documents']:,} documents, vocabulary "
        f"{meta['vocab_size']:,} ({meta['tokenizer']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
