"""Numbers a user reads, each against an independently computed reference: the validation loss on 1 and 2
ranks and for micro-batch sizes that split the validation rows unevenly; the 2-rank step's loss, gradient
norm and counts against one float64 batch; bf16 against float64; clipping with a GradScaler on; and the
per-rank versus global counters.

The reference (testkit/reference.py) knows nothing of micro-batches or ranks: PyTorch's own mean
cross-entropy over every example at once.
"""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.config.config import load_config
from accumulation.counters import Counters
from accumulation.data.sources import VALIDATION_STEP, build_data
from accumulation.models.factory import build_model
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import build_training
from accumulation.run.validation import validation_loss
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient, full_batch_mean_loss, max_relative_error

CPU = torch.device("cpu")
SEQ_LEN = 8
MODEL = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=16, vocab_size=256)

# ---------------------------------------------------------------------------------------------------------
# Validation loss
# ---------------------------------------------------------------------------------------------------------


def validation_corpus(folder: Path) -> Path:
    """Documents of many lengths; with data.val_fraction = 0.5 about half of them, several rows each, are
    validation documents, so every rank holds real validation rows."""
    folder.mkdir()
    generator = torch.Generator().manual_seed(1)
    for index, length in enumerate([5, 20, 33, 47, 61, 90, 130, 170, 41, 77, 12, 150, 64, 25]):
        text = bytes(torch.randint(97, 123, (length,), generator=generator).tolist())
        (folder / f"doc{index:02d}.txt").write_bytes(text)
    return folder


def validation_settings(corpus: Path, micro_batch_size: int) -> list[str]:
    return [
        f"data.source={corpus}",
        "data.seq_len=16",
        "data.val_fraction=0.5",
        "model.n_layer=1",
        "model.n_head=2",
        "model.d_model=16",
        "model.dropout=0.0",
        "batch.global_batch_size=30",
        f"batch.micro_batch_size={micro_batch_size}",
    ]


def validation_worker(
    rank: int, world_size: int, corpus: Path, micro_batch_sizes: list[int], settings=validation_settings
) -> list[float]:
    losses = []
    for micro_batch_size in micro_batch_sizes:
        config = load_config(settings(corpus, micro_batch_size))
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        context = DistributedContext(rank, rank, world_size, CPU, "gloo" if world_size > 1 else None)
        training = build_training(config, data.vocab_size, None, context)
        losses.append(validation_loss(training, data, config, context, config.batch.micro_batch_size))
    return losses


def test_validation_loss_on_1_and_2_ranks_and_any_micro_batch_size(tmp_path):
    corpus = validation_corpus(tmp_path / "corpus")
    config = load_config(validation_settings(corpus, 1))
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    rows = data.val.num_rows
    # Several rows on each rank, and micro-batch sizes that leave a short last micro-batch (rows % m > 0)
    # and an odd number of micro-batches, so that the ranks hold different numbers of real ones and one
    # rank runs an all-padding micro-batch (16 rows: m = 5 gives 4 micro-batches, m = 6 gives 3).
    micro_batch_sizes = [1, 5, 6]
    assert rows >= 8 and all(rows % m for m in micro_batch_sizes[1:]), rows
    assert any(math.ceil(rows / m) % 2 for m in micro_batch_sizes), rows
    torch.manual_seed(0)
    model = (
        build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).double().eval()
    )
    inputs, labels = data.val.examples(torch.arange(rows))
    with torch.no_grad():
        reference = full_batch_mean_loss(model(inputs), labels).item()

    [one_rank] = run_on_ranks(validation_worker, 1, (corpus, micro_batch_sizes), timeout_s=120)
    two_ranks = run_on_ranks(validation_worker, 2, (corpus, micro_batch_sizes), timeout_s=120)
    # fp32 forward against float64: each logit carries a relative rounding of about 1e-7, and the mean over
    # hundreds of tokens averages it further; a lost row or rank moves the loss by 1e-2 or more.
    for losses in (one_rank, *two_ranks):
        assert losses == pytest.approx([reference] * len(micro_batch_sizes), rel=1e-6)


def masked_validation_settings(tokens: Path, micro_batch_size: int) -> list[str]:
    """The masked LM (fresh masks at every step) on a nanoGPT folder; 64 validation rows of 16 tokens."""
    return [
        f"data.source={tokens}",
        "data.task=masked",
        "data.seq_len=16",
        "data.val_fraction=0.1",
        "model.name=encoder",
        "model.n_layer=1",
        "model.n_head=2",
        "model.d_model=16",
        "model.dropout=0.0",
        "batch.global_batch_size=64",
        f"batch.micro_batch_size={micro_batch_size}",
    ]


def test_masked_validation_loss_is_the_same_for_any_micro_batch_size_and_rank_count(tmp_path):
    """Rows that change with the step (the masked LM's masks) are validated as one fixed step sees them
    (data.VALIDATION_STEP), whichever micro-batch and rank holds them: the loss equals one float64 batch of
    every validation row at that step. Reading micro-batch k at step k (a bug that passed the suite, whose
    only validation test used text rows, which never change) makes the loss depend on m and D."""
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "train.bin").write_bytes((np.arange(4_000) * 7 % 64).astype("<u2").tobytes())
    (tokens / "val.bin").write_bytes((np.arange(64 * 16 + 1) * 5 % 64).astype("<u2").tobytes())
    (tokens / "meta.json").write_text('{"vocab_size": 64}')
    config = load_config(masked_validation_settings(tokens, 1))
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    rows = data.val.num_rows
    micro_batch_sizes = [5, 64]  # 13 micro-batches, the last short; and one
    assert rows == 64
    torch.manual_seed(0)
    model = (
        build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).double().eval()
    )
    inputs, labels = data.val.examples(torch.arange(rows), VALIDATION_STEP)
    with torch.no_grad():
        reference = full_batch_mean_loss(model(inputs), labels).item()
    arguments = (tokens, micro_batch_sizes, masked_validation_settings)
    [one_rank] = run_on_ranks(validation_worker, 1, arguments, timeout_s=120)
    two_ranks = run_on_ranks(validation_worker, 2, arguments, timeout_s=120)
    # fp32 against float64, as above: rounding moves the mean by about 1e-7; other masks move it by 1e-2.
    for losses in (one_rank, *two_ranks):
        assert losses == pytest.approx([reference] * len(micro_batch_sizes), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# One step against the float64 full batch
# ---------------------------------------------------------------------------------------------------------


def micro_batches(counts_per_micro_batch: list[list[int]], seed: int) -> list[MicroBatch]:
    """Random rows; row i of a micro-batch supervises its first counts[i] positions (0: a padding row)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for counts in counts_per_micro_batch:
        inputs = torch.randint(0, 256, (len(counts), SEQ_LEN), generator=generator)
        labels = torch.randint(0, 256, (len(counts), SEQ_LEN), generator=generator)
        for row, count in enumerate(counts):
            labels[row, count:] = IGNORE_INDEX
        batches.append(MicroBatch(inputs, labels, num_examples=sum(1 for count in counts if count > 0)))
    return batches


# Very uneven: rank 0 holds 8 real rows and 55 tokens, rank 1 holds 2 real rows and 3 tokens.
PER_RANK = {0: [[8, 8], [7, 6], [8, 5], [8, 5]], 1: [[1, 0], [0, 0], [2, 0], [0, 0]]}


def rank_batches(rank: int) -> list[MicroBatch]:
    return micro_batches(PER_RANK[rank], seed=10 + rank)


def two_rank_step_worker(rank: int, world_size: int) -> dict:
    model = DistributedDataParallel(GPT(MODEL, seed=7).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handed = capture_gradients(optimizer)
    result = optimizer_step(StepSetup(model, CPU), rank_batches(rank), optimizer)
    counters = Counters()
    counters.add(result)
    return {"result": result, "gradient": handed[0], "counters": counters}


def test_two_rank_step_result_equals_the_float64_full_batch():
    """Loss, gradient norm, tokens and examples of a 2-rank step with very uneven ranks, each rank's copy
    against the float64 reference (not only against the other rank's)."""
    per_rank = run_on_ranks(two_rank_step_worker, 2, timeout_s=120)
    everything = rank_batches(0) + rank_batches(1)
    model = GPT(MODEL, seed=7).double()
    reference_gradient = float64_reference_gradient(model, everything)
    inputs, labels = torch.cat([mb.inputs for mb in everything]), torch.cat([mb.labels for mb in everything])
    reference_loss = full_batch_mean_loss(model(inputs), labels).item()
    reference_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in reference_gradient])).item()
    tokens = int((labels != IGNORE_INDEX).sum())
    for rank, outcome in enumerate(per_rank):
        result = outcome["result"]
        # float64 on both sides, the same terms summed in another order: a few ulps (see tests/test_step.py)
        assert result.loss == pytest.approx(reference_loss, rel=1e-12), rank
        assert result.grad_norm == pytest.approx(reference_norm, rel=1e-10), rank
        assert max_relative_error(outcome["gradient"], reference_gradient) < 1e-10, rank
        assert (result.tokens, result.examples) == (tokens, 10) == (58, 10)
        # Counters: examples and tokens are global (all ranks), micro-batches per rank (A = 4 here).
        counters = outcome["counters"]
        assert (counters.examples, counters.tokens, counters.micro_batches, counters.steps) == (10, 58, 4, 1)


def test_bf16_step_against_the_float64_full_batch():
    """bf16 autocast against float64, not against the same code in fp32 (where a weighting bug would sit on
    both sides). bf16 keeps 8 significant bits: 2^-9 ≈ 2e-3 relative per rounding, and a few dozen
    roundings through this one-layer model add up to about 1e-2 of the largest gradient entry; measured:
    8e-3. The tolerance 5e-2 is still far below what a wrong weighting of this uneven batch costs,
    which the last assertion measures."""
    batches = micro_batches([[8, 1], [2, 7], [1, 1], [8, 8]], seed=3)
    model = GPT(MODEL, seed=7)
    reference = float64_reference_gradient(model, batches)
    inputs, labels = torch.cat([mb.inputs for mb in batches]), torch.cat([mb.labels for mb in batches])
    reference_loss = full_batch_mean_loss(copy.deepcopy(model).double()(inputs), labels).item()

    def handed_gradient(**options):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        handed = capture_gradients(optimizer)
        return optimizer_step(StepSetup(trained, CPU, **options), batches, optimizer), handed[0]

    result, gradient = handed_gradient(autocast_dtype=torch.bfloat16)
    assert max_relative_error(gradient, reference) < 5e-2
    assert result.loss == pytest.approx(reference_loss, rel=1e-3)  # a mean over 36 targets: measured 7e-6

    def mean_of_means(outputs, labels):  # the classic bug: each micro-batch's mean, weighted equally
        targets = max(int((labels != IGNORE_INDEX).sum()), 1)
        return token_cross_entropy_sum(outputs, labels) / targets * 36 / 4  # the step divides by N = 36, A = 4

    _, wrong = handed_gradient(loss_sum_fn=mean_of_means)
    assert max_relative_error(wrong, reference) > 4 * 5e-2  # measured: 1.4


def test_clipping_with_a_grad_scaler_on_equals_the_clipped_float64_gradient():
    """With a GradScaler the gradients are scaled by 2^16 until unscale_; clipping must see the unscaled
    gradient. Reference: the float64 gradient scaled by min(1, clip / its norm)."""
    batches = micro_batches([[8, 3], [5, 5], [2, 1]], seed=4)
    model = GPT(MODEL, seed=7)
    reference = float64_reference_gradient(model, batches)
    reference_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in reference])).item()
    grad_clip = reference_norm / 4  # clipping is active: the update is a quarter of the plain one
    clipped_reference = [g * (grad_clip / reference_norm) for g in reference]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handed = capture_gradients(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    result = optimizer_step(StepSetup(model, CPU, scaler=scaler, grad_clip=grad_clip), batches, optimizer)
    assert result.applied and scaler.get_scale() == 2.0**16
    # fp32 against float64: a few hundred terms per entry, each with relative rounding 6e-8
    assert result.grad_norm == pytest.approx(reference_norm, rel=1e-5)
    assert max_relative_error(handed[0], clipped_reference) < 1e-5
