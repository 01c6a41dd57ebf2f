"""The data factory, the data order and the micro-batches: what turns config.data into each rank's micro-batches
(docs/data.md, "From data.source to micro-batches"). What a row is: rows.py; what a source returns: splits.py."""

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, map_inputs, micro_batch_slices
from accumulation.config.config import DataConfig
from accumulation.config.registry import is_piece_name
from accumulation.data import text_corpus
from accumulation.data.rows import DataError, Rows, RowSubset, mix64, row_hooks, undeclared_hooks
from accumulation.data.splits import Data

# Rounds of the Feistel network that orders each epoch's rows (epoch_row_ids); why eight: docs/data.md, "Data order".
FEISTEL_ROUNDS = 8

# The name of the data order below, stored in every checkpoint: a resume refuses a checkpoint written by a
# program that ordered the rows differently (its next step would see other rows than the run it continues).
DATA_ORDER = f"feistel-{FEISTEL_ROUNDS}-blake2b"

TAILS = ("drop", "partial")


def validation_subset(rows: Rows, max_rows: int) -> Rows:
    """The rows a validation pass reads: all of them, or max_rows of them evenly spaced over the split (row ids
    floor(i · num_rows / max_rows)), a function of the split and max_rows alone, so a pass costs the same however
    large the split. max_rows == 0 means all."""
    if max_rows == 0 or rows.num_rows <= max_rows:
        return rows
    return RowSubset(rows, torch.arange(max_rows) * rows.num_rows // max_rows)


def build_data(settings: DataConfig, *, model_vocab_size: int, seed: int) -> Data:
    """The training and validation rows that `settings` (config.data) describes. `model_vocab_size` is
    model.vocab_size (0: from the data), `seed` run.seed (the masked-LM fork's masks draw from it)."""
    source, seq_len = settings.source, settings.seq_len
    if is_piece_name("data", source):  # a registered source (accumulation/config/registry.py): a fork's own data
        from accumulation.data.custom import built_by_a_registered_source

        built = built_by_a_registered_source(settings, model_vocab_size, seed)
    elif source == "stdlib" and settings.tokenizer == "bytes" and settings.task == "next-token":  # the default
        built = text_corpus.load_stdlib(seq_len, settings.val_fraction, settings.layout == "packed")
    else:  # a path, a tokenizer or a masked task: path_sources tells token files, JSONL and text apart
        from accumulation.data.path_sources import load_files

        built = load_files(settings, model_vocab_size, seed)
    undeclared = undeclared_hooks(built.train)
    if undeclared:
        raise DataError(
            f"data.source: the training rows of {source!r} define {', '.join(undeclared)} without declaring them: "
            "subclass accumulation.data.rows.RowHooks in their class, or the loop never calls them"
        )
    rows_seq_len = built.train.seq_len
    if rows_seq_len is not None and rows_seq_len != seq_len:
        raise DataError(
            f"data.seq_len: the rows of {source!r} have {rows_seq_len} positions, but data.seq_len is {seq_len}; "
            f"set data.seq_len={rows_seq_len}"
        )
    if built.val is not None:  # every source's validation, a registered one's too
        built.val = validation_subset(built.val, settings.val_rows)
        built.summary.val_rows_read = built.val.num_rows
    return built


# ---------------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------------


def steps_per_epoch(num_rows: int, global_batch_size: int, tail: str) -> int:
    """Optimizer steps in one pass over the rows.

    "drop": num_rows // G full steps; the last num_rows % G rows of each epoch's permutation are unused.
    "partial": ceil(num_rows / G); the last step of an epoch has num_rows % G rows when that is not 0.
    """
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")
    if num_rows < 1:
        raise DataError("the training split has no rows; add text to data.source")
    if tail == "drop" and num_rows < global_batch_size:
        raise DataError(
            f"the training data has {num_rows} rows, fewer than one global batch of {global_batch_size}; "
            f'use a smaller batch.global_batch_size, a smaller data.seq_len, more text, or batch.tail="partial"'
        )
    if tail == "drop":
        return num_rows // global_batch_size
    return math.ceil(num_rows / global_batch_size)


def rows_dropped_per_epoch(num_rows: int, global_batch_size: int, tail: str) -> int:
    """Rows of each epoch that no step uses: num_rows % G with tail "drop", none with "partial"."""
    full_steps = steps_per_epoch(num_rows, global_batch_size, tail)
    return num_rows - full_steps * global_batch_size if tail == "drop" else 0


def feistel_round_keys(seed: int, epoch: int) -> np.ndarray:
    """uint64 [FEISTEL_ROUNDS]: the keys of epoch `epoch`'s order, from a BLAKE2b hash of "seed:epoch"."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)


def feistel_half_bits(num_rows: int) -> int:
    """Bits of each half of the Feistel network's domain: the smallest h >= 1 with 4**h >= num_rows.

    Row ids 0..num_rows - 1 need b = (num_rows - 1).bit_length() bits; halves of ceil(b / 2) bits hold them,
    and the domain, 4**h <= 2**(b + 1), stays below 4·num_rows."""
    return max(1, ((num_rows - 1).bit_length() + 1) // 2)


def feistel(values: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    """A bijection of 0..4**half_bits - 1 (uint64 in, uint64 out): a balanced Feistel network.

    x is split into halves (L, R) of half_bits bits; each round maps (L, R) -> (R, L xor F(R)), with
    F(R) = mix64(R xor key) cut to half_bits bits. Each round is invertible whatever F is
    ((L, R) = (R' xor F(L'), L')), so the network is a permutation; enough rounds with independent keys
    make it look random (Luby and Rackoff: four, for wide halves).
    """
    shift, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
    left, right = values >> shift, values & mask
    for key in keys:
        left, right = right, left ^ (mix64(right ^ key) & mask)
    return (left << shift) | right


def epoch_row_ids(num_rows: int, seed: int, epoch: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 row ids at the given positions (0..num_rows - 1) of epoch `epoch`'s order of all rows.

    The order is a pseudo-random permutation of 0..num_rows - 1, a function of (num_rows, seed, epoch),
    computed position by position: no table of num_rows entries, so its memory does not grow with the
    data (10**11 rows cost what 10 do). The Feistel network permutes the 4**h >= num_rows ids of its
    domain (fewer than 4·num_rows); "cycle walking" applies it again to any value >= num_rows until the
    value lands in range. Following a bijection's cycle from an in-range point always returns to an
    in-range point, so the walk ends, and the result is a bijection of 0..num_rows - 1.
    """
    keys, half_bits = feistel_round_keys(seed, epoch), feistel_half_bits(num_rows)
    values = feistel(positions.numpy().astype(np.uint64), keys, half_bits)
    outside = values >= num_rows
    while outside.any():  # on average fewer than 4 passes: at least a quarter of the domain is in range
        values[outside] = feistel(values[outside], keys, half_bits)
        outside = values >= num_rows
    return torch.from_numpy(values.astype(np.int64))


def step_row_ids(num_rows: int, global_batch_size: int, seed: int, step: int, tail: str) -> torch.Tensor:
    """int64 row ids of optimizer step `step` (counted from 0 over the whole run).

    A function of (num_rows, G, seed, step, tail) only, so m, A, D and resuming cannot change it. Step s
    belongs to epoch s // steps_per_epoch and takes the next G positions of that epoch's order
    (epoch_row_ids); a partial last step takes what is left and no row leaks into the next epoch.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    steps_in_epoch = steps_per_epoch(num_rows, global_batch_size, tail)
    epoch, step_in_epoch = divmod(step, steps_in_epoch)
    first = step_in_epoch * global_batch_size
    # The range stops at the end of the epoch: that is what makes a partial last step shorter.
    positions = torch.arange(first, min(first + global_batch_size, num_rows))
    return epoch_row_ids(num_rows, seed, epoch, positions)


# ---------------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------------


# No training step: every validation pass reads the same rows (docs/forking.md, "Data that changes with the step").
VALIDATION_STEP = -1


def micro_batch(rows: Rows, row_ids: torch.Tensor, micro_batch_size: int, step: int) -> MicroBatch:
    """Inputs and labels for `row_ids` as step `step` sees them (rows.examples), then padding rows up to
    micro_batch_size.

    A padding row has inputs 0 (of the rows' own dtype and shape: token ids, pixels, each tensor of a tuple) and
    no supervised label, so every micro-batch has the same shape and padding adds nothing to the loss or to
    num_examples.
    """
    num_real = len(row_ids)
    # A source whose loss reads more than the labels returns a third item: a dict of per-row tensors by name
    # (weights, advantages), padded like the inputs and handed to the loss as keywords (MicroBatch.extras).
    example_inputs, example_labels, *extras = rows.examples(row_ids, step)

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((micro_batch_size, *tensor.shape[1:]), dtype=tensor.dtype)
        full[:num_real] = tensor
        return full

    labels = torch.full((micro_batch_size, *example_labels.shape[1:]), IGNORE_INDEX, dtype=torch.long)
    labels[:num_real] = example_labels
    extras = {name: padded(tensor) for name, tensor in (extras[0] if extras else {}).items()}
    return MicroBatch(map_inputs(padded, example_inputs), labels, num_real, extras)


@dataclass
class StepBatch:
    """What one rank feeds to optimizer step `step`, all of it built on the host from (seed, step, row ids)."""

    step: int  # the optimizer step (counted from 0 over the whole run) the rows were built for
    row_ids: torch.Tensor  # int64 [rows of the step]: the whole step's row ids, every rank's (step_row_ids)
    supervised_counts: torch.Tensor  # int64 [rows of the step]: rows.supervised_counts(row_ids, step)
    micro_batches: list[MicroBatch]  # this rank's A micro-batches of m rows each
    slices: list[slice]  # the positions in row_ids of each micro-batch's rows (micro_batch_slices; a partial
    # step's last slices reach past the end of row_ids, and slicing stops there: the rest is padding)
    normaliser: tuple = (None, "targets")  # (N, its unit) as rows.normaliser declares them (RL: sequences, groups)

    @property
    def global_counts(self) -> GlobalCounts:
        """N, the step's supervised targets over all ranks (or the N its objective declares), and its real examples:
        what every gradient is divided by, known on every rank without a collective."""
        normaliser, unit = self.normaliser
        return GlobalCounts(int(self.supervised_counts.sum()), len(self.row_ids), normaliser=normaliser, unit=unit)


def step_batch(
    rows: Rows,
    step: int,
    *,
    seed: int,
    global_batch_size: int,
    tail: str,
    micro_batch_size: int,
    world_size: int,
    rank: int,
) -> StepBatch:
    """Everything optimizer step `step` needs from the data, for this rank: the step's row ids (a function of
    seed, step and G only), the supervised counts of all of them (N), and this rank's micro-batches of the rows
    as this step sees them: the one way train.py, the checker and the scripts get a step's rows."""
    row_ids = step_row_ids(rows.num_rows, global_batch_size, seed, step, tail)
    slices = micro_batch_slices(global_batch_size, micro_batch_size, world_size, rank)
    return StepBatch(
        step=step,
        row_ids=row_ids,
        supervised_counts=rows.supervised_counts(row_ids, step),
        micro_batches=[micro_batch(rows, row_ids[positions], micro_batch_size, step) for positions in slices],
        slices=slices,
        normaliser=row_hooks(rows).normaliser(row_ids, step),
    )


def check_supervised_counts(batch: StepBatch) -> None:
    """A DataError unless this rank's labels hold exactly the supervised targets that supervised_counts
    promised for its rows, row by row (and none on padding rows): N, the divisor of every gradient, is summed
    from supervised_counts (docs/forking.md, "The promises each guarantee depends on"). Host tensors only."""
    for micro_batch, positions in zip(batch.micro_batches, batch.slices, strict=True):
        promised = batch.supervised_counts[positions]
        held = (micro_batch.labels != IGNORE_INDEX).reshape(len(micro_batch.labels), -1).sum(dim=1)
        expected = torch.zeros_like(held)
        expected[: len(promised)] = promised
        if not torch.equal(held, expected):  # one line naming the first row that breaks the promise
            row = int((held != expected).nonzero()[0])
            row_ids = batch.row_ids[positions]  # the micro-batch's real rows; the rest are padding
            where = f"row {int(row_ids[row])}" if row < len(row_ids) else "a padding row"
            raise DataError(
                f"step {batch.step}: the labels of {where} hold {int(held[row])} supervised targets, but "
                f"supervised_counts promised {int(expected[row])}; every update would be divided by a wrong N: "
                f"make supervised_counts(row_ids, step) count the labels != -100 of examples(row_ids, step) "
                f"(docs/forking.md)"
            )


def eval_micro_batches(rows: Rows, micro_batch_size: int, world_size: int, rank: int) -> Iterator[MicroBatch]:
    """This rank's share of the validation rows, in fixed-size micro-batches, built one at a time, the rows
    as VALIDATION_STEP sees them.

    The rows are cut, in order, into micro-batches of micro_batch_size (the last one padded); rank r
    takes those whose index % world_size == r. Ranks with fewer real micro-batches get all-padding ones,
    so every rank yields ceil(ceil(num_rows / m) / D) micro-batches and collectives line up. Summing
    token losses and supervised tokens over all ranks gives the loss over the whole split.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    micro_batches_of_all_ranks = math.ceil(rows.num_rows / micro_batch_size)
    for k in range(math.ceil(micro_batches_of_all_ranks / world_size)):
        first = (k * world_size + rank) * micro_batch_size
        row_ids = torch.arange(min(first, rows.num_rows), min(first + micro_batch_size, rows.num_rows))
        yield micro_batch(rows, row_ids, micro_batch_size, VALIDATION_STEP)
