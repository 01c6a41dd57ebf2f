"""model.compile: the forward and the loss (plain or chunked) compile as one region, inside DDP.

training_forward_and_loss(compile=True) hands the step one module, ForwardAndLoss, that computes S itself;
wrap_for_training compiles it and DDP wraps the compiled module. Dynamo's own counters tell whether the
region traced without a graph break and whether any later micro-batch compiled again: a no_sync micro-batch
after a syncing one, the next step, the last, shorter chunk of the chunked loss. The fast test compiles with
Dynamo's "eager" backend (the same tracing, guards and graph breaks, no Inductor code generation: seconds,
not minutes); the test under the compile marker runs train.py's path with Inductor and checks the update."""

import os
import tempfile

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, count_supervised_tokens
from accumulation.config.config import load_config
from accumulation.models.factory import training_forward_and_loss
from accumulation.models.forward_and_loss import ForwardAndLoss
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.step import StepSetup, optimizer_step
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient, max_relative_error

CPU = torch.device("cpu")
MODEL = GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16, vocab_size=64)
# fp32 against the float64 reference: tests/test_chunked_loss.py's bound (d = 16 dot products, a few hundred
# terms summed in another order), which a wrong weighting of micro-batches or ranks exceeds by far.
FLOAT32_RTOL = 1e-5


def micro_batches_of(seed: int, count: int) -> list[MicroBatch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(count):
        inputs = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels[k % 2, 3 + k :] = IGNORE_INDEX  # uneven supervised counts across micro-batches
        batches.append(MicroBatch(inputs, labels, num_examples=2))
    return batches


def compiled_region_worker(rank: int, world_size: int, backend: str) -> dict:
    """Two steps of A = 3 micro-batches per rank (two no_sync, one syncing each), for each loss: the gradient of
    the first step, and Dynamo's counts after each step."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"accumulation-inductor-{os.getpid()}")
    every = micro_batches_of(seed=2, count=6)
    counts = GlobalCounts(sum(count_supervised_tokens(mb.labels) for mb in every), 12)
    mine = every[rank * 3 : rank * 3 + 3]
    results = {}
    for loss in ("plain", "chunked"):
        torch._dynamo.reset()
        counters.clear()
        model = GPT(MODEL, seed=3)
        config = load_config([f"model.loss={loss}", "model.compile=true"])
        module, loss_sum_fn = training_forward_and_loss(config.model, model, compile=True)
        if loss == "chunked":  # 5 positions per chunk: 16 positions in chunks of 5, 5, 5 and a last one of 1
            module.loss_sum_fn.chunk_positions = 5
        wrapped = DistributedDataParallel(torch.compile(module, backend=backend))  # as wrap_for_training does
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        frames = []  # Dynamo's frame counts after each step
        for _ in range(2):
            optimizer_step(StepSetup(wrapped, CPU, loss_sum_fn=loss_sum_fn), mine, optimizer, global_counts=counts)
            frames.append(dict(counters["frames"]))
        results[loss] = {
            "module_is_one_region": isinstance(module, ForwardAndLoss) and loss_sum_fn is None,
            "gradient": captured[0],
            "frames_per_step": frames,
            "graph_breaks": dict(counters["graph_break"]),
            "recompiles": dict(counters["recompiles"]),
        }
    return results


def check_one_region(results: list[dict]) -> None:
    reference = float64_reference_gradient(GPT(MODEL, seed=3), micro_batches_of(seed=2, count=6))
    for loss in ("plain", "chunked"):
        rank0 = results[0][loss]
        assert rank0["module_is_one_region"], loss
        assert rank0["graph_breaks"] == {}, (loss, rank0["graph_breaks"])
        assert rank0["recompiles"] == {}, (loss, rank0["recompiles"])
        first, second = rank0["frames_per_step"]
        # One frame traced, once: none again in the first step's other micro-batches (a no_sync one, then the
        # syncing one) nor in the second step's.
        assert first == second and first.get("ok") == 1, (loss, rank0["frames_per_step"])
        assert all(torch.equal(a, b) for a, b in zip(rank0["gradient"], results[1][loss]["gradient"], strict=True))
        assert max_relative_error(rank0["gradient"], reference) < FLOAT32_RTOL, loss


def test_the_forward_and_the_loss_trace_as_one_region_in_ddp_without_breaks_or_recompiles():
    check_one_region(run_on_ranks(compiled_region_worker, world_size=2, args=("eager",), timeout_s=300.0))


@pytest.mark.compile
def test_with_inductor_the_one_region_in_ddp_gives_the_reference_update_without_recompiles():
    """The same two steps compiled by Inductor, as train.py compiles them (minutes on a busy 2-core CPU)."""
    check_one_region(run_on_ranks(compiled_region_worker, world_size=2, args=("inductor",), timeout_s=1500.0))
