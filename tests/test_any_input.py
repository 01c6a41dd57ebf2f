"""Rows whose inputs are not token ids: several tensors per example (float features and int64 ids here), any
dtype and shape, through step_batch, the micro-batches' padding, splitting and the step, against the float64
full-batch reference built from the raw examples alone (the checker's reference_rows)."""

import copy

import torch
import torch.nn as nn

from accumulation.batching import IGNORE_INDEX
from accumulation.checker.reference import reference_rows
from accumulation.data.rows import RawExample
from accumulation.data.sources import step_batch
from accumulation.shrink_on_oom import split_micro_batches
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.reference import capture_gradients

FEATURES, IDS, CLASSES = 6, 3, 4


class PairRows:
    """Each example is (a float feature vector [FEATURES], int64 ids [IDS]) and one class; row 2k + 1 has none."""

    seq_len = None

    def __init__(self, num_rows: int):
        generator = torch.Generator().manual_seed(5)
        self.features = torch.randn(num_rows, FEATURES, generator=generator)
        self.ids = torch.randint(0, 10, (num_rows, IDS), generator=generator)
        classes = torch.randint(0, CLASSES, (num_rows,), generator=generator)
        self.labels = torch.where(torch.arange(num_rows) % 2 == 1, IGNORE_INDEX, classes)

    @property
    def num_rows(self) -> int:
        return len(self.labels)

    def examples(self, row_ids, step):
        return (self.features[row_ids], self.ids[row_ids]), self.labels[row_ids]

    def supervised_counts(self, row_ids, step):
        return (self.labels[row_ids] != IGNORE_INDEX).long()

    def raw_example(self, row_id, step):
        label = int(self.labels[row_id])
        return RawExample(inputs=(self.features[row_id], self.ids[row_id]), label=label)


class PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.linear = nn.Embedding(10, FEATURES), nn.Linear(FEATURES, CLASSES)

    def forward(self, inputs):
        features, ids = inputs
        return self.linear(features + self.embedding(ids).mean(dim=1))


def test_tuple_inputs_are_padded_split_and_stepped_exactly():
    rows = PairRows(10)
    batch = step_batch(rows, 0, seed=1, global_batch_size=12, tail="partial", micro_batch_size=4, world_size=1, rank=0)
    features, ids = batch.micro_batches[-1].inputs  # the last of 3 holds 2 real rows and 2 padding rows
    assert features.dtype == torch.float32 and ids.dtype == torch.int64
    assert features.shape == (4, FEATURES) and ids.shape == (4, IDS) and batch.micro_batches[-1].num_examples == 2
    assert not features[2:].any() and not ids[2:].any() and (batch.micro_batches[-1].labels[2:] == -100).all()
    pieces = split_micro_batches(batch.micro_batches, 2)  # what batch.on_oom = "shrink" does
    assert [piece.num_examples for piece in pieces] == [2, 2, 2, 2, 2, 0]
    assert torch.equal(pieces[4].inputs[1], ids[:2])

    model = PairModel()
    reference = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    result = optimizer_step(StepSetup(model, torch.device("cpu")), batch.micro_batches, optimizer)
    (features, ids), labels = reference_rows(rows, batch.row_ids, 0, seq_len=None)
    mean_loss = token_cross_entropy_sum(reference((features.double(), ids)), labels) / (labels != -100).sum()
    mean_loss.backward()
    # float32 against float64 over a few dozen products: ~1e-7 relative; 1e-5 is far below a wrong weighting.
    for loop, full in zip(captured[0], [p.grad for p in reference.parameters()], strict=True):
        assert torch.allclose(loop.double(), full, rtol=1e-5, atol=1e-7)
    assert abs(result.loss - mean_loss.item()) < 1e-5 * abs(mean_loss.item())
