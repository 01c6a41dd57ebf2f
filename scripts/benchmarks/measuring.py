"""What every measurement of scripts/benchmarks/bench.py uses: the default config, the micro-batches of a step
as train.py builds them and the step's counts, a clock that waits for the GPU, FLOPs per token and the device's
peak, and a description of the machine."""

import contextlib
import os
import time
from pathlib import Path

import torch

from accumulation.batching import GlobalCounts, MicroBatch, count_supervised_tokens
from accumulation.config.config import Config
from accumulation.data.rows import RowSet
from accumulation.data.sources import step_batch
from accumulation.models.gpt import GPT

DEFAULTS = Config()  # the built-in defaults, which configs/default.toml repeats

# Peak dense TFLOPS from NVIDIA's data sheets (the sheets' larger tensor-core figures assume 2:4 sparsity),
# looked up by the first name that occurs in torch.cuda.get_device_name(); more specific names first.
# "tf32" is the peak of fp32 matrix products with precision.tf32 on, "fp32" without it.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM; the NVL variant is lower
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def step_micro_batches(
    rows: RowSet, step: int, micro_batch_size: int, accumulation_steps: int, world_size: int, rank: int
) -> list[MicroBatch]:
    """Rank `rank`'s A micro-batches of optimizer step `step`, exactly as train.py builds them."""
    batch = step_batch(
        rows,
        step,
        seed=DEFAULTS.run.seed,
        global_batch_size=micro_batch_size * accumulation_steps * world_size,
        tail=DEFAULTS.batch.tail,
        micro_batch_size=micro_batch_size,
        world_size=world_size,
        rank=rank,
    )
    return batch.micro_batches


def global_counts_of(micro_batches_by_rank: list[list[MicroBatch]]) -> GlobalCounts:
    """N and the examples of one step over all ranks, counted on the host from every rank's micro-batches,
    which every rank here holds (as train.py counts them from the step's row ids, which every rank knows)."""
    every = [micro_batch for micro_batches in micro_batches_by_rank for micro_batch in micro_batches]
    return GlobalCounts(
        tokens=sum(count_supervised_tokens(mb.labels) for mb in every), examples=sum(mb.num_examples for mb in every)
    )


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a clock read after it includes that work (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device: torch.device) -> tuple[object, float]:
    """What run() returns, and the seconds it took to finish, queued GPU work included."""
    synchronize(device)
    start = time.perf_counter()
    value = run()
    synchronize(device)
    return value, time.perf_counter() - start


def flops_per_token(model: torch.nn.Module) -> int:
    """Training FLOPs per token: 6 per parameter that multiplies (forward 2, backward 4), plus attention.

    Embedding tables are looked up, not multiplied, so their parameters are left out. For the GPT, attention
    adds 12 · n_layer · d_model · seq_len per token (the scores Q·Kᵀ and the weighted sum of V, 2 FLOPs per
    multiply-add, times 3 for forward and backward), counting the full seq_len x seq_len square as the usual
    convention does (PaLM, Chowdhery et al. 2022, appendix B), though causal kernels skip half. Any other model
    (the GRU) counts its parameters only.
    """
    parameters = sum(p.numel() for p in model.parameters())
    embedding_parameters = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    flops = 6 * (parameters - embedding_parameters)
    if isinstance(model, GPT):
        config = model.config
        flops += 12 * config.n_layer * config.d_model * config.seq_len
    return flops


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision` ("bf16", "fp16", "tf32" or "fp32") from PEAK_TFLOPS, None when
    the name is not in the table."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks[precision]
    return None


def pinned(batches_of_steps: list[list[MicroBatch]], device: torch.device) -> list[list[MicroBatch]]:
    """On CUDA the micro-batches in page-locked memory, as train.py pins them, so copies run asynchronously."""
    if device.type != "cuda":
        return batches_of_steps
    return [[micro_batch.pinned() for micro_batch in step] for step in batches_of_steps]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_description(device: torch.device, threads: int) -> str:
    accelerator = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    cores = f"{os.cpu_count()} logical cores"
    return f"{cpu_model()} ({cores}){accelerator}; torch {torch.__version__}; {threads} intra-op threads"
