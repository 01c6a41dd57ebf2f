"""Tokenizers for reading text in (JSONL, text with data.tokenizer). Text and JSONL are bytes unless data.tokenizer
names a Hugging Face tokenizer.json, which needs the optional `tokenizers` package, imported only then. (Token ids
back to text: from_tokenizer_json, for the end-of-run sample, accumulation/run/sample.py, and the GRPO rollouts.)
"""

import functools

import numpy as np

from accumulation.data.rows import DataError, RunTokenizer

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


def from_tokenizer_json(path) -> RunTokenizer:
    """A Hugging Face tokenizer.json as the run's tokenizer; decoding keeps special tokens (the sample shows what
    the model produced)."""
    tokenizer = load_tokenizer(str(path))
    return RunTokenizer(
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        functools.partial(tokenizer.decode, skip_special_tokens=False),
        tokenizer.get_vocab_size(),
        (path,),
    )


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
