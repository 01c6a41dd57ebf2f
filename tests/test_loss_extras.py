"""The loss sees the micro-batch: per-row tensors in MicroBatch.extras reach the loss as keywords, split exactly
like the rows, in the step, the pipeline, the probe and a tuple or dict of inputs.

The objective is a per-row weighted token mean, written from its definition as the reference:

    L = (1 / N) · Σ_rows w_row · Σ_{t supervised} ℓ_row,t,     N = supervised tokens of the whole step,

computed in float64 on one process from the concatenated rows, knowing nothing of m, A, D, the ×D or the extras.
Weights of either sign (advantages) and of very different sizes make a row split wrongly, or a weight applied to
the wrong row, visible far above the tolerance."""

import copy

import pytest
import torch
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.data.sources import micro_batch
from accumulation.parallel.mesh import build_layout
from accumulation.parallel.pipeline import build_pipeline, optimizer_order
from accumulation.probe import probe_loss_and_model
from accumulation.shrink_on_oom import split_micro_batches
from accumulation.step import StepSetup, optimizer_step
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient, max_relative_error
from tests.test_pipeline import new_model as new_pipeline_model
from tests.test_step import CPU, FLOAT64_RTOL, new_model, rows

# Supervised tokens per row of the step's 8 rows (a padding row last), and each row's weight.
ROW_COUNTS = [8, 1, 5, 8, 2, 7, 4, 0]
WEIGHTS = torch.tensor([1.5, -2.0, 0.25, 3.0, -0.5, 4.0, 1.0, -1.25], dtype=torch.float64)


def weighted_token_sum(outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fork's loss: Σ_rows weights_row · Σ_t ℓ_row,t over supervised targets (a SUM: the step divides by N)."""
    per_token = F.cross_entropy(
        outputs.flatten(0, 1).double(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    return (per_token * weights.to(per_token.dtype)[:, None]).sum()


def step_rows() -> MicroBatch:
    """The whole step as one micro-batch of 8 rows, its weights riding along as an extra."""
    inputs, labels = rows(ROW_COUNTS, seed=5)
    return MicroBatch(inputs, labels, sum(1 for c in ROW_COUNTS if c > 0), {"weights": WEIGHTS})


def reference_gradient(model: torch.nn.Module, batch: MicroBatch) -> list[torch.Tensor]:
    """∇L from the objective's definition, in float64, on all rows at once."""
    model = copy.deepcopy(model).double()
    logits = model(batch.inputs).double()
    supervised = batch.labels != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1)
    token_losses = -log_probs.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    objective = (token_losses * supervised * WEIGHTS[:, None]).sum() / supervised.sum()
    objective.backward()
    return [p.grad.clone() for p in model.parameters()]


def micro_batches_of_rank(batch: MicroBatch, micro_batch_size: int, replicas: int, replica: int) -> list[MicroBatch]:
    """Replica `replica`'s micro-batches of m rows: its contiguous share of the step's rows, rank-major."""
    per_replica = batch.labels.shape[0] // replicas
    own = batch.rows(slice(replica * per_replica, (replica + 1) * per_replica))
    return split_micro_batches([own], micro_batch_size)


@pytest.mark.parametrize("micro_batch_size", [8, 4, 2, 1])
def test_a_weighted_loss_with_weights_from_the_batch_equals_the_float64_objective(micro_batch_size):
    batch, model = step_rows(), new_model()
    micro_batches = micro_batches_of_rank(batch, micro_batch_size, replicas=1, replica=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    result = optimizer_step(StepSetup(model, CPU, loss_sum_fn=weighted_token_sum), micro_batches, optimizer)
    assert result.applied and result.tokens == sum(ROW_COUNTS)
    reference = reference_gradient(new_model(), batch)
    assert max_relative_error(captured[0], reference) < FLOAT64_RTOL
    # Weights dropped on the way (the plain token mean) are far off: the comparison can fail.
    assert max_relative_error(float64_reference_gradient(new_model(), micro_batches), reference) > 1e-2


def test_the_weights_follow_their_rows_when_an_extra_is_split():
    """split_micro_batches and MicroBatch.rows cut every extra at the rows' boundaries."""
    [first, second] = split_micro_batches([step_rows()], 4)
    assert torch.equal(first.extras["weights"], WEIGHTS[:4]) and torch.equal(second.extras["weights"], WEIGHTS[4:])
    assert (first.num_examples, second.num_examples) == (4, 3)


def two_rank_weighted_worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    batch = step_rows()
    results = {}
    for micro_batch_size in (4, 2, 1):  # A = 1, 2, 4 on each of D = 2 replicas
        model = new_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        mine = micro_batches_of_rank(batch, micro_batch_size, replicas=world_size, replica=rank)
        result = optimizer_step(StepSetup(ddp, CPU, loss_sum_fn=weighted_token_sum), mine, optimizer)
        error = max_relative_error(captured[0], reference_gradient(new_model(), batch))
        results[micro_batch_size] = (error, result.tokens, result.loss)
    # Pipeline stages (P = 2, D = 1): the schedule cuts the rows, the loss reads each micro-batch's own weights.
    layout = build_layout(CPU, pipeline_stages=2)
    results["pipeline"] = pipelined_gradient_error(new_pipeline_model(torch.float64), batch, layout, 4, "gpipe")
    # A dict of inputs through the stages: the schedule cuts each tensor of it along the rows.
    scale = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    dict_batch = MicroBatch({"tokens": batch.inputs, "scale": scale}, batch.labels, batch.num_examples, batch.extras)
    results["pipeline, dict inputs"] = pipelined_gradient_error(DictInputStages(), dict_batch, layout, 2, "1f1b")
    return results


def pipelined_gradient_error(model, batch: MicroBatch, layout, accumulation_steps: int, schedule_name: str) -> float:
    """This stage's gradient after one pipelined step of `batch` in A micro-batches, against the float64 objective's
    gradient of the same parameters."""
    reference = dict(zip([n for n, _ in model.named_parameters()], reference_gradient(model, batch), strict=True))
    pipeline = build_pipeline(model, layout, CPU, weighted_token_sum, accumulation_steps, schedule_name)
    optimizer = torch.optim.SGD(pipeline.stage_module.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    micro_batches = split_micro_batches([batch], batch.labels.shape[0] // accumulation_steps)
    optimizer_step(StepSetup(pipeline.stage_module, CPU, strategy=pipeline), micro_batches, optimizer)
    names = [name for group in optimizer_order(optimizer, pipeline.names) for name in group]
    return max_relative_error(captured[0], [reference[name] for name in names])


class FirstStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(256, 16, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # a dict's tensors as keywords
        return torch.tanh(self.embedding(tokens)) * scale[:, None, None]


class DictInputStages(torch.nn.Module):
    """A model reading a dict of inputs (token ids and a per-row scale), split into two pipeline stages."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.first = FirstStage()
        self.head = torch.nn.Linear(16, 256, dtype=torch.float64)

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.head(self.first(**inputs))

    def pipeline_split(self, stages: int) -> list[torch.nn.Module]:
        return [self.first, self.head]


def test_two_ranks_and_pipeline_stages_with_per_row_weights_equal_the_float64_objective():
    for results in run_on_ranks(two_rank_weighted_worker, 2):
        for micro_batch_size in (4, 2, 1):
            error, tokens, _ = results[micro_batch_size]
            assert error < FLOAT64_RTOL and tokens == sum(ROW_COUNTS)
        assert results["pipeline"] < FLOAT64_RTOL and results["pipeline, dict inputs"] < FLOAT64_RTOL


def test_the_probe_splits_the_extras_with_the_rows():
    """The step-0 probe evaluates the loss on halves of the rows: the weights must be halved with them, or a
    loss that is additive over rows would be reported as coupling the examples."""
    model = new_model()
    warnings = probe_loss_and_model(model, model, weighted_token_sum, step_rows(), CPU, on_inexact="warn")
    assert warnings == []


class TwoInputs(torch.nn.Module):
    """A model reading a dict of inputs: the token ids and a per-row scale of its logits."""

    def __init__(self):
        super().__init__()
        self.model = new_model()

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.model(inputs["tokens"]) * inputs["scale"][:, None, None]


def test_dict_inputs_and_extras_travel_together_through_the_step():
    batch = step_rows()
    scale = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    dict_batch = MicroBatch({"tokens": batch.inputs, "scale": scale}, batch.labels, batch.num_examples, batch.extras)
    model = TwoInputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    optimizer_step(
        StepSetup(model, CPU, loss_sum_fn=weighted_token_sum), split_micro_batches([dict_batch], 2), optimizer
    )
    # The reference: the same objective with the scale folded into a copy of the model's outputs.
    reference_model = TwoInputs()
    logits = reference_model({"tokens": batch.inputs, "scale": scale})
    supervised = batch.labels != IGNORE_INDEX
    token_losses = -torch.log_softmax(logits, -1).gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    ((token_losses * supervised * WEIGHTS[:, None]).sum() / supervised.sum()).backward()
    assert max_relative_error(captured[0], [p.grad for p in reference_model.parameters()]) < FLOAT64_RTOL


class WeightedRows:
    """A data source's rows whose examples carry a weight per row, the third item of examples()."""

    def examples(self, row_ids: torch.Tensor, step: int):
        batch = step_rows()
        return batch.inputs[row_ids], batch.labels[row_ids], {"weights": WEIGHTS[row_ids]}


def test_a_sources_per_row_tensors_become_the_micro_batchs_extras_padded_like_the_rows():
    built = micro_batch(WeightedRows(), torch.tensor([6, 2, 5]), micro_batch_size=4, step=0)
    assert torch.equal(built.extras["weights"], torch.cat([WEIGHTS[[6, 2, 5]], torch.zeros(1, dtype=WEIGHTS.dtype)]))
    assert built.num_examples == 3 and torch.equal(built.labels[3], torch.full_like(built.labels[3], IGNORE_INDEX))
