"""What a registered source (a fork's own data: images, features, any rows) hands back: its Data with the summary
every source gives and none of the language-model fields (files, layout, vocabulary, padding), and the fingerprint
of its tensors that resume compares. The built-in sources use accumulation/data/splits.py's data_from_rows.
"""

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from accumulation.config.config import DataConfig
from accumulation.config.registry import fork_raised, lookup
from accumulation.data.rows import DataError, Rows
from accumulation.data.splits import Data, DataSummary


@dataclass
class CustomDataSummary(DataSummary):
    """A custom source's summary: its header line names its rows, fingerprint and supervised targets per row, and
    leaves out the files, layout and vocabulary of a language model's data."""

    def describe(self) -> str:
        return (
            f"data {self.source}: {self.format}, {self.train_rows:,} training rows and {self.validation_text()}; "
            f"supervised {self.targets} per training row min {self.min_supervised_tokens} / median "
            f"{self.median_supervised_tokens:g} / max {self.max_supervised_tokens}; fingerprint {self.fingerprint}"
        )


def tensor_fingerprint(*parts) -> str:
    """First 16 hex digits of sha256 over tensors (their shape, dtype and bytes) and strings, in order: the
    fingerprint of a custom source's rows, for resume to compare (it must change whenever a row would)."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().cpu().contiguous()
            digest.update(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(str(part).encode())
    return digest.hexdigest()[:16]


def data_from_custom_rows(
    source: str,
    train: Rows,
    val: Rows | None,
    *,
    fingerprint: str,
    vocab_size: int,
    format: str = "custom rows",
    targets: str = "targets",
) -> Data:
    """A custom source's Data with the minimal summary: its name, rows, fingerprint and supervised targets per
    row (from supervised_counts at step 0), and none of the language-model fields (files, layout, vocabulary,
    padding). `vocab_size` is the number of classes the labels index (the model's output size when
    model.vocab_size = 0); `targets` names what a target is in the header and the speed lines."""
    if train.num_rows == 0:
        raise DataError(f"data.source {source!r}: the training split has no rows")
    counts = train.supervised_counts(torch.arange(train.num_rows), 0).numpy()
    summary = CustomDataSummary(
        source=source,
        train_rows=train.num_rows,
        val_rows=val.num_rows if val is not None else 0,
        fingerprint=fingerprint,
        min_supervised_tokens=int(counts.min()),
        median_supervised_tokens=float(np.median(counts)),
        max_supervised_tokens=int(counts.max()),
        targets=targets,
        root=source,
        seq_len=train.seq_len or 0,
        vocab_size=vocab_size,
        format=format,
        val_rows_read=val.num_rows if val is not None else 0,
    )
    return Data(train=train, val=val, summary=summary, vocab_size=vocab_size)


def built_by_a_registered_source(settings: DataConfig, model_vocab_size: int, seed: int) -> Data:
    """A registered source's Data; what its build raises (bar a DataError, already one line) or a return value that
    is not a Data is a DataError naming the build."""
    build = lookup("data", settings.source).build
    name = f"data.source: {settings.source}'s build ({getattr(build, '__qualname__', 'its build')})"
    try:
        built = build(settings, model_vocab_size=model_vocab_size, seed=seed)
    except (DataError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # the fork's own fault: one line, after its traceback when it is a bug
        raise DataError(f"{name} raised {fork_raised(error)}; fix the build or the source's keys") from None
    if not isinstance(built, Data):
        raise DataError(
            f"{name} returned {type(built).__name__}, not a Data; return data_from_custom_rows(...) "
            f"(accumulation/data/custom.py, docs/forking.md)"
        )
    return built
