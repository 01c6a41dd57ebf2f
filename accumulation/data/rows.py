"""What a row is, for every data source: the `Rows` interface (docs/forking.md, "The `Rows` interface") and the
containers that implement it, in one module that imports no source."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from accumulation.batching import IGNORE_INDEX

# Text and JSONL are tokenized as their UTF-8 bytes, one token per byte, unless data.tokenizer names another.
BYTE_VOCAB_SIZE = 256


class DataError(ValueError):
    """A problem with the user's data, worded as one line that names the path and the fix."""


# ---------------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------------


@dataclass
class RawExample:
    """One row stated plainly: the tokens the model reads and, position by position, what it must predict.

    inputs    the row's input tokens, at most seq_len of them (the positions after them are padding: input 0,
              no target); or, for inputs that are not token ids, the row's tensor exactly as the model reads it
              (an image [C, H, W] after this step's augmentation, a feature vector), or a tuple of such tensors
    targets   {input position: target}: position j must predict targets[j]; a position that is not a key
              has no target (label -100)
    label     instead of targets, one target for the whole row (labels of shape [rows]: a classifier)
    extras    {name: number or tensor}: what the row's loss reads besides its targets, by the keyword it reads
              it as (an advantage, old log-probabilities [seq_len]), and what its objective's definition reads
              (the prompt's group); empty for a loss that reads the targets alone

    Every task is an instance: next-token prediction (targets[j] = the token after position j), a prompt
    (its positions absent from targets), masked positions (targets[j] = the original token where position j
    is masked, the inputs holding the mask), one label per example. The checker builds its reference rows
    from this alone (accumulation/checker/reference.py, reference_rows), never from examples()'s tensors.
    """

    inputs: list[int] | torch.Tensor | tuple[torch.Tensor, ...]
    targets: dict[int, int] = field(default_factory=dict)
    label: int | None = None
    extras: dict[str, float | int | torch.Tensor] = field(default_factory=dict)


def next_token_example(prompt: list[int], response: list[int], seq_len: int) -> RawExample:
    """The RawExample of next-token prediction on prompt + response, cut to seq_len + 1 tokens: input
    position j reads token j and predicts token j + 1, a target exactly when token j + 1 is a response token.
    (A row shorter than seq_len + 1 tokens reads its last token too, as a position without a target.)"""
    tokens = (prompt + response)[: seq_len + 1]
    targets = {j: tokens[j + 1] for j in range(len(tokens) - 1) if j + 1 >= len(prompt)}
    return RawExample(inputs=tokens[:seq_len], targets=targets)


class Rows(Protocol):
    """One split of the data, as the training loop reads it at optimizer step `step` (docs/forking.md)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def raw_example(self, row_id: int, step: int) -> RawExample: ...

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor: ...


class RowHooks:
    """The optional part of the `Rows` interface, for rows that depend on the model being trained (RL rollouts,
    accumulation/rl/on_policy.py): a `Rows` class declares it by subclassing RowHooks and overriding what it needs.
    The loop always calls these, through row_hooks(); these defaults are what every other source means."""

    log_group = "data"  # the group of step_fields' figures in TensorBoard and the other sinks ("rl": rl/mean_reward)

    def bind_policy(self, model: torch.nn.Module, context, resume: dict | None) -> None:
        """Once the model is built (train.py, the checker): the policy the rows are sampled from, the ranks (the
        DistributedContext), and a resume's checkpoint (None for a fresh run)."""

    def loss_sum_fn(self, configured: Callable) -> Callable:
        """The step's loss_sum_fn, given the configured one (model.objective's, or the model's): rows whose loss
        depends on them hand their own (RL rollouts: the run's declared PolicyLoss). build_training calls it once."""
        return configured

    def sampled_at(self, step: int) -> bool:
        """Whether step `step`'s rows are sampled from the model: they then wait for the update of the step before
        instead of being built one step ahead (accumulation/run/batches.py)."""
        return False

    def normaliser(self, row_ids: torch.Tensor, step: int) -> tuple[float | None, str]:
        """(N, its unit) of step `step`, whose rows are `row_ids` (all ranks'). None: N is the step's supervised
        targets, summed from supervised_counts (the mean over targets)."""
        return None, "targets"

    def objective(self, step: int):
        """The objective step `step` declares, which the equivalence checker computes from its definition
        (accumulation/rl/objectives.py's PolicyObjective: aggregation, clip, ratio level, KL and entropy terms);
        None: the mean over supervised targets."""
        return None

    def step_fields(self, step: int, eval_every: int) -> dict:
        """The rows' own fields for the metrics.jsonl line of the step just taken (`step` steps done)."""
        return {}

    def state_dict(self) -> dict:
        """What a checkpoint must hold for a resume to build the same rows ({}: nothing; the rows are a function of
        (seed, step, row id))."""
        return {}


DEFAULT_HOOKS = RowHooks()


def row_hooks(rows: Rows) -> RowHooks:
    """The hooks of a split: its own when its class declares them (subclasses RowHooks), else the defaults."""
    return rows if isinstance(rows, RowHooks) else DEFAULT_HOOKS


def undeclared_hooks(rows: Rows) -> list[str]:
    """The RowHooks methods a `Rows` class defines without declaring RowHooks: the loop would never call them."""
    if isinstance(rows, RowHooks):
        return []
    return [name for name in vars(RowHooks) if not name.startswith("_") and hasattr(rows, name)]


def labels_from_mask(targets: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """The labels of the loss: each target where it is supervised, IGNORE_INDEX everywhere else."""
    return torch.where(supervised, targets, IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------------
# Rows held in memory
# ---------------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest unsigned integer type that holds every token id 0..vocab_size - 1."""
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    if vocab_size <= 2**8:
        return torch.uint8
    if vocab_size <= 2**16:
        return torch.uint16
    return torch.uint32


@dataclass
class RowSet:
    """Rows of one split, stored compactly, with what each row was cut from.

    tokens       token_dtype(vocab_size) [num_rows, seq_len + 1]: the row's tokens, then zeros past its length
    lengths      int32 [num_rows]: real tokens in the row, 2..seq_len + 1
    supervised   bool [num_rows, seq_len]: whether input position j's target, token j + 1, is trained on;
                 always False for j >= length - 1, where there is no target
    vocab_size   token ids lie in 0..vocab_size - 1

    Where row i came from, for raw_example: tokens [starts[i], ends[i]) of texts[text_ids[i]], whose tokens
    before prompt_ends[i] are prompt (prompt_ends is 0 for a plain document). For a document the span is
    exactly the row; for a prompt/response example it is the whole example, which the row may truncate.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    supervised: torch.Tensor
    vocab_size: int
    texts: list  # token sequences: bytes (one token per byte), or numpy arrays of ids from a tokenizer
    text_ids: np.ndarray  # int64 [num_rows]
    starts: np.ndarray  # int64 [num_rows], tokens
    ends: np.ndarray  # int64 [num_rows], tokens
    prompt_ends: np.ndarray  # int64 [num_rows], tokens

    def __post_init__(self):
        num_rows, tokens_per_row = self.tokens.shape
        if self.tokens.dtype != token_dtype(self.vocab_size):
            raise ValueError(f"tokens of a vocabulary of {self.vocab_size} are {token_dtype(self.vocab_size)}")
        if self.lengths.shape != (num_rows,) or self.supervised.shape != (num_rows, tokens_per_row - 1):
            raise ValueError("lengths must be [num_rows] and supervised [num_rows, seq_len]")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    def supervised_tokens(self) -> torch.Tensor:
        """int64 [num_rows]: supervised targets of each row."""
        return self.supervised.sum(dim=1)

    # The rows are the same at every step: `step` is accepted (the Rows interface) and not used.

    def supervised_counts(self, row_ids: torch.Tensor, step: int = 0) -> torch.Tensor:
        """int64 [len(row_ids)]: supervised targets of the given rows, read from the mask alone."""
        return self.supervised[row_ids].sum(dim=1)

    def examples(self, row_ids: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the rows, int64 [len(row_ids), seq_len]: a row's tokens shifted by one."""
        tokens = self.tokens[row_ids].long()  # int64 copy of these rows only
        return tokens[:, :-1], labels_from_mask(tokens[:, 1:], self.supervised[row_ids])

    def raw_example(self, row_id: int, step: int = 0) -> RawExample:
        """Next-token prediction on the span the row was cut from, split at its prompt's end; reads neither
        `tokens` nor `supervised`."""
        row_id = int(row_id)
        text = self.texts[self.text_ids[row_id]]
        start, end = int(self.starts[row_id]), int(self.ends[row_id])
        span = text[start:end]
        tokens = list(span) if isinstance(span, bytes) else span.tolist()  # Python ints of bytes or of numpy ids
        prompt_tokens = max(start, int(self.prompt_ends[row_id])) - start
        return next_token_example(tokens[:prompt_tokens], tokens[prompt_tokens:], self.seq_len)


def token_array(tokens) -> np.ndarray:
    """A token sequence as a numpy array (bytes as uint8, without a copy)."""
    return np.frombuffer(tokens, dtype=np.uint8) if isinstance(tokens, bytes) else np.asarray(tokens)


def numpy_token_dtype(vocab_size: int) -> np.dtype:
    """token_dtype as numpy spells it."""
    return {torch.uint8: np.uint8, torch.uint16: np.uint16, torch.uint32: np.uint32}[token_dtype(vocab_size)]


def make_rows(documents: list, seq_len: int, vocab_size: int = BYTE_VOCAB_SIZE) -> RowSet:
    """Cut every document into rows of seq_len + 1 tokens with stride seq_len, all targets supervised.

    A document is bytes (one token per byte, vocab_size 256) or a numpy array of token ids < vocab_size.

    Row i of a document covers tokens [i·seq_len, i·seq_len + seq_len + 1): consecutive rows share one
    token, the last input of one row being the first input of the next, so each of the document's L - 1
    targets is supervised exactly once, by ceil((L - 1) / seq_len) rows. A row never crosses into the next
    document; the last row of a document is right-padded with zeros. Documents shorter than 2 tokens give no rows.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    tokens_per_row = seq_len + 1
    kept = [document for document in documents if len(document) >= 2]
    document_bytes = np.array([len(document) for document in kept], dtype=np.int64)
    document_starts = np.cumsum(document_bytes) - document_bytes  # offsets in the concatenation
    row_counts = (document_bytes - 2) // seq_len + 1  # ceil((L - 1) / seq_len) for every document at once

    # For every row: its document, its index within that document, and so its start and length.
    row_document = np.repeat(np.arange(len(kept)), row_counts)
    first_row_of_document = np.cumsum(row_counts) - row_counts
    row_in_document = np.arange(int(row_counts.sum())) - first_row_of_document[row_document]
    offset_in_document = row_in_document * seq_len
    row_starts = document_starts[row_document] + offset_in_document
    lengths = np.minimum(tokens_per_row, document_bytes[row_document] - offset_in_document)

    # Trailing zeros so that every row start has a full window; the window of a document's last row runs
    # into the next document (or these zeros), and everything past the row's length is zeroed below.
    storage = numpy_token_dtype(vocab_size)
    pieces = [token_array(document) for document in kept] + [np.zeros(tokens_per_row, dtype=storage)]
    concatenated = np.concatenate(pieces).astype(storage, copy=False)
    windows = np.lib.stride_tricks.sliding_window_view(concatenated, tokens_per_row)
    tokens = windows[row_starts]  # fancy indexing copies: a fresh array of the storage type, no int64 intermediate
    tokens[np.arange(tokens_per_row) >= lengths[:, None]] = 0
    supervised = np.arange(seq_len) < lengths[:, None] - 1  # every target the row has
    return RowSet(
        tokens=torch.from_numpy(tokens),
        lengths=torch.from_numpy(lengths.astype(np.int32)),
        supervised=torch.from_numpy(supervised),
        vocab_size=vocab_size,
        texts=kept,
        text_ids=row_document,
        starts=offset_in_document,
        ends=offset_in_document + lengths,
        prompt_ends=np.zeros(len(row_document), dtype=np.int64),
    )


class RowSubset:
    """Some rows of another Rows object, renumbered 0..len(row_ids) - 1 (the Rows interface)."""

    def __init__(self, rows: Rows, row_ids: torch.Tensor):
        self.rows, self.row_ids = rows, row_ids

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)

    @property
    def seq_len(self) -> int:
        return self.rows.seq_len

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.examples(self.row_ids[row_ids], step)

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        return self.rows.supervised_counts(self.row_ids[row_ids], step)

    def raw_example(self, row_id: int, step: int) -> RawExample:
        return self.rows.raw_example(int(self.row_ids[row_id]), step)


def mix64(values: np.ndarray) -> np.ndarray:
    """A 64-bit mixing function (splitmix64's finalizer), for the data order (sources.py) and the draws per step
    and row (uniforms.py): every output bit depends on every input bit. uint64 arithmetic wraps modulo 2**64,
    which is what the constants are chosen for."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


# ---------------------------------------------------------------------------------------------------
# Text to token ids and back: bytes here, a tokenizer.json in accumulation/data/tokenizer.py (from_tokenizer_json).


class RunTokenizer(NamedTuple):
    """Text to token ids and back, as the run's data made them (the end-of-run sample, the GRPO rollouts)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    files: tuple  # the files it was read from (tokenizer.json, meta.pkl), which an export copies; () for bytes


def decode_bytes(ids: list[int]) -> str:
    """Byte tokens as UTF-8 text. A model whose vocabulary was padded past 256 (model.vocab_size) can sample an
    id that is no byte: it shows as U+FFFD, like any byte sequence that is not UTF-8."""
    replacement = "\ufffd".encode()
    return b"".join(bytes([i]) if i < 256 else replacement for i in ids).decode("utf-8", errors="replace")


BYTES = RunTokenizer(lambda text: list(text.encode("utf-8")), decode_bytes, BYTE_VOCAB_SIZE, ())
