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
from accumulation.run.mfu import peak_tflops as peak_tflops  # the same peaks as MFU in the step records

DEFAULTS = Config()  # the built-in defaults, which configs/default.toml repeats


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
    """Training FLOPs per token: the model's own declaration where it has one (the GPT's, which MFU in train.py's
    step records uses too), else 6 per parameter that multiplies (forward 2, backward 4; embedding tables are
    looked up, not multiplied): the GRU counts its parameters only."""
    if hasattr(model, "flops_per_token"):
        return model.flops_per_token()
    parameters = sum(p.numel() for p in model.parameters())
    embedding_parameters = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return 6 * (parameters - embedding_parameters)


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
