"""Tokenizers: reading text in (JSONL, text with data.tokenizer) and showing token ids as text (the end-of-run
sample). Text and JSONL are bytes unless data.tokenizer names a Hugging Face tokenizer.json, which needs the optional
`tokenizers` package, imported only then.
"""

import functools

import numpy as np

from accumulation.data.locate import expanded_paths, find_token_files
from accumulation.data.rows import DataError

END_OF_TEXT_TOKENS = ("<|endoftext|>", "</s>", "<eos>")  # the end-of-document tokens looked for, in order


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from its tokenizer.json; a DataError when the optional package or the file is
    missing or unreadable."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            f"data.tokenizer {path!r} needs the optional Hugging Face tokenizers package: "
            f'pip install -r requirements-bpe.txt (or set data.tokenizer="bytes")'
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises its own Exception types, e.g. for a missing file or bad JSON
        raise DataError(f"data.tokenizer {path!r}: cannot load it as a tokenizer.json ({error})") from None


def end_of_text_token(tokenizer) -> int | None:
    """The id of the vocabulary's end-of-document token, if it has one of END_OF_TEXT_TOKENS."""
    for token in END_OF_TEXT_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def tokenized(documents: list[bytes], tokenizer) -> list[np.ndarray]:
    """Each document's ids under `tokenizer` (a Hugging Face Tokenizer)."""
    encodings = tokenizer.encode_batch([document.decode("utf-8") for document in documents], add_special_tokens=False)
    return [np.array(encoding.ids, dtype=np.int64) for encoding in encodings]


def decode_bytes(ids: list[int]) -> str:
    """Byte tokens as UTF-8 text. A model whose vocabulary was padded past 256 (model.vocab_size) can sample an
    id that is no byte: it shows as U+FFFD, like any byte sequence that is not UTF-8."""
    replacement = "\ufffd".encode()
    return b"".join(bytes([i]) if i < 256 else replacement for i in ids).decode("utf-8", errors="replace")


def tokenizer_decoder(tokenizer):
    """A Hugging Face tokenizer's decode, special tokens kept (the sample shows what the model produced)."""
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


def sample_decoder(config) -> tuple[object, str]:
    """(decode, "") where decode turns token ids into text for the end-of-run sample, or (None, why not).

    data.tokenizer when it names a tokenizer.json; for token files, the tokenizer.json beside them, or
    bytes when their meta.json says "tokenizer": "bytes"; for text and JSONL, bytes.
    """
    settings = expanded_paths(config.data)
    if settings.tokenizer != "bytes":
        return tokenizer_decoder(load_tokenizer(settings.tokenizer)), ""
    found = find_token_files(settings.source)
    if found is None:
        return decode_bytes, ""
    folder = found[1]
    if (folder / "tokenizer.json").is_file():
        return tokenizer_decoder(load_tokenizer(str(folder / "tokenizer.json"))), ""
    from accumulation.data.token_files import read_meta  # token files only

    meta = read_meta(folder)
    if meta is not None and meta[0].get("tokenizer") == "bytes":
        return decode_bytes, ""
    return None, f"no tokenizer.json beside the token files in {folder} to decode it with (or set data.tokenizer)"
