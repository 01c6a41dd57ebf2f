"""Masked language modelling on token files (BERT's objective): the worked fork of data that changes every step.

Each row is seq_len tokens of a token file (the packed rows of accumulation/data/token_files.py, read the same
way). At optimizer step s, each position of row r is masked with probability MASK_FRACTION; a masked position
reads [MASK] (80% of them), a random token of the vocabulary (10%) or its own token (10%), and is the only
kind of position with a target: its original token. Unmasked positions have no target (-100).

The draws are a pure function of (run.seed, s, r, position) (step_uniforms): a row's mask is fresh at every
step, yet every rank, the checker and a resumed run compute the same mask for the same row at the same step,
whichever rank holds the row and whatever m, A and D are. Drawing it from torch's global generator instead
would give each rank (whose generator dropout seeds per rank) and each resume other masks: the step would
no longer equal the full-batch gradient, and a resumed run would not continue the uninterrupted one.

supervised_counts needs the draws only, never the tokens: N costs no file read.
"""

import dataclasses
import hashlib

import numpy as np
import torch

from accumulation.data.rows import DataError, RawExample, labels_from_mask
from accumulation.data.splits import Data
from accumulation.data.token_files import PackedTokenRows, TokenSource, load_token_files
from accumulation.data.uniforms import step_uniforms

MASK_FRACTION = 0.15  # of the positions of each row, on average: masked and supervised
MASK_TOKEN_SHARE = 0.8  # of the masked positions: the input reads [MASK]
RANDOM_TOKEN_SHARE = 0.1  # of the masked positions: the input reads a uniformly random token; the rest keep theirs

# The name of this masking (its way of drawing, which the parameters below do not say), hashed into the
# data's fingerprint with the parameters: a checkpoint of a program that masked otherwise is refused rather
# than resumed onto other targets.
MASKING = "bert-15-80-10-10-mix64"

# step_uniforms streams: independent draws for the same row and step.
WHETHER_MASKED, HOW_REPLACED, RANDOM_TOKEN = 0, 1, 2


def masking_scheme() -> str:
    """The masking as the fingerprint hashes it: its name and every parameter, so that changing a fraction
    without renaming the scheme still changes the fingerprint."""
    return f"{MASKING} mask {MASK_FRACTION!r} [MASK] {MASK_TOKEN_SHARE!r} random {RANDOM_TOKEN_SHARE!r}"


class MaskedTokenRows:
    """PackedTokenRows read as masked-LM rows (the Rows interface of accumulation/data/rows.py)."""

    def __init__(self, packed: PackedTokenRows, seed: int):
        self.packed, self.seed = packed, seed
        self.data_vocab_size = packed.vocab_size  # token ids of the files: 0..data_vocab_size - 1
        self.mask_token = packed.vocab_size  # one id past the files' vocabulary
        self.vocab_size = packed.vocab_size + 1

    @property
    def num_rows(self) -> int:
        return self.packed.num_rows

    @property
    def seq_len(self) -> int:
        return self.packed.seq_len

    def masked(self, row_ids: torch.Tensor, step: int) -> np.ndarray:
        """bool [len(row_ids), seq_len]: the positions step `step` masks (and supervises)."""
        return step_uniforms(self.seed, step, row_ids, self.seq_len, WHETHER_MASKED) < MASK_FRACTION

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        """int64 [len(row_ids)]: masked positions of each row; reads no token."""
        return torch.from_numpy(self.masked(row_ids, step).sum(axis=1).astype(np.int64))

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) int64 [len(row_ids), seq_len]: the corrupted tokens, and the original token at each
        masked position (-100 elsewhere)."""
        tokens = np.empty((len(row_ids), self.seq_len), dtype=np.int64)
        for row, row_id in enumerate(row_ids.tolist()):
            tokens[row] = self.packed.window(row_id)[: self.seq_len]
        masked = self.masked(row_ids, step)
        how = step_uniforms(self.seed, step, row_ids, self.seq_len, HOW_REPLACED)
        random_draws = step_uniforms(self.seed, step, row_ids, self.seq_len, RANDOM_TOKEN)
        random_tokens = (random_draws * self.data_vocab_size).astype(np.int64)
        inputs = tokens.copy()
        inputs[masked & (how < MASK_TOKEN_SHARE)] = self.mask_token
        replaced = masked & (how >= MASK_TOKEN_SHARE) & (how < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE)
        inputs[replaced] = random_tokens[replaced]
        return torch.from_numpy(inputs), labels_from_mask(torch.from_numpy(tokens), torch.from_numpy(masked))

    def raw_example(self, row_id: int, step: int) -> RawExample:
        """The row at step `step` position by position: what the input reads, and the target of each masked one."""
        row_ids = torch.tensor([int(row_id)])
        tokens = self.packed.window(int(row_id))[: self.seq_len].tolist()
        masked = self.masked(row_ids, step)[0]
        how = step_uniforms(self.seed, step, row_ids, self.seq_len, HOW_REPLACED)[0]
        random_token = step_uniforms(self.seed, step, row_ids, self.seq_len, RANDOM_TOKEN)[0]
        inputs, targets = [], {}
        for position, token in enumerate(tokens):
            if not masked[position]:
                inputs.append(token)
                continue
            targets[position] = token
            if how[position] < MASK_TOKEN_SHARE:
                inputs.append(self.mask_token)
            elif how[position] < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE:
                inputs.append(int(random_token[position] * self.data_vocab_size))
            else:
                inputs.append(token)
        return RawExample(inputs=inputs, targets=targets)


def load_masked_token_files(
    source: TokenSource, config_source: str, seq_len: int, val_fraction: float, vocab: int, seed: int
) -> Data:
    """The packed rows of the token files (load_token_files), masked: the vocabulary grows by one ([MASK]),
    and the summary's supervised counts are those of step 0's masks over (up to) the first 4,096 rows."""
    if vocab > 0:
        raise DataError(
            'model.vocab_size: data.task = "masked" takes the vocabulary from the token files and adds [MASK]; '
            "set model.vocab_size = 0"
        )
    packed = load_token_files(source, config_source, seq_len, val_fraction, vocab)
    train = MaskedTokenRows(packed.train, seed)
    val = MaskedTokenRows(packed.val, seed) if packed.val is not None else None
    counts = train.supervised_counts(torch.arange(min(train.num_rows, 4096)), 0).numpy()
    fingerprint = hashlib.sha256(f"{packed.summary.fingerprint} {masking_scheme()}".encode()).hexdigest()[:16]
    summary = dataclasses.replace(
        packed.summary,
        vocab_size=train.vocab_size,
        vocab_from=f"{packed.summary.vocab_from} + [MASK]",
        format=f"{packed.summary.format}, {MASK_FRACTION:.0%} masked per step",
        min_supervised_tokens=int(counts.min()),
        median_supervised_tokens=float(np.median(counts)),
        max_supervised_tokens=int(counts.max()),
        fingerprint=fingerprint,
    )
    return Data(train=train, val=val, summary=summary, vocab_size=train.vocab_size)
