"""Benchmark: does the bookkeeping of `optimizer_step` cost anything?

    python scripts/benchmarks/bench.py            # a readable table, about 2 minutes on a quiet 2-core CPU
    python scripts/benchmarks/bench.py --json     # one JSON object instead
    python scripts/benchmarks/bench.py --quick    # fewer repetitions: every measurement once, quickly
    python scripts/benchmarks/bench.py --config configs/gpu_8x.toml [key=value ...]  # MFU, syncs, memory of any config

A reference loop is only worth forking if its bookkeeping costs nothing. Everything here uses the project's
default model (configs/default.toml) on real micro-batches of the embedded corpus, m = 4 rows of 128 tokens,
and A = 8 micro-batches per step on one rank:

    overhead_ratio                   seconds per step of optimizer_step / of a bare loop        target <= 1.02
    grad_bytes                       bytes of all parameter gradients
    grad_allreduce_bytes_per_update  gradient bytes all-reduced per step on 2 gloo ranks       target = grad_bytes
    sync_every_bytes_per_update      the same with no_sync bypassed, for contrast              (A x grad_bytes)
    scalar_collectives_per_update    every other collective of a step (the loss at the boundary) target <= 1
    host_syncs_per_micro_batch       reads of tensor values into Python during micro-batches   target 0
    host_syncs_per_update            the same over the whole step, reported
    peak_mem_bytes                   peak of one update: m with A = 1, 2, 8, and 8m with A = 1  target m_A8 <= 1.05 m_A1
    tokens_per_s                     supervised tokens per second, 1 process and 2 gloo ranks, same global batch
    cuda_syncs_per_update            CUDA only: synchronising calls of one bf16 step, counted by
                                     torch.cuda.set_sync_debug_mode                             target <= 1
    mfu                              CUDA only: model FLOPs utilisation

With --config FILE the benchmark measures that config's model instead (its m, seq_len and precision, A = 2
on one process): seconds per step, positions per second, FLOPs per token, MFU against the device's peak
(PEAK_TFLOPS below, or --peak-tflops), CUDA syncs per update and peak memory.

The counts come from 2 gloo ranks on the CPU whatever the hardware: they are properties of the code. The
timings and the memory peaks run on the GPU when there is one, else on the CPU. Threads: the single process
uses --threads (default: torch's default, every core, as `python train.py` runs); each gloo rank uses one
(testkit/ranks.py), so on a 2-core CPU both tokens_per_s runs use the same two cores. The functions that
measure are plain and importable; tests/test_performance.py asserts the invariants with the same functions.
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.build import autocast_dtype_for, build_optimizer, set_tf32
from accumulation.config import Config, ConfigError, load_config, resolved_compile, resolved_grad_scaler
from accumulation.counters import Counters
from accumulation.data import BYTE_VOCAB_SIZE, RowSet, build_data, step_batch
from accumulation.model import GPT, GPTConfig
from accumulation.models import (
    build_model,
    gpt_config,
    loss_sum_fn_for,
    resolved_vocab_size,
    training_forward_and_loss,
    uses_chunked_loss,
)
from accumulation.schedule import build_scheduler
from accumulation.step import GlobalCounts, StepResult, count_supervised_tokens, optimizer_step
from testkit.memory import peak_memory_bytes_of
from testkit.ranks import run_on_ranks
from testkit.syncs import cuda_syncs_of

DEFAULTS = Config()  # the built-in defaults, which configs/default.toml repeats
ACCUMULATION_STEPS = 8  # A on one rank, for every measurement
RANKS = 2  # D of the two-rank measurements (gloo on this CPU)

TARGET_OVERHEAD_RATIO = 1.02
TARGET_SCALAR_COLLECTIVES = 1  # the loss sum (and the stop and OOM flags) at the boundary; N needs none
TARGET_CUDA_SYNCS = 1  # the read-back of (loss sum, flags, gradient norm) at the boundary
TARGET_MEMORY_RATIO = 1.05  # m_A8 / m_A1
MIN_8M_OVER_M_A8 = 4  # "far below 8m_A1": 8m rows in one micro-batch hold about 8 times the activations

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

# Everything that reads a tensor's value into Python. On a GPU each one waits for the device to catch up.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
# The collectives of torch.distributed that a training step could call directly.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)


# ---------------------------------------------------------------------------------------------------
# The model, the data and the two loops being compared
# ---------------------------------------------------------------------------------------------------


def default_model_config() -> GPTConfig:
    return gpt_config(DEFAULTS, BYTE_VOCAB_SIZE)


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


@dataclass
class LoopState:
    """What train.py keeps across optimizer steps besides the model."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    counters: Counters


def default_loop_state(model: torch.nn.Module, device: torch.device) -> LoopState:
    """The default config's optimizer (train.py's own), learning-rate schedule and gradient scaler, and fresh
    counters."""
    optimizer = build_optimizer(DEFAULTS, model, device)
    schedule = DEFAULTS.schedule
    scheduler = build_scheduler(
        optimizer, schedule.name, schedule.warmup_updates, DEFAULTS.run.max_steps, schedule.min_lr_ratio
    )
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(DEFAULTS))
    return LoopState(optimizer, scheduler, scaler, Counters())


def global_counts_of(micro_batches_by_rank: list[list[MicroBatch]]) -> GlobalCounts:
    """N and the examples of one step over all ranks, counted on the host from every rank's micro-batches,
    which every rank here holds (as train.py counts them from the step's row ids, which every rank knows)."""
    every = [micro_batch for micro_batches in micro_batches_by_rank for micro_batch in micro_batches]
    return GlobalCounts(
        tokens=sum(count_supervised_tokens(mb.labels) for mb in every), examples=sum(mb.num_examples for mb in every)
    )


def run_step(model, micro_batches, loop: LoopState, device, autocast_dtype=None, global_counts=None) -> StepResult:
    """One step of the project's loop as train.py runs it: `optimizer_step` with the default loss, gradient
    clipping and the step's counts given (one process: counted here when not given), then the scheduler (once
    per applied update) and the counters."""
    result = optimizer_step(
        model,
        micro_batches,
        loop.optimizer,
        device=device,
        scaler=loop.scaler,
        loss_sum_fn=loss_sum_fn_for(DEFAULTS),
        grad_clip=DEFAULTS.optim.grad_clip,
        autocast_dtype=autocast_dtype,
        global_counts=global_counts if global_counts is not None else global_counts_of([micro_batches]),
    )
    if result.applied:
        loop.scheduler.step()
    loop.counters.add(result)
    return result


def bare_step(model, micro_batches, optimizer, device, autocast_dtype=None) -> None:
    """The baseline: the same forwards, backwards, clipping and optimizer update, and nothing else.

    No token count, no collective, no logged loss, no scaler, no scheduler, no counters. A mean loss per
    micro-batch divided by A is the wrong weighting when token counts differ, but only time is compared.
    """
    for micro_batch in micro_batches:  # the same pinned, asynchronous copies as optimizer_step on CUDA
        inputs = micro_batch.inputs.to(device, non_blocking=True)
        labels = micro_batch.labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        (loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), DEFAULTS.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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


# ---------------------------------------------------------------------------------------------------
# Time: overhead ratio and throughput
# ---------------------------------------------------------------------------------------------------


def overhead(model_config, batches_of_steps, device, autocast_dtype, warmup_pairs: int, timed_pairs: int) -> dict:
    """Seconds per step of optimizer_step and of the bare loop, measured in alternating pairs.

    Each loop trains its own copy of the same model on the same micro-batches. A pair runs one step of each,
    back to back, and which one goes first alternates, so a slow moment of the machine (other processes,
    frequency changes) lands on both alike. The ratio is the median of the per-pair ratios.
    """
    ours_model = GPT(model_config, seed=DEFAULTS.run.seed).to(device)
    bare_model = GPT(model_config, seed=DEFAULTS.run.seed).to(device)
    ours_loop = default_loop_state(ours_model, device)
    bare_optimizer = build_optimizer(DEFAULTS, bare_model, device)
    ours_seconds, bare_seconds = [], []
    counts_of_steps = [global_counts_of([micro_batches]) for micro_batches in batches_of_steps]  # train.py: from ids
    for pair in range(warmup_pairs + timed_pairs):
        micro_batches = batches_of_steps[pair % len(batches_of_steps)]
        counts = counts_of_steps[pair % len(batches_of_steps)]
        run_ours = functools.partial(run_step, ours_model, micro_batches, ours_loop, device, autocast_dtype, counts)
        run_bare = functools.partial(bare_step, bare_model, micro_batches, bare_optimizer, device, autocast_dtype)
        if pair % 2 == 0:
            (_, bare), (_, ours) = timed(run_bare, device), timed(run_ours, device)
        else:
            (_, ours), (_, bare) = timed(run_ours, device), timed(run_bare, device)
        if pair >= warmup_pairs:
            ours_seconds.append(ours)
            bare_seconds.append(bare)
    ratios = [ours / bare for ours, bare in zip(ours_seconds, bare_seconds, strict=True)]
    lower_quartile, median_ratio, upper_quartile = statistics.quantiles(ratios, n=4)
    return {
        "overhead_ratio": median_ratio,
        "overhead_ratio_quartiles": [lower_quartile, upper_quartile],  # how much the pairs scatter
        "seconds_per_step": {
            "optimizer_step": statistics.median(ours_seconds),
            "bare": statistics.median(bare_seconds),
        },
    }


def tokens_per_second(
    model, batches_of_steps, device, autocast_dtype, warmup_steps: int, counts_of_steps=None
) -> float:
    """Median, over the steps after the warm-up, of the step's supervised tokens (all ranks) per second.
    `counts_of_steps`: each step's GlobalCounts over all ranks (one process: counted from its micro-batches)."""
    loop = default_loop_state(model, device)
    counts_of_steps = counts_of_steps or [global_counts_of([micro_batches]) for micro_batches in batches_of_steps]
    rates = []
    for index, micro_batches in enumerate(batches_of_steps):
        counts = counts_of_steps[index]
        run = functools.partial(run_step, model, micro_batches, loop, device, autocast_dtype, counts)
        result, seconds = timed(run, device)
        if index >= warmup_steps:
            rates.append(result.tokens / seconds)
    return statistics.median(rates)


def throughput_worker(rank, world_size, model_config, batches_of_steps_by_rank, warmup_steps) -> float:
    """tokens_per_second on one of the gloo ranks (run_on_ranks gives each rank one thread)."""
    model = DistributedDataParallel(GPT(model_config, seed=DEFAULTS.run.seed))
    counts = [global_counts_of(list(step)) for step in zip(*batches_of_steps_by_rank, strict=True)]
    return tokens_per_second(model, batches_of_steps_by_rank[rank], torch.device("cpu"), None, warmup_steps, counts)


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


# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------


def peak_update_memory_bytes(model, micro_batches, device, autocast_dtype=None) -> int:
    """Peak bytes allocated during one optimizer_step, above what was already live when it began.

    Live before it: the parameters and the optimizer state, which one warm-up update creates first. Gradients
    are not: the step sets them to None at its end. CUDA reads the allocator's peak; the CPU has no such
    counter, so a profiler records every allocation and free of the step.
    """
    loop = default_loop_state(model, device)
    run_step(model, micro_batches, loop, device, autocast_dtype)  # creates the optimizer state
    _, peak_bytes = peak_memory_bytes_of(lambda: run_step(model, micro_batches, loop, device, autocast_dtype), device)
    return peak_bytes


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameter gradients: one per parameter, of the parameter's dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------
# Counting what a step sends between ranks and reads back to Python (on gloo ranks)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What one rank's optimizer step all-reduced, called and read back, counted while `phase` is set."""

    phase: str | None = None  # None (not counting), "count", "micro-batches" or "boundary"
    in_gradient_hook: bool = False  # DDP's bucket all-reduce is running: its collective is not a scalar one
    grad_allreduce_bytes: int = 0
    scalar_collectives: int = 0
    host_reads: list = field(default_factory=list)  # (phase, call) for every read of a tensor value into Python


def counting_allreduce_hook(traffic: Traffic, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce of one gradient bucket, its bytes counted."""
    traffic.grad_allreduce_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    traffic.in_gradient_hook = True
    try:
        return default_hooks.allreduce_hook(None, bucket)
    finally:
        traffic.in_gradient_hook = False


@contextlib.contextmanager
def counting_calls(traffic: Traffic):
    """While inside, count every torch.distributed collective and every read of a tensor value into Python
    that happens while traffic.phase is set."""

    def counted_collective(collective):
        @functools.wraps(collective)
        def wrapper(*args, **kwargs):
            if traffic.phase is not None and not traffic.in_gradient_hook:
                traffic.scalar_collectives += 1
            return collective(*args, **kwargs)

        return wrapper

    def counted_read(name, read):
        @functools.wraps(read)
        def wrapper(self, *args, **kwargs):
            if traffic.phase is not None:
                traffic.host_reads.append((traffic.phase, name))
            return read(self, *args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as patches:
        for name in COLLECTIVES:
            patches.enter_context(mock.patch.object(dist, name, counted_collective(getattr(dist, name))))
        for name in HOST_READS:
            patches.enter_context(
                mock.patch.object(torch.Tensor, name, counted_read(name, getattr(torch.Tensor, name)))
            )
        yield


def traffic_worker(rank, world_size, build_model, batches_of_steps_by_rank, bypass_no_sync) -> dict:
    """On each gloo rank: DDP around build_model(), then one optimizer_step per list of micro-batches, each
    step's traffic counted. The phases of a step, as seen from outside it: "count" (the token count, before
    the first forward), "micro-batches" (from the first forward until the step unscales its gradients) and
    "boundary" (unscale, clip, update)."""
    if bypass_no_sync:
        # The mistake, for contrast: every micro-batch synchronises. This spawned process ends with the run.
        DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    model = DistributedDataParallel(build_model())
    traffic = Traffic()
    model.register_comm_hook(traffic, counting_allreduce_hook)
    model.register_forward_pre_hook(lambda module, args: setattr(traffic, "phase", "micro-batches"))
    loop = default_loop_state(model, torch.device("cpu"))
    unscale = loop.scaler.unscale_

    def unscale_at_the_boundary(optimizer):
        traffic.phase = "boundary"
        unscale(optimizer)

    loop.scaler.unscale_ = unscale_at_the_boundary
    steps = []
    # Every rank holds every rank's micro-batches here, so each counts the step's N on the host, like train.py.
    counts_of_steps = [global_counts_of(list(step)) for step in zip(*batches_of_steps_by_rank, strict=True)]
    with counting_calls(traffic):
        for micro_batches, counts in zip(batches_of_steps_by_rank[rank], counts_of_steps, strict=True):
            traffic.grad_allreduce_bytes, traffic.scalar_collectives, traffic.host_reads = 0, 0, []
            traffic.phase = "count"
            run_step(model, micro_batches, loop, torch.device("cpu"), global_counts=counts)
            traffic.phase = None
            steps.append(
                {
                    "micro_batches": len(micro_batches),
                    "grad_allreduce_bytes": traffic.grad_allreduce_bytes,
                    "scalar_collectives": traffic.scalar_collectives,
                    "host_reads_in_micro_batches": sum(phase == "micro-batches" for phase, _ in traffic.host_reads),
                    "host_reads_by_call": dict(Counter(call for _, call in traffic.host_reads)),
                }
            )
    return {"grad_bytes": gradient_bytes(model), "steps": steps}


def step_traffic(
    build_model, batches_of_steps_by_rank, bypass_no_sync: bool = False, timeout_s: float = 120.0
) -> list[dict]:
    """traffic_worker on as many gloo ranks as there are lists of steps; the per-rank results in rank order."""
    return run_on_ranks(
        traffic_worker,
        len(batches_of_steps_by_rank),
        args=(build_model, batches_of_steps_by_rank, bypass_no_sync),
        timeout_s=timeout_s,
    )


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------


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


def measure_time(rows, args, device, autocast_dtype) -> dict:
    """overhead_ratio, seconds_per_step, tokens_per_s and, on CUDA, mfu."""
    model_config = default_model_config()
    m = args.micro_batch_size
    timed_pairs, warmup_pairs = (4, 1) if args.quick else (100, 3)
    timed_steps, warmup_steps = (2, 1) if args.quick else (10, 2)
    distinct_steps = 8  # the timed loops cycle through the micro-batches of this many optimizer steps

    # One process, A = 8: the bookkeeping's overhead, then tokens per second on this global batch of 8m.
    one_rank_steps = pinned(
        [step_micro_batches(rows, step, m, ACCUMULATION_STEPS, 1, 0) for step in range(distinct_steps)], device
    )
    results = overhead(model_config, one_rank_steps, device, autocast_dtype, warmup_pairs, timed_pairs)
    throughput_steps = [one_rank_steps[step % distinct_steps] for step in range(warmup_steps + timed_steps)]
    model = GPT(model_config, seed=DEFAULTS.run.seed).to(device)
    tokens_per_s_one_rank = tokens_per_second(model, throughput_steps, device, autocast_dtype, warmup_steps)

    # The same global batch on two gloo ranks, A = 4 each, one thread per rank: the cores the single
    # process used with its `args.threads` threads.
    tokens_per_s_two_ranks = None
    if device.type == "cpu":
        accumulation_per_rank = ACCUMULATION_STEPS // RANKS
        per_rank_steps = [
            [
                step_micro_batches(rows, step % distinct_steps, m, accumulation_per_rank, RANKS, rank)
                for step in range(warmup_steps + timed_steps)
            ]
            for rank in range(RANKS)
        ]
        tokens_per_s_two_ranks = run_on_ranks(
            throughput_worker, RANKS, args=(model_config, per_rank_steps, warmup_steps)
        )[0]
    results["tokens_per_s"] = {"ranks1": tokens_per_s_one_rank, "ranks2": tokens_per_s_two_ranks}

    if device.type == "cuda":
        # Every position of every row costs FLOPs, padding included, so the rate here is positions per second.
        positions_per_s = ACCUMULATION_STEPS * m * model_config.seq_len / results["seconds_per_step"]["optimizer_step"]
        peak = args.peak_tflops or peak_tflops(torch.cuda.get_device_name(device), "bf16")
        results["mfu"] = None if peak is None else positions_per_s * flops_per_token(model) / (peak * 1e12)
        results["peak_tflops"] = peak
        # The synchronising calls of one step (bf16, fused AdamW, counts given), after a warm-up step.
        loop = default_loop_state(model, device)
        run_step(model, one_rank_steps[0], loop, device, autocast_dtype)
        _, syncs = cuda_syncs_of(lambda: run_step(model, one_rank_steps[1], loop, device, autocast_dtype))
        results["cuda_syncs_per_update"] = len(syncs)
        results["cuda_syncs"] = syncs
    return results


def measure_memory(rows, args, device, autocast_dtype) -> dict:
    """Peak memory of one update at m with A = 1, 2 and 8, and at 8m with A = 1.

    Step 0's row ids are the same for every shape of the same global batch, so 8m_A1 sees the rows of m_A8.
    """
    m = args.micro_batch_size
    shapes = {"m_A1": (m, 1), "m_A2": (m, 2), "m_A8": (m, ACCUMULATION_STEPS), "8m_A1": (ACCUMULATION_STEPS * m, 1)}
    peak_bytes = {}
    for name, (micro_batch_size, accumulation_steps) in shapes.items():
        model = GPT(default_model_config(), seed=DEFAULTS.run.seed).to(device)
        micro_batches = step_micro_batches(rows, 0, micro_batch_size, accumulation_steps, 1, 0)
        peak_bytes[name] = peak_update_memory_bytes(model, micro_batches, device, autocast_dtype)
    return {"peak_mem_bytes": peak_bytes}


def measure_counts(rows, args) -> dict:
    """Bytes, collectives and host reads of a step with A = 8 on 2 gloo ranks (rank 0's; the ranks agree).

    Two steps each, because DDP rebuilds its buckets after the first; the larger count of the two is kept.
    """
    counted_steps = 2
    per_rank_steps = [
        [
            step_micro_batches(rows, step, args.micro_batch_size, ACCUMULATION_STEPS, RANKS, rank)
            for step in range(counted_steps)
        ]
        for rank in range(RANKS)
    ]
    build_model = functools.partial(GPT, default_model_config(), seed=DEFAULTS.run.seed)
    synced = step_traffic(build_model, per_rank_steps)[0]
    synced_every_micro_batch = step_traffic(build_model, per_rank_steps, bypass_no_sync=True)[0]
    steps = synced["steps"]
    return {
        "grad_bytes": synced["grad_bytes"],
        "grad_allreduce_bytes_per_update": max(step["grad_allreduce_bytes"] for step in steps),
        "sync_every_bytes_per_update": max(step["grad_allreduce_bytes"] for step in synced_every_micro_batch["steps"]),
        "scalar_collectives_per_update": max(step["scalar_collectives"] for step in steps),
        "host_syncs_per_micro_batch": max(
            step["host_reads_in_micro_batches"] / step["micro_batches"] for step in steps
        ),
        "host_syncs_per_update": max(sum(step["host_reads_by_call"].values()) for step in steps),
        "host_syncs_per_update_by_call": steps[-1]["host_reads_by_call"],
    }


def measure(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None  # GPUs train in bf16 (configs/gpu_8x.toml)
    torch.set_num_threads(args.threads)
    rows = build_data(DEFAULTS).train
    return {
        **measure_time(rows, args, device, autocast_dtype),
        **measure_memory(rows, args, device, autocast_dtype),
        **measure_counts(rows, args),
        "machine": machine_description(device, args.threads),
        "device": device.type,
        "threads": {"ranks1": args.threads, "ranks2": 1},
        "model_parameters": GPT(default_model_config(), seed=DEFAULTS.run.seed).num_parameters(),
    }


def mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def table(results: dict, args: argparse.Namespace) -> str:
    """The measurements as aligned rows of (measure, value, target, mark), with the machine above and notes below."""
    grad_bytes = results["grad_bytes"]
    memory = results["peak_mem_bytes"]
    seconds = results["seconds_per_step"]
    tokens = results["tokens_per_s"]
    threads = results["threads"]
    lower_quartile, upper_quartile = results["overhead_ratio_quartiles"]
    memory_ratio = memory["m_A8"] / memory["m_A1"]
    accumulation_bytes = memory["m_A8"] - memory["m_A1"]
    reads = ", ".join(f"{call} x{count}" for call, count in sorted(results["host_syncs_per_update_by_call"].items()))
    rows = [
        (
            "overhead_ratio",
            f"{results['overhead_ratio']:.4f} (quartiles {lower_quartile:.4f}..{upper_quartile:.4f})",
            f"<= {TARGET_OVERHEAD_RATIO}",
            mark(results["overhead_ratio"] <= TARGET_OVERHEAD_RATIO),
        ),
        ("  seconds_per_step", f"{seconds['optimizer_step']:.4f} vs bare {seconds['bare']:.4f}", "", ""),
        ("grad_bytes", f"{grad_bytes:,}", "", ""),
        (
            "grad_allreduce_bytes_per_update",
            f"{results['grad_allreduce_bytes_per_update']:,}",
            "= grad_bytes",
            mark(results["grad_allreduce_bytes_per_update"] == grad_bytes),
        ),
        (
            "sync_every_bytes_per_update",
            f"{results['sync_every_bytes_per_update']:,}",
            f"contrast: {ACCUMULATION_STEPS} x grad_bytes",
            "",
        ),
        (
            "scalar_collectives_per_update",
            f"{results['scalar_collectives_per_update']}",
            f"<= {TARGET_SCALAR_COLLECTIVES}",
            mark(results["scalar_collectives_per_update"] <= TARGET_SCALAR_COLLECTIVES),
        ),
        (
            "host_syncs_per_micro_batch",
            f"{results['host_syncs_per_micro_batch']:g}",
            "0",
            mark(results["host_syncs_per_micro_batch"] == 0),
        ),
        ("host_syncs_per_update", f"{results['host_syncs_per_update']} ({reads})", "reported", ""),
        ("peak_mem_bytes m_A1", f"{memory['m_A1']:,}", "", ""),
        ("peak_mem_bytes m_A2", f"{memory['m_A2']:,}", "", ""),
        (
            "peak_mem_bytes m_A8",
            f"{memory['m_A8']:,} ({memory_ratio:.3f} x m_A1)",
            f"<= {TARGET_MEMORY_RATIO} x m_A1",
            mark(memory_ratio <= TARGET_MEMORY_RATIO),
        ),
        ("  m_A8 - m_A1", f"{accumulation_bytes:,} ({accumulation_bytes / grad_bytes:.2f} x grad_bytes)", "", ""),
        (
            "peak_mem_bytes 8m_A1",
            f"{memory['8m_A1']:,} ({memory['8m_A1'] / memory['m_A8']:.1f} x m_A8)",
            f"> {MIN_8M_OVER_M_A8} x m_A8",
            mark(memory["8m_A1"] > MIN_8M_OVER_M_A8 * memory["m_A8"]),
        ),
        ("tokens_per_s ranks1", f"{tokens['ranks1']:,.0f}", f"1 process, {threads['ranks1']} threads", ""),
        (
            "tokens_per_s ranks2",
            "n/a on CUDA (the gloo ranks run on the CPU)" if tokens["ranks2"] is None else f"{tokens['ranks2']:,.0f}",
            f"{RANKS} gloo ranks, {threads['ranks2']} thread each",
            "",
        ),
    ]
    if "cuda_syncs_per_update" in results:
        rows.append(
            (
                "cuda_syncs_per_update",
                f"{results['cuda_syncs_per_update']}",
                f"<= {TARGET_CUDA_SYNCS}",
                mark(results["cuda_syncs_per_update"] <= TARGET_CUDA_SYNCS),
            )
        )
    if "mfu" in results:
        mfu = (
            "n/a: device not in PEAK_TFLOPS, pass --peak-tflops" if results["mfu"] is None else f"{results['mfu']:.3f}"
        )
        peak = "" if results["peak_tflops"] is None else f"of {results['peak_tflops']:g} TFLOPS bf16"
        rows.append(("mfu", mfu, peak, ""))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    config = default_model_config()
    lines = [
        f"machine: {results['machine']}",
        f"model: {results['model_parameters']:,} parameters ({config.n_layer} layers, {config.n_head} heads, "
        f"d_model {config.d_model}, seq_len {config.seq_len}); m = {args.micro_batch_size}, A = {ACCUMULATION_STEPS}; "
        f"timings and memory on {results['device']}, counts on {RANKS} gloo ranks",
        "",
    ]
    for name, value, target, result in [("measure", "value", "target", "mark"), *rows]:
        lines.append(f"{name:<{widths[0]}}  {value:<{widths[1]}}  {target:<{widths[2]}}  {result}".rstrip())
    lines += [
        "",
        "overhead_ratio: median over alternating pairs of (optimizer_step / bare) wall-clock seconds per step;",
        "  the quartiles show how much the pairs scatter (other processes on the machine widen them).",
        "host_syncs_per_update counts reads of host tensors too: the .tolist() of (loss, flags, grad norm) and",
        "  AdamW's .item() of its per-parameter step counters (CPU tensors; fused AdamW on CUDA reads none).",
        "peak_mem_bytes: above the parameters and optimizer state. From A = 2 on, the accumulated gradient",
        "  (grad_bytes) stays allocated while later micro-batches run; A = 1 never holds it during a forward.",
        f"tokens_per_s: the same global batch of {ACCUMULATION_STEPS * args.micro_batch_size} rows; "
        "both runs use the same cores (threads x processes).",
    ]
    return "\n".join(lines)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--quick", action="store_true", help="few repetitions: checks that everything runs, timings are rough"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=DEFAULTS.batch.micro_batch_size,
        help="m, rows per micro-batch (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="intra-op threads of the single process "
        "(default %(default)s: torch's default, every core, as train.py runs); "
        "the 2 gloo ranks take 1 thread each, so both use the same cores",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak TFLOPS for mfu, for the precision measured "
        "(default: looked up by the GPU's name in PEAK_TFLOPS; none on a CPU)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="measure this config's model instead (MFU, syncs, memory); nothing else of the default table",
    )
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=2,
        help="A of --config's comparison, micro-batches per step on one process (default %(default)s)",
    )
    parser.add_argument(
        "--eager-and-compiled",
        action="store_true",
        help="--config: compare both loops eager and compiled, whatever model.compile says (gpu_check.py --perf)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="overrides of --config FILE, as for train.py"
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Any config: --config FILE
# ---------------------------------------------------------------------------------------------------


def peak_precision(config: Config) -> str:
    """Which peak a config's matrix products run at: its autocast dtype, or fp32 with or without TF32."""
    if config.precision.dtype != "fp32":
        return config.precision.dtype
    return "tf32" if config.precision.tf32 else "fp32"


# ---------------------------------------------------------------------------------------------------
# The peer: nanoGPT's training loop on the same model, step for step
# ---------------------------------------------------------------------------------------------------


class MeanCrossEntropy(torch.nn.Module):
    """nanoGPT's model returns its loss from forward: the mean cross-entropy of the micro-batch's targets. Compiling
    this module compiles the model and the loss together, as nanoGPT's torch.compile(model) does."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@dataclass
class PeerLoop:
    """One training loop under comparison: its own copy of the model (same initial weights), its optimizer, and
    step(micro_batches, global_counts), one optimizer update."""

    name: str
    model: torch.nn.Module  # the unwrapped model, whose parameters the optimizer updates
    optimizer: torch.optim.Optimizer
    step: Callable[[list[MicroBatch], GlobalCounts], None]


def project_loop(config: Config, vocab_size: int, device: torch.device, compiled: bool) -> PeerLoop:
    """This project's step as train.py runs it: training_forward_and_loss (model.loss), compiled when `compiled`,
    optimizer_step with the config's scaler, clipping and autocast, and the step's counts given."""
    model = build_model(config, vocab_size).to(device)
    forward_module, loss_sum_fn = training_forward_and_loss(config, model, device.type, compile=compiled)
    wrapped = torch.compile(forward_module) if compiled else forward_module
    optimizer = build_optimizer(config, model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))

    def step(micro_batches: list[MicroBatch], global_counts: GlobalCounts) -> None:
        optimizer_step(
            wrapped,
            micro_batches,
            optimizer,
            device=device,
            scaler=scaler,
            loss_sum_fn=loss_sum_fn,
            grad_clip=config.optim.grad_clip,
            autocast_dtype=autocast_dtype_for(config),
            global_counts=global_counts,
        )

    return PeerLoop("optimizer_step", model, optimizer, step)


def nanogpt_loop(config: Config, vocab_size: int, device: torch.device, compiled: bool) -> PeerLoop:
    """nanoGPT's training loop (its train.py), in our words, on the same model, optimizer, scaler and clipping.

    Per micro-batch: forward and mean cross-entropy under autocast, the loss divided by A, backward, with DDP's
    gradient sync only in the last micro-batch; then unscale, clip, step, update and zero the gradients. The mean
    over a micro-batch divided by A weights every token equally only when every micro-batch holds the same number
    of supervised targets (packed rows, every target supervised): that is the case the comparison runs."""
    model = build_model(config, vocab_size).to(device)
    model_and_loss = MeanCrossEntropy(model)
    model_and_loss = torch.compile(model_and_loss) if compiled else model_and_loss
    optimizer = build_optimizer(config, model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    autocast_dtype = autocast_dtype_for(config)

    def step(micro_batches: list[MicroBatch], global_counts: GlobalCounts) -> None:
        accumulation = len(micro_batches)
        for k, micro_batch in enumerate(micro_batches):
            inputs = micro_batch.inputs.to(device, non_blocking=True)
            labels = micro_batch.labels.to(device, non_blocking=True)
            skip_sync = k < accumulation - 1 and isinstance(model_and_loss, DistributedDataParallel)
            with model_and_loss.no_sync() if skip_sync else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    loss = model_and_loss(inputs, labels) / accumulation
                scaler.scale(loss).backward()
        if config.optim.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return PeerLoop("nanogpt", model, optimizer, step)


def compare_with_nanogpt(
    loops: list[PeerLoop], steps: list[list[MicroBatch]], device: torch.device, warmup_steps: int, peak: float | None
) -> dict:
    """Seconds per step, MFU and peak memory of `loops` (project_loop's and nanogpt_loop's), taking turns step by step.

    Both loops train their own copy of the model on the same micro-batches (pinned on CUDA). Each pair of steps
    alternates which loop goes first, so a slow moment of the machine lands on both alike; the first
    `warmup_steps` pairs (compiling, allocating) are not timed; seconds per step are medians. The peak memory of
    each loop is that of one more step, above what lies allocated between steps (weights, optimizer state,
    and the other loop's model). The counts of every step are computed before the timing, as train.py counts
    them from row ids before its step."""
    counts = [global_counts_of([micro_batches]) for micro_batches in steps]
    seconds = {loop.name: [] for loop in loops}
    for index, (micro_batches, step_counts) in enumerate(zip(steps, counts, strict=True)):
        for loop in loops if index % 2 == 0 else loops[::-1]:
            _, elapsed = timed(functools.partial(loop.step, micro_batches, step_counts), device)
            if index >= warmup_steps:
                seconds[loop.name].append(elapsed)
    flops = flops_per_token(loops[0].model)
    positions_per_step = sum(micro_batch.labels.numel() for micro_batch in steps[0])  # padding costs FLOPs too
    rows = {}
    for loop in loops:
        _, peak_bytes = peak_memory_bytes_of(functools.partial(loop.step, steps[-1], counts[-1]), device)
        seconds_per_step = statistics.median(seconds[loop.name])
        rows[loop.name] = {
            "seconds_per_step": seconds_per_step,
            "mfu": None if peak is None else positions_per_step / seconds_per_step * flops / (peak * 1e12),
            "peak_mem_bytes": peak_bytes,
        }
    ratio = rows["optimizer_step"]["seconds_per_step"] / rows["nanogpt"]["seconds_per_step"]
    return {"loops": rows, "ratio_vs_nanogpt": ratio}


def measure_config(config: Config, args: argparse.Namespace) -> dict:
    """The config's model at its micro-batch size, A = --accumulation-steps on one process: this project's step
    against nanoGPT's loop (compare_with_nanogpt, both compiled when model.compile resolves to on), time per
    step, positions and supervised tokens per second, FLOPs per token, MFU, and on CUDA the syncs of one step."""
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    device = torch.device("cuda" if use_cuda else "cpu")
    torch.set_num_threads(args.threads)
    set_tf32(config.precision.tf32)
    data = build_data(config)
    vocab_size = resolved_vocab_size(config, data.vocab_size)
    m, accumulation = config.batch.micro_batch_size, args.accumulation_steps
    warmup_steps, timed_steps = (1, 2) if args.quick else (3, 10)
    steps = pinned(
        [step_micro_batches(data.train, step, m, accumulation, 1, 0) for step in range(warmup_steps + timed_steps)],
        device,
    )
    precision = peak_precision(config) if use_cuda else config.precision.dtype  # TF32 is CUDA's
    device_name = torch.cuda.get_device_name(device) if use_cuda else cpu_model()
    peak = args.peak_tflops or (peak_tflops(device_name, precision) if use_cuda else None)
    compiled = resolved_compile(config, device.type)
    comparisons = []
    for mode in (False, True) if args.eager_and_compiled else (compiled,):
        loops = [project_loop(config, vocab_size, device, mode), nanogpt_loop(config, vocab_size, device, mode)]
        comparisons.append({"compiled": mode, **compare_with_nanogpt(loops, steps, device, warmup_steps, peak)})
        if mode == compiled:
            ours, our_loop = comparisons[-1]["loops"]["optimizer_step"], loops[0]  # the config's own mode
        del loops
        if use_cuda:
            torch.cuda.empty_cache()
    model = build_model(config, vocab_size)
    positions_per_s = accumulation * m * config.data.seq_len / ours["seconds_per_step"]
    supervised = statistics.median(global_counts_of([micro_batches]).tokens for micro_batches in steps)
    results = {
        "config": args.config,
        "machine": machine_description(device, args.threads),
        "device": device.type,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "micro_batch_size": m,
        "accumulation_steps": accumulation,
        "seq_len": config.data.seq_len,
        "precision": precision,
        "compile": compiled,
        "loss": "chunked" if uses_chunked_loss(config, model, device.type) else "plain",
        "seconds_per_step": ours["seconds_per_step"],
        "positions_per_s": positions_per_s,
        "tokens_per_s": supervised / ours["seconds_per_step"],
        "flops_per_token": flops_per_token(model),
        "peak_tflops": peak,
        "mfu": ours["mfu"],
        "peak_mem_bytes": ours["peak_mem_bytes"],
        "nanogpt": comparisons,
    }
    if use_cuda:  # the synchronising calls of one more step of the config's own loop, warmed up already
        counts = global_counts_of([steps[-1]])
        _, syncs = cuda_syncs_of(lambda: our_loop.step(steps[-1], counts))
        results["cuda_syncs_per_update"], results["cuda_syncs"] = len(syncs), syncs
    return results


def comparison_table(comparison: dict, gib: bool = True) -> list[str]:
    """The rows of compare_with_nanogpt as a table: loop, seconds per step, ratio to nanoGPT, MFU, peak memory."""
    mode = "compiled" if comparison["compiled"] else "eager"
    lines = [f"{'loop':<28}{'s/step':>10}{'vs nanoGPT':>12}{'MFU':>8}{'peak memory':>16}"]
    nanogpt_seconds = comparison["loops"]["nanogpt"]["seconds_per_step"]
    for name in ("nanogpt", "optimizer_step"):
        row = comparison["loops"][name]
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.3f}"
        memory = f"{row['peak_mem_bytes'] / 2**30:.2f} GiB" if gib else f"{row['peak_mem_bytes'] / 2**20:.1f} MiB"
        ratio = row["seconds_per_step"] / nanogpt_seconds
        lines.append(f"{mode + ', ' + name:<28}{row['seconds_per_step']:>10.4f}{ratio:>12.3f}{mfu:>8}{memory:>16}")
    return lines


def config_table(results: dict) -> str:
    lines = [f"machine: {results['machine']}", f"config: {results['config']}", ""]
    for name, value in results.items():
        if name in ("machine", "config", "cuda_syncs", "nanogpt"):
            continue
        if isinstance(value, bool):
            text = "on" if value else "off"
        elif isinstance(value, float):
            text = f"{value:,.4g}"
        else:
            text = f"{value:,}" if isinstance(value, int) else str(value)
        lines.append(f"{name:<24}{text}")
    if results["mfu"] is None:
        lines.append("mfu: no peak for this device; pass --peak-tflops (dense TFLOPS at the precision above)")
    lines += [f"  sync: {sync}" for sync in results.get("cuda_syncs", [])]
    lines += ["", "against nanoGPT's loop on the same model and micro-batches, step by step:"]
    for comparison in results["nanogpt"]:
        lines += comparison_table(comparison, gib=results["device"] == "cuda")
    lines.append("peak memory: of one step, above what lies allocated between steps (weights, optimizer state)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_arguments(argv)
    if args.overrides and args.config is None:
        print("error: section.key=value overrides apply to --config FILE only; give --config", file=sys.stderr)
        return 2
    if args.config is not None:
        try:
            config = load_config(["--config", args.config, *args.overrides])
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        results = measure_config(config, args)
        print(json.dumps(results, indent=2) if args.json else config_table(results))
        return 0
    results = measure(args)
    print(json.dumps(results, indent=2) if args.json else table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
