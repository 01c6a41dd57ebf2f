"""Randomness that is a pure function of (seed, step, row id): what a source that changes its rows with the step
(a fresh mask, an augmentation) and the RL rollouts draw from, never from a global generator (docs/forking.md,
"Data that changes with the step").
"""

import hashlib

import numpy as np
import torch

from accumulation.data.rows import mix64


def step_uniforms(seed: int, step: int, row_ids: torch.Tensor, count: int, stream: int = 0) -> np.ndarray:
    """float64 [len(row_ids), count] in [0, 1): `count` random numbers for each row at optimizer step `step`.

    Number k of row r is mix64 of a key hashed from (seed, step, stream) and r·count + k: a pure function of
    (seed, step, stream, r, k), so any rank, the checker or a resumed run computes the same numbers for the
    same row, in any batch, in any order, without a generator's state to carry or to restore. `stream`
    separates independent draws for the same row (which positions are masked, what replaces them). The top
    53 bits of each 64-bit value make the float: every multiple of 2**-53 in [0, 1) equally likely."""
    digest = hashlib.blake2b(f"{seed}:{step}:{stream}".encode(), digest_size=8).digest()
    key = np.frombuffer(digest, dtype="<u8").astype(np.uint64)[0]
    counters = row_ids.numpy().astype(np.uint64)[:, None] * np.uint64(count) + np.arange(count, dtype=np.uint64)
    # Two rounds: mix64 of the key xor the counter alone would map neighbouring counters of nearby keys alike.
    values = mix64(mix64(counters ^ key) + key)
    return (values >> np.uint64(11)).astype(np.float64) / 2.0**53
