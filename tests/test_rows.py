"""Rows: documents cut into token rows, their supervision mask, fingerprint and storage type. Also the helpers
the other data tests share (building data from a source, and a reference for the rows' inputs and labels)."""

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.config.config import Config, DataConfig
from accumulation.data import sources as data
from accumulation.data.rows import RawExample, RowSet, make_rows, token_dtype
from accumulation.data.splits import Data, row_fingerprint


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def rows_of(document: bytes, seq_len: int) -> int:
    """Rows a document needs: one per seq_len of its len - 1 targets, none without a target."""
    return math.ceil((len(document) - 1) / seq_len) if len(document) >= 2 else 0


def build(source, seq_len: int, val_fraction: float) -> Data:
    """The data of a source, validation reading its whole split (data.val_rows = 0)."""
    settings = DataConfig(source=str(source), seq_len=seq_len, val_fraction=float(val_fraction), val_rows=0)
    defaults = Config()
    return data.build_data(settings, model_vocab_size=defaults.model.vocab_size, seed=defaults.run.seed)


def supervised_targets(rows: RowSet) -> bytes:
    """Every supervised target of every row, in row order, as the rows' supervision mask selects them."""
    return rows.tokens[:, 1:][rows.supervised].numpy().tobytes()


def reference_example(raw: RawExample, seq_len: int) -> tuple[list[int], list[int]]:
    """(inputs, labels) of a row written straight from the definition of RawExample, sharing no code with
    the loop: input j is inputs[j] (0 past them), label j is targets[j] (IGNORE_INDEX where there is none)."""
    inputs = (raw.inputs + [0] * seq_len)[:seq_len]
    labels = [raw.targets.get(j, IGNORE_INDEX) for j in range(seq_len)]
    return inputs, labels


def window_of(raw: RawExample) -> list[int]:
    """The tokens a next-token RawExample was cut from: its inputs, then the last position's target if it
    has one (a full row's last token is a target only)."""
    last = len(raw.inputs) - 1
    return raw.inputs + ([raw.targets[last]] if last in raw.targets else [])


def assert_rows_match_their_raw_examples(rows: RowSet, row_ids: list[int], step: int = 0) -> None:
    batch = data.micro_batch(rows, torch.tensor(row_ids), len(row_ids) + 1, step)  # one padding row too
    for row, row_id in enumerate(row_ids):
        inputs, labels = reference_example(rows.raw_example(row_id, step), rows.seq_len)
        assert batch.inputs[row].tolist() == inputs
        assert batch.labels[row].tolist() == labels


def real_examples(micro_batches) -> Counter:
    """The multiset of real (inputs, labels) rows, checking on the way that padding rows carry nothing."""
    examples = Counter()
    for batch in micro_batches:
        for row in range(batch.inputs.shape[0]):
            if row < batch.num_examples:
                examples[(batch.inputs[row].numpy().tobytes(), batch.labels[row].numpy().tobytes())] += 1
            else:
                assert (batch.inputs[row] == 0).all()
                assert (batch.labels[row] == IGNORE_INDEX).all()
    return examples


# ---------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------


def test_rows_of_one_document_overlap_by_one_token_and_pad_the_last():
    rows = make_rows([b"abcdefghij"], seq_len=4)  # 10 bytes, 9 targets -> rows of 5, 5, 2 tokens
    assert rows.tokens.dtype == torch.uint8
    assert rows.tokens.tolist() == [list(b"abcde"), list(b"efghi"), [ord("i"), ord("j"), 0, 0, 0]]
    assert rows.lengths.tolist() == [5, 5, 2]
    assert rows.supervised.tolist() == [[True] * 4, [True] * 4, [True, False, False, False]]
    assert rows.supervised_tokens().tolist() == [4, 4, 1]
    assert rows.vocab_size == 256
    assert [rows.raw_example(row) for row in range(3)] == [
        RawExample(inputs=list(b"abcd"), targets=dict(enumerate(b"bcde"))),
        RawExample(inputs=list(b"efgh"), targets=dict(enumerate(b"fghi"))),
        RawExample(inputs=list(b"ij"), targets={0: ord("j")}),
    ]


@pytest.mark.parametrize("seq_len", [1, 3, 8, 64])
def test_rows_round_trip_every_document_and_never_cross_into_the_next(seq_len):
    documents = [b"x", b"", b"hello world\n", b"ab", b"0123456789" * 7, b"z" * (2 * seq_len + 1)]
    rows = make_rows(documents, seq_len)

    assert rows.num_rows == sum(rows_of(document, seq_len) for document in documents)
    assert rows.tokens.shape == (rows.num_rows, seq_len + 1)
    assert ((rows.lengths >= 2) & (rows.lengths <= seq_len + 1)).all()
    # Concatenating the supervised targets of a document's rows gives back document[1:], for every document.
    assert supervised_targets(rows) == b"".join(document[1:] for document in documents)
    # Every target a row has is supervised; padding bytes are zero; each row starts where its text is.
    assert torch.equal(rows.supervised, torch.arange(seq_len) < rows.lengths[:, None].long() - 1)
    positions = torch.arange(seq_len + 1)
    assert (rows.tokens[positions >= rows.lengths[:, None].long()] == 0).all()
    first_row = 0
    for document in documents:
        for row in range(rows_of(document, seq_len)):
            length = int(rows.lengths[first_row + row])
            assert rows.tokens[first_row + row, :length].numpy().tobytes() == document[row * seq_len :][:length]
        first_row += rows_of(document, seq_len)


def test_no_documents_give_an_empty_row_set():
    rows = make_rows([b"", b"a"], seq_len=8)
    assert rows.num_rows == 0
    assert rows.tokens.shape == (0, 9)
    assert rows.supervised.shape == (0, 8)


def test_fingerprint_sees_tokens_lengths_seq_len_and_the_mask_but_not_the_storage_width():
    rows = make_rows([b"some text for a row\n"], seq_len=8)
    fingerprint = row_fingerprint(rows)
    assert fingerprint == row_fingerprint(make_rows([b"some text for a row\n"], seq_len=8))
    assert fingerprint != row_fingerprint(make_rows([b"some text for a row!"], seq_len=8))
    assert fingerprint != row_fingerprint(make_rows([b"some text for a row\n"], seq_len=7))
    assert len(fingerprint) == 16
    shorter = rows.lengths.clone()
    shorter[-1] -= 1
    assert fingerprint != row_fingerprint(dataclasses.replace(rows, lengths=shorter))
    # The same tokens and lengths with one target taken out of supervision, as a prompt mask would.
    masked = rows.supervised.clone()
    masked[0, 0] = False
    assert fingerprint != row_fingerprint(dataclasses.replace(rows, supervised=masked))
    # Token values are hashed, not their storage: the same rows in uint16 have the same fingerprint.
    wide = dataclasses.replace(rows, tokens=rows.tokens.to(torch.uint16), vocab_size=300)
    assert fingerprint == row_fingerprint(wide)


@pytest.mark.parametrize(
    "vocab_size, dtype",
    [(1, torch.uint8), (256, torch.uint8), (257, torch.uint16), (2**16, torch.uint16), (2**16 + 1, torch.uint32)],
)
def test_token_storage_is_the_narrowest_type_that_fits_the_vocabulary(vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype
    assert token_dtype(2**32) == torch.uint32
    for impossible in (0, 2**32 + 1):
        with pytest.raises(ValueError, match="vocab_size must be in 1..2\\*\\*32"):
            token_dtype(impossible)


def test_rows_of_a_larger_vocabulary_give_their_token_ids_back():
    rows = make_rows([b"abcdefg"], seq_len=4)
    wide_tokens = rows.tokens.long() * 1000  # ids up to 103,000: uint32 storage
    wide = dataclasses.replace(rows, tokens=wide_tokens.to(torch.uint32), vocab_size=200_000)
    inputs, labels = wide.examples(torch.tensor([1, 0]))
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [wide_tokens[1, :-1].tolist(), wide_tokens[0, :-1].tolist()]
    assert labels[0].tolist() == [102_000, 103_000, IGNORE_INDEX, IGNORE_INDEX]  # row 1 is "efg": 2 targets
    assert labels[1].tolist() == [98_000, 99_000, 100_000, 101_000]  # row 0 is "abcde"
    with pytest.raises(ValueError, match="tokens of a vocabulary of 256 are torch.uint8"):
        dataclasses.replace(rows, tokens=rows.tokens.to(torch.uint16))
