"""The data fingerprints and token-file stamps that every checkpoint stores, pinned to known values.

A resume compares them with the ones the program computes now, so any change to how they are computed
refuses every existing checkpoint (and one that drops information, such as the high bits of uint32 token
ids, lets a resume over other data through). The values below were computed by this code at the commit
that added them, for files the test writes from integer formulas (no random generator, no platform
dependence: sha256 over bytes); a change to them must be deliberate and announced.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from accumulation.config.config import load_config
from accumulation.data import masked_lm
from accumulation.data.sources import build_data
from accumulation.data.token_files import LLMC_MAGIC

TOKENS = 20_000  # more than SAMPLED_BLOCKS_PER_FILE blocks of SAMPLED_BLOCK_TOKENS: the blocks are spaced


def pinned_folder(folder: Path, token_format: str) -> Path:
    """nanoGPT: uint16 ids up to GPT-2's 50,257. llm.c: version 2 (uint32) ids up to 200,000, most of them at
    2^16 or more, so that a hash of their low 16 bits only would differ."""
    folder.mkdir(parents=True)
    positions = np.arange(TOKENS, dtype=np.int64)
    if token_format == "nanoGPT":
        vocab, tokens = 50_257, (positions * 7_919) % 50_257
        (folder / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
        (folder / "val.bin").write_bytes(tokens[:3_000].astype("<u2").tobytes())
    else:
        vocab, tokens = 200_000, (positions * 104_729) % 200_000
        header = np.zeros(256, dtype="<i4")
        header[:3] = (LLMC_MAGIC, 2, TOKENS)
        (folder / "pinned_train_000000.bin").write_bytes(header.tobytes() + tokens.astype("<u4").tobytes())
        (folder / "pinned_val_000000.bin").write_bytes(header.tobytes() + tokens.astype("<u4").tobytes())
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    return folder


def build(folder: Path, *settings: str):
    config = load_config([f"data.source={folder}", "data.seq_len=16", *settings])
    return build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)


# token format -> (fingerprint, the training file's sampled_sha256 stamp, its whole-file sha256 stamp)
PINNED = {
    "nanoGPT": ("990317a5fb146259", "86cf49fe11d58d7b", "bf867b19d941cbdd"),
    "llm.c": ("7730a8ffe0a5aae8", "48e5c554b641822a", "0e6967e37dd62758"),
}


@pytest.mark.parametrize("token_format", ["nanoGPT", "llm.c"])
def test_token_fingerprints_and_stamps_are_the_pinned_values(tmp_path, token_format):
    summary = build(pinned_folder(tmp_path / "tokens", token_format)).summary
    [stamp] = summary.file_stamps
    assert (summary.fingerprint, stamp["sampled_sha256"], stamp["sha256"]) == PINNED[token_format]


MASKED_PINNED = "8180fadfad3a2ead"


def test_the_masked_fingerprint_is_pinned_and_names_the_masking_scheme(tmp_path, monkeypatch):
    """The masks are part of the data: a checkpoint trained on one masking must not resume onto another. The
    scheme's name and each of its parameters change the fingerprint."""
    folder = pinned_folder(tmp_path / "tokens", "nanoGPT")
    masked = ("data.task=masked", "model.name=encoder")
    assert build(folder, *masked).summary.fingerprint == MASKED_PINNED
    seen = {MASKED_PINNED}
    for name, value in [
        ("MASKING", "another-scheme"),
        ("MASK_FRACTION", 0.2),
        ("MASK_TOKEN_SHARE", 0.7),
        ("RANDOM_TOKEN_SHARE", 0.2),
    ]:
        with monkeypatch.context() as patched:
            patched.setattr(masked_lm, name, value)
            fingerprint = build(folder, *masked).summary.fingerprint
        assert fingerprint not in seen, name
        seen.add(fingerprint)
