"""The error of a step whose labels hold other supervised targets than supervised_counts promised (imported only
then, by sources.check_supervised_counts)."""

import torch

from accumulation.data.rows import DataError


def count_mismatch_error(step: int, row_ids: torch.Tensor, held: torch.Tensor, expected: torch.Tensor) -> DataError:
    """One line naming the first row of a micro-batch (`row_ids` its real rows; `held` and `expected` the
    supervised targets of each of its rows, padding rows included) whose labels break the promise."""
    row = int((held != expected).nonzero()[0])
    where = f"row {int(row_ids[row])}" if row < len(row_ids) else "a padding row"
    return DataError(
        f"step {step}: the labels of {where} hold {int(held[row])} supervised targets, but "
        f"supervised_counts promised {int(expected[row])}; every update would be divided by a wrong N: "
        f"make supervised_counts(row_ids, step) count the labels != -100 of examples(row_ids, step) "
        f"(docs/forking.md)"
    )
