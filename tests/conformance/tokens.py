"""Token files for the masked-LM fork's tests, written in a moment (no tokenizer, no prepare_data run)."""

import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def write_token_folder(folder: Path) -> Path:
    """A nanoGPT token folder (train.bin, val.bin: the bytes of data/sft_arithmetic.jsonl as uint16 tokens, cut
    at 90%; meta.json: vocabulary 256): what `scripts/operations/prepare_data.py` makes of the same text, give or take
    the split."""
    text = np.frombuffer((REPO / "data" / "sft_arithmetic.jsonl").read_bytes(), dtype=np.uint8)
    cut = len(text) * 9 // 10
    text[:cut].astype("<u2").tofile(folder / "train.bin")
    text[cut:].astype("<u2").tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 256}))
    return folder
