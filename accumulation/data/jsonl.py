"""Supervised fine-tuning data: a JSONL file of examples, one example per row.

Every non-blank line is one JSON object, of either kind (they may be mixed):

    {"prompt": "Q: 37 + 48 =", "response": " 85\\n"}   tokens: the UTF-8 bytes of the prompt, then of the response;
                                                      only the targets that predict response bytes are supervised
    {"text": "a whole document"}                      every target supervised (as with a prompt of "")

Other keys are ignored. A line that is not such an object is a DataError naming the file and the line.

Tokens are the UTF-8 bytes by default. The byte vocabulary has no end-of-response token: a model learns
where a response stops only from the response text itself (the worked example, data/sft_arithmetic.jsonl,
ends every response with a newline). With data.tokenizer naming a tokenizer.json, prompt and response are
encoded by it, each on its own, and a response ends with the vocabulary's end-of-text token when it has one
(token_files.END_OF_TEXT_TOKENS), which is then supervised like the response.

An example is one row, right-padded to seq_len + 1 tokens. A longer one keeps its first seq_len + 1 tokens
and is counted as truncated; one left without a supervised target (its response cut off entirely, or under
2 tokens in all) is dropped and counted. An example goes to validation when the crc32 hash of its line falls
below data.val_fraction (data.validation_keys), so adding lines never moves another line across the split.
"""

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from accumulation.data.rows import BYTE_VOCAB_SIZE, DataError, RowSet, numpy_token_dtype, token_array
from accumulation.data.splits import Data, data_from_rows, validation_keys

LINE_FORMAT = 'each line must be a JSON object {"prompt": "...", "response": "..."} or {"text": "..."}'

JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}


def json_type_name(value) -> str:
    if isinstance(value, bool):  # bool is a subclass of int: ask first
        return "a boolean"
    if value is None:
        return "null"
    return JSON_TYPE_NAMES[type(value)]


def utf8(source: str, line_number: int, key: str, value) -> bytes:
    """The UTF-8 bytes of a string value, which must be a string."""
    if not isinstance(value, str):
        raise DataError(f"data.source {source!r}, line {line_number}: {key!r} is {json_type_name(value)}, not a string")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:  # JSON escapes can spell lone surrogates, which UTF-8 cannot encode
        raise DataError(
            f"data.source {source!r}, line {line_number}: {key!r} holds a lone surrogate escape; UTF-8 cannot encode it"
        ) from None


def parse_example(source: str, line_number: int, line: str) -> tuple[bytes, bytes]:
    """(prompt bytes, response bytes) of one line; a {"text"} line is a prompt of b""."""
    where = f"data.source {source!r}, line {line_number}"
    try:
        example = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno}); {LINE_FORMAT}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise DataError(f"{where}: nested too deeply to parse; {LINE_FORMAT}") from None
    if not isinstance(example, dict):
        raise DataError(f"{where}: {json_type_name(example)}, not an object; {LINE_FORMAT}")
    has_text = "text" in example
    has_pair = "prompt" in example or "response" in example
    if has_text and has_pair:
        raise DataError(f'{where}: has both "text" and "prompt"/"response"; {LINE_FORMAT}')
    if has_text:
        return b"", utf8(source, line_number, "text", example["text"])
    if not ("prompt" in example and "response" in example):
        raise DataError(f"{where}: has the keys {json.dumps(sorted(example))}; {LINE_FORMAT}")
    return utf8(source, line_number, "prompt", example["prompt"]), utf8(
        source, line_number, "response", example["response"]
    )


def read_examples(source: str) -> tuple[bytes, list[tuple[bytes, bytes]], list[str]]:
    """The file's bytes, its examples in line order, and the stripped text of each example's line."""
    path = Path(source)
    if not path.is_file():
        raise DataError(f"data.source {source!r} does not exist or is not a file; point it at a JSONL file of examples")
    try:
        contents = path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read {path} ({error.strerror or error}); make it readable") from None
    examples, lines = [], []
    # A UTF-8 multi-byte character never contains the byte of "\n", so the bytes may be split before decoding.
    for line_number, line_bytes in enumerate(contents.split(b"\n"), start=1):
        try:
            line = line_bytes.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise DataError(f"data.source {source!r}, line {line_number}: not valid UTF-8") from None
        if line:
            examples.append(parse_example(source, line_number, line))
            lines.append(line)
    return contents, examples, lines


def tokenized(examples: list[tuple[bytes, bytes]], tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt ids, response ids + the end-of-text token if the vocabulary has one) of every example."""
    from accumulation.data.tokenizer import end_of_text_token

    end = [] if end_of_text_token(tokenizer) is None else [end_of_text_token(tokenizer)]

    def encode(texts: list[bytes]) -> list[list[int]]:
        encodings = tokenizer.encode_batch([text.decode("utf-8") for text in texts], add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    prompts = encode([prompt for prompt, _ in examples])
    responses = encode([response for _, response in examples])
    pairs = zip(prompts, responses, strict=True)
    return [(np.array(prompt, dtype=np.int64), np.array(response + end, dtype=np.int64)) for prompt, response in pairs]


class ExampleRows(NamedTuple):
    """What make_example_rows returns: the rows, and what became of the examples that do not fit."""

    rows: RowSet
    dropped: int  # examples without a supervised target within seq_len + 1 tokens: no row
    truncated: int  # examples, among those kept, longer than seq_len + 1 tokens: their row is cut short


def make_example_rows(examples: list[tuple], seq_len: int, vocab_size: int = BYTE_VOCAB_SIZE) -> ExampleRows:
    """One row per (prompt, response) example, its tokens those of prompt then response; only the
    targets that predict response tokens are supervised. Prompt and response are bytes (vocab_size 256)
    or numpy arrays of token ids < vocab_size.

    An example longer than seq_len + 1 tokens keeps its first seq_len + 1 (the end of its response is lost).
    With P prompt tokens and L tokens kept, the targets at token indices max(P, 1)..L - 1 are supervised
    (index 0 is never a target), so an example with L <= max(P, 1) has nothing to learn and is dropped.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    tokens_per_row = seq_len + 1
    kept = [
        (prompt, response)
        for prompt, response in examples
        if min(len(prompt) + len(response), tokens_per_row) > max(len(prompt), 1)
    ]
    prompt_bytes = np.array([len(prompt) for prompt, _ in kept], dtype=np.int64)
    example_bytes = np.array([len(prompt) + len(response) for prompt, response in kept], dtype=np.int64)
    lengths = np.minimum(example_bytes, tokens_per_row)

    texts = [
        prompt + response if isinstance(prompt, bytes) else np.concatenate([prompt, response])
        for prompt, response in kept
    ]
    tokens = np.zeros((len(kept), tokens_per_row), dtype=numpy_token_dtype(vocab_size))
    for row, text in enumerate(texts):
        tokens[row, : lengths[row]] = token_array(text[:tokens_per_row])
    # Input position j predicts token t = j + 1, supervised when prompt_bytes <= t < length.
    targets = np.arange(1, tokens_per_row)
    supervised = (targets >= prompt_bytes[:, None]) & (targets < lengths[:, None])
    rows = RowSet(
        tokens=torch.from_numpy(tokens),
        lengths=torch.from_numpy(lengths.astype(np.int32)),
        supervised=torch.from_numpy(supervised),
        vocab_size=vocab_size,
        texts=texts,
        text_ids=np.arange(len(kept), dtype=np.int64),
        starts=np.zeros(len(kept), dtype=np.int64),
        ends=example_bytes,
        prompt_ends=prompt_bytes,
    )
    return ExampleRows(rows=rows, dropped=len(examples) - len(kept), truncated=int((example_bytes > lengths).sum()))


def load_jsonl(source: str, seq_len: int, val_fraction: float, tokenizer=None) -> Data:
    """Read the examples of a JSONL file, split them by a hash of their lines, and make one row of each;
    tokens are bytes, or the ids of `tokenizer` (a Hugging Face Tokenizer) when one is given."""
    contents, examples, lines = read_examples(source)
    chosen = validation_keys(lines, val_fraction)
    vocab_size = BYTE_VOCAB_SIZE if tokenizer is None else tokenizer.get_vocab_size()
    if tokenizer is not None:
        examples = tokenized(examples, tokenizer)
    train_examples, val_examples = [], []
    for example, line in zip(examples, lines, strict=True):
        (val_examples if line in chosen else train_examples).append(example)
    train = make_example_rows(train_examples, seq_len, vocab_size)
    val = make_example_rows(val_examples, seq_len, vocab_size)
    if train.rows.num_rows + val.rows.num_rows == 0:
        raise DataError(
            f"data.source {source!r} has no example with a supervised target ({len(examples)} examples, "
            f"seq_len {seq_len}); add examples whose response fits in data.seq_len + 1 bytes with the prompt"
        )
    return data_from_rows(
        source,
        train.rows,
        val.rows,
        val_fraction,
        root=source,
        files=1,
        val_files=1 if val_fraction > 0 else 0,
        skipped_files=0,
        bytes=len(contents),
        documents=len(examples),
        dropped_documents=train.dropped + val.dropped,
        truncated_documents=train.truncated + val.truncated,
        format="JSONL",
        vocab_from="bytes" if tokenizer is None else "data.tokenizer",
    )
