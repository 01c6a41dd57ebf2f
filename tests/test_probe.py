"""train.py's step-0 probe (accumulation/probe.py): a mean loss, and a loss that reads the outputs at positions
labelled -100, stop the run with one line and exit 2; BatchNorm in train mode and a loss that couples examples
(in-batch negatives) get one warning line each, an error with batch.on_inexact = "error"; the token cross-entropy
SUM and a GroupNorm model pass silently. Each detector alone: a loss only the split of the targets sees, one only
the split of the rows sees, a forward or loss that raises."""

import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import train
from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.probe import InexactStep, StepZeroFailed, probe_loss_and_model
from accumulation.step import token_cross_entropy_sum
from tests.test_step import CPU

CLASSES = 5


def image_batch(rows=6) -> MicroBatch:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(rows, 3, 8, 8, generator=generator)
    labels = torch.randint(0, CLASSES, (rows,), generator=generator)
    labels[-1] = IGNORE_INDEX  # a padding row
    return MicroBatch(images, labels, rows - 1)


def cnn(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, CLASSES))


def mean_loss(outputs, labels):
    return F.cross_entropy(outputs, labels, ignore_index=IGNORE_INDEX)  # reduction="mean": the classic bug


def info_nce_sum(outputs, labels):
    """Each supervised row's logits against every other row's as negatives: additive over targets, not rows."""
    keep = labels != IGNORE_INDEX
    similarity = outputs[keep] @ outputs[keep].T
    return F.cross_entropy(similarity, torch.arange(int(keep.sum())), reduction="sum")


def probe(model, loss, on_inexact="warn", batch=None):
    batch = batch or image_batch()
    return probe_loss_and_model(model, model, loss, batch, torch.device("cpu"), on_inexact)


def test_a_sum_and_group_norm_pass_silently_and_the_model_is_left_in_train_mode():
    model = cnn(nn.GroupNorm(2, 8))
    assert probe(model, token_cross_entropy_sum) == []
    assert model.training


def test_a_mean_loss_is_refused_naming_the_sum():
    with pytest.raises(
        InexactStep, match=r"^step 0: the loss is a mean, not a sum over its targets: .* return the SUM"
    ):
        probe(cnn(nn.GroupNorm(2, 8)), mean_loss)


def test_batch_norm_and_in_batch_negatives_are_named_in_warnings_or_errors():
    model = cnn(nn.BatchNorm2d(8))
    running_mean = model[1].running_mean.clone()
    [line] = probe(model, token_cross_entropy_sum)
    assert line.startswith("1 (BatchNorm2d) normalise each row with the statistics of its micro-batch")
    assert torch.equal(model[1].running_mean, running_mean), "the probe changed BatchNorm's statistics"
    with pytest.raises(InexactStep, match=r"batch.on_inexact=error\): 1 \(BatchNorm2d\)"):
        probe(model, token_cross_entropy_sum, on_inexact="error")
    [line] = probe(cnn(nn.GroupNorm(2, 8)), info_nce_sum)
    assert "couples the examples of a micro-batch" in line and "in-batch negatives" in line
    assert "GradCache" in line


FORK = """
import torch.nn.functional as F
from accumulation.config.registry import register_loss


def mean_cross_entropy(outputs, labels):
    return F.cross_entropy(outputs.flatten(0, -2), labels.flatten(), ignore_index=-100)


register_loss("mean", mean_cross_entropy)


def clamped_cross_entropy_sum(outputs, labels):
    return F.cross_entropy(outputs.flatten(0, -2), labels.flatten().clamp(min=0), reduction="sum")


register_loss("clamped", clamped_cross_entropy_sum)
"""


def error_lines_of_a_refused_run(argv: list[str], tmp_path, monkeypatch, capsys) -> list[str]:
    """train.py with FORK's losses importable as probe_fork: it must exit 2; the lines it wrote on stderr."""
    (tmp_path / "probe_fork.py").write_text(textwrap.dedent(FORK))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert train.main(argv) == 2
    finally:
        sys.modules.pop("probe_fork", None)
    return capsys.readouterr().err.strip().splitlines()


def test_train_py_stops_a_mean_loss_at_step_0_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    argv = [
        "model.objective=probe_fork:mean",
        "model.n_layer=1",
        "model.d_model=16",
        "model.n_head=2",
        "data.seq_len=32",
        "batch.global_batch_size=4",
        "device=cpu",
        f"run.out_dir={tmp_path / 'runs'}",
    ]
    errors = error_lines_of_a_refused_run(argv, tmp_path, monkeypatch, capsys)
    assert len(errors) == 1 and errors[0].startswith("error: step 0: the loss is a mean, not a sum over its targets")
    assert not (tmp_path / "runs" / "default" / "checkpoints").exists()


def test_train_py_stops_a_loss_that_supervises_the_padding_naming_it(tmp_path, monkeypatch, capsys):
    """labels.clamp(min=0) then a sum trains every padding and prompt position as token 0. It is not additive over
    halves of its targets (masking half of them with -100 masks nothing), which the probe blamed on examples that
    couple ("in-batch negatives") while it trained on; the cause it finds is named instead, and the run stops."""
    argv = [
        "--config",
        "configs/sft.toml",
        "model.objective=probe_fork:clamped",
        "run.max_steps=2",
        "model.n_layer=1",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        f"run.out_dir={tmp_path / 'runs'}",
    ]
    errors = error_lines_of_a_refused_run(argv, tmp_path, monkeypatch, capsys)
    assert len(errors) == 1 and errors[0].startswith(
        "error: step 0: the loss reads the outputs at positions whose label is -100 (padding, prompt): moving only"
    ), errors
    assert "labels.clamp(min=0)" in errors[0] and "in-batch negatives" not in errors[0]
    assert not (tmp_path / "runs" / "sft" / "checkpoints").exists()


def token_batch() -> MicroBatch:
    """Two rows of 8 positions: a prompt of 2 (label -100), 3 targets, then padding (-100)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CLASSES, (2, 8), generator=generator)
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[:, 2:5] = tokens[:, 3:6]
    return MicroBatch(tokens, labels, 6)


def test_a_loss_that_reads_the_outputs_beside_its_targets_is_named_as_shifted_twice():
    embedding = nn.Embedding(CLASSES, CLASSES)

    def shifted_again(outputs, labels):
        return token_cross_entropy_sum(outputs[:, :-1], labels[:, 1:])

    with pytest.raises(InexactStep, match=r"labelled -100 next to its targets .* label j read off output j ± 1"):
        probe_loss_and_model(embedding, embedding, shifted_again, token_batch(), torch.device("cpu"), "warn")
    assert probe_loss_and_model(embedding, embedding, token_cross_entropy_sum, token_batch(), "cpu", "warn") == []


def test_a_classifier_loss_that_clamps_a_padding_row_is_refused():
    """One label per row: the padding row's label -100 clamped to class 0."""

    def clamped(outputs, labels):
        return F.cross_entropy(outputs, labels.clamp(min=0), reduction="sum")

    with pytest.raises(InexactStep, match=r"^step 0: the loss reads the outputs at positions whose label is -100"):
        probe(cnn(nn.GroupNorm(2, 8)), clamped)


def test_batch_norm_of_a_model_built_in_eval_mode_is_named_too():
    """The loop trains the model in train mode whatever mode it arrives in (from_pretrained returns eval mode),
    so BatchNorm will normalise by each micro-batch's statistics: the probe must see it in that mode."""
    [line] = probe(cnn(nn.BatchNorm2d(8)).eval(), token_cross_entropy_sum)
    assert line.startswith("1 (BatchNorm2d) normalise each row with the statistics of its micro-batch")


# ------------------------------------------------------------------ The step-0 probe's detectors, one at a time

VOCAB = 11


def token_rows(supervised_per_row: list[int], seq_len: int = 6) -> MicroBatch:
    """Rows of `seq_len` token ids, the first `k` positions of each row supervised."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (len(supervised_per_row), seq_len), generator=generator)
    labels = torch.randint(0, VOCAB, inputs.shape, generator=generator)
    for row, supervised in enumerate(supervised_per_row):
        labels[row, supervised:] = IGNORE_INDEX
    return MicroBatch(inputs, labels, len(supervised_per_row))


def embedding_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, VOCAB)  # logits [rows, seq, VOCAB]: each position on its own


def per_row_mean(outputs, labels):
    """A sequence-mean objective: each row's mean over its own targets, summed over the rows. Additive over rows
    (each row alone), not over targets (a row's mean changes when some of its targets are taken away), and not
    the micro-batch's mean either: only the split of the targets can see it."""
    losses = F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    per_row = losses.view(labels.shape).sum(dim=1)
    return (per_row / (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)).sum()


def centred_over_rows(outputs, labels):
    """The token cross-entropy sum of logits centred by their mean over the micro-batch's rows. Additive over
    targets (the same logits whatever labels are hidden), not over rows (each half centres by its own mean):
    only the split of the rows can see it."""
    centred = outputs - outputs.mean(dim=0, keepdim=True)
    return F.cross_entropy(centred.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def probe_of(loss_sum_fn, batch: MicroBatch, on_inexact: str = "warn") -> list[str]:
    model = embedding_model()
    return probe_loss_and_model(model, model, loss_sum_fn, batch, CPU, on_inexact)


# 3 + 6 + 6 + 6 = 21 targets: the first half (10) ends inside the third row, so the split of the targets cuts a
# row's targets in two (a split at a row's end would be a split of rows too, which per_row_mean passes).
UNEVEN_ROWS = [3, 6, 6, 6]


def test_the_token_sum_passes_both_splits_silently():
    assert probe_of(token_cross_entropy_sum, token_rows(UNEVEN_ROWS)) == []


def test_a_loss_that_couples_the_targets_of_a_row_is_seen_by_the_split_of_the_targets_alone():
    batch = token_rows(UNEVEN_ROWS)
    model = embedding_model()
    with torch.no_grad():
        outputs = model(batch.inputs)
        halves = sum(per_row_mean(outputs[piece], batch.labels[piece]) for piece in (slice(0, 2), slice(2, 4)))
    assert abs(halves - per_row_mean(outputs, batch.labels)) <= 1e-6 * halves  # additive over rows: only targets
    [line] = probe_of(per_row_mean, batch)
    assert line.startswith("the loss couples the examples of a micro-batch"), line
    with pytest.raises(InexactStep, match=r"batch.on_inexact=error\): the loss couples the examples"):
        probe_of(per_row_mean, batch, on_inexact="error")


def test_a_loss_that_couples_rows_is_seen_by_the_split_of_the_rows_alone():
    batch = token_rows(UNEVEN_ROWS)
    model = embedding_model()
    with torch.no_grad():
        outputs = model(batch.inputs)
        first = batch.labels.clone()
        first.view(-1)[(batch.labels != IGNORE_INDEX).view(-1).nonzero()[10:, 0]] = IGNORE_INDEX
        second = torch.where(first == IGNORE_INDEX, batch.labels, IGNORE_INDEX)
        whole, halves = (
            centred_over_rows(outputs, batch.labels),
            sum(centred_over_rows(outputs, x) for x in (first, second)),
        )
    assert abs(halves - whole) <= 1e-6 * whole  # additive over targets: only the split of the rows sees it
    [line] = probe_of(centred_over_rows, batch)
    assert line.startswith("the loss couples the examples of a micro-batch"), line


def test_a_mean_over_the_micro_batch_is_refused_not_warned():
    def token_mean(outputs, labels):
        return F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    with pytest.raises(InexactStep, match=r"^step 0: the loss is a mean, not a sum over its targets"):
        probe_of(token_mean, token_rows(UNEVEN_ROWS))


def test_a_forward_or_a_loss_that_raises_is_named_and_the_model_left_in_train_mode():
    model = embedding_model()
    images = MicroBatch(torch.randn(2, 3, 4, 4), torch.zeros(2, dtype=torch.long), 2)
    with pytest.raises(StepZeroFailed, match=r"^step 0: the model's forward raised on the first micro-batch"):
        probe_loss_and_model(model, model, token_cross_entropy_sum, images, CPU, "warn")
    assert model.training

    def wrong_shape(outputs, labels):
        return F.cross_entropy(outputs, labels, reduction="sum")  # [rows, seq, V] against [rows, seq]: raises

    with pytest.raises(StepZeroFailed, match=r"^step 0: the loss raised on the model's outputs float32 \[4, 6, 11\]"):
        probe_of(wrong_shape, token_rows(UNEVEN_ROWS))
