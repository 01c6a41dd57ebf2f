"""The messages of the data errors that the default run's checks raise: imported only when a check fails."""

import torch

from accumulation.data.rows import DataError


def split_size_error(source: str, train_rows: int, val_fraction: float) -> DataError:
    """The split left training without rows, or a requested validation set empty. (Each source first reports a
    source without any usable row in its own words.)"""
    if train_rows == 0:
        return DataError(
            f"data.source {source!r}: all of it fell into the validation split (data.val_fraction={val_fraction}); "
            f"lower data.val_fraction or add more data"
        )
    return DataError(
        f"data.source {source!r}: the validation split (data.val_fraction={val_fraction}) has no text to predict; "
        f"raise data.val_fraction, add more data, or set data.val_fraction=0"
    )


def count_mismatch_error(step: int, row_ids: torch.Tensor, held: torch.Tensor, expected: torch.Tensor) -> DataError:
    """One line naming the first row of a micro-batch (`row_ids` its real rows; `held` and `expected` the
    supervised targets of each of its rows, padding rows included) whose labels break the promise of
    supervised_counts."""
    row = int((held != expected).nonzero()[0])
    where = f"row {int(row_ids[row])}" if row < len(row_ids) else "a padding row"
    return DataError(
        f"step {step}: the labels of {where} hold {int(held[row])} supervised targets, but "
        f"supervised_counts promised {int(expected[row])}; every update would be divided by a wrong N: "
        f"make supervised_counts(row_ids, step) count the labels != -100 of examples(row_ids, step) "
        f"(docs/forking.md)"
    )
