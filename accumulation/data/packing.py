"""data.layout = "packed": the documents of a split joined into one and cut into full rows, no padding
(accumulation/data/text_corpus.py's text_data calls it for text of any source).
"""

import numpy as np


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
