"""The measurements of scripts/benchmarks/bench.py's default table, on the default model: the overhead of
optimizer_step's bookkeeping against a bare loop, tokens per second, the peak memory of one update, and what a
step sends between ranks and reads back to Python. Each invariant's target is declared here with it;
tests/test_performance.py asserts the invariants with these functions."""

import argparse
import contextlib
import functools
import statistics
from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX
from accumulation.config.config import resolved_grad_scaler
from accumulation.counters import Counters
from accumulation.data.rows import BYTE_VOCAB_SIZE
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model, count_parameters, loss_sum_fn_for
from accumulation.models.gpt import GPTConfig, gpt_config
from accumulation.run.build import build_optimizer
from accumulation.schedule import run_scheduler
from accumulation.step import StepResult, StepSetup, optimizer_step
from scripts.benchmarks.measuring import (
    DEFAULTS,
    flops_per_token,
    global_counts_of,
    machine_description,
    peak_tflops,
    pinned,
    step_micro_batches,
    timed,
)
from testkit.memory import peak_memory_bytes_of
from testkit.ranks import run_on_ranks
from testkit.syncs import cuda_syncs_of

ACCUMULATION_STEPS = 8  # A on one rank, for every measurement
RANKS = 2  # D of the two-rank measurements (gloo on this CPU)

TARGET_OVERHEAD_RATIO = 1.02
TARGET_SCALAR_COLLECTIVES = 1  # the loss sum (and the stop and OOM flags) at the boundary; N needs none
TARGET_CUDA_SYNCS = 1  # the read-back of (loss sum, flags, gradient norm) at the boundary
TARGET_MEMORY_RATIO = 1.05  # m_A8 / m_A1
MIN_8M_OVER_M_A8 = 4  # "far below 8m_A1": 8m rows in one micro-batch hold about 8 times the activations

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
# The model and the two loops being compared
# ---------------------------------------------------------------------------------------------------


def default_model_config() -> GPTConfig:
    return gpt_config(DEFAULTS.model, BYTE_VOCAB_SIZE, DEFAULTS.data.seq_len)


def default_model() -> torch.nn.Module:
    """The default config's model, built as train.py builds it (build_model), on the CPU."""
    return build_model(DEFAULTS.model, BYTE_VOCAB_SIZE, seq_len=DEFAULTS.data.seq_len, seed=DEFAULTS.run.seed)


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
    optimizer = build_optimizer(DEFAULTS.optim, model, device)
    scheduler = run_scheduler(optimizer, DEFAULTS.schedule, DEFAULTS.run.max_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(DEFAULTS))
    return LoopState(optimizer, scheduler, scaler, Counters())


def run_step(model, micro_batches, loop: LoopState, device, autocast_dtype=None, global_counts=None) -> StepResult:
    """One step of the project's loop as train.py runs it: `optimizer_step` with the default loss, gradient
    clipping and the step's counts given (one process: counted here when not given), then the scheduler (once
    per applied update) and the counters."""
    result = optimizer_step(
        StepSetup(
            model,
            device,
            scaler=loop.scaler,
            loss_sum_fn=loss_sum_fn_for(DEFAULTS.model),
            grad_clip=DEFAULTS.optim.grad_clip,
            autocast_dtype=autocast_dtype,
        ),
        micro_batches,
        loop.optimizer,
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


# ---------------------------------------------------------------------------------------------------
# Time: overhead ratio and throughput
# ---------------------------------------------------------------------------------------------------


def overhead(batches_of_steps, device, autocast_dtype, warmup_pairs: int, timed_pairs: int) -> dict:
    """Seconds per step of optimizer_step and of the bare loop, measured in alternating pairs.

    Each loop trains its own copy of the same model on the same micro-batches. A pair runs one step of each,
    back to back, and which one goes first alternates, so a slow moment of the machine (other processes,
    frequency changes) lands on both alike. The ratio is the median of the per-pair ratios.
    """
    ours_model = default_model().to(device)
    bare_model = default_model().to(device)
    ours_loop = default_loop_state(ours_model, device)
    bare_optimizer = build_optimizer(DEFAULTS.optim, bare_model, device)
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


def throughput_worker(rank, world_size, batches_of_steps_by_rank, warmup_steps) -> float:
    """tokens_per_second on one of the gloo ranks (run_on_ranks gives each rank one thread)."""
    model = DistributedDataParallel(default_model())
    counts = [global_counts_of(list(step)) for step in zip(*batches_of_steps_by_rank, strict=True)]
    return tokens_per_second(model, batches_of_steps_by_rank[rank], torch.device("cpu"), None, warmup_steps, counts)


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


def traffic_worker(rank, world_size, make_model, batches_of_steps_by_rank, bypass_no_sync) -> dict:
    """On each gloo rank: DDP around make_model(), then one optimizer_step per list of micro-batches, each
    step's traffic counted. The phases of a step, as seen from outside it: "count" (the token count, before
    the first forward), "micro-batches" (from the first forward until the step unscales its gradients) and
    "boundary" (unscale, clip, update)."""
    if bypass_no_sync:
        # The mistake, for contrast: every micro-batch synchronises. This spawned process ends with the run.
        DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    model = DistributedDataParallel(make_model())
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
    make_model, batches_of_steps_by_rank, bypass_no_sync: bool = False, timeout_s: float = 120.0
) -> list[dict]:
    """traffic_worker on as many gloo ranks as there are lists of steps; the per-rank results in rank order."""
    return run_on_ranks(
        traffic_worker,
        len(batches_of_steps_by_rank),
        args=(make_model, batches_of_steps_by_rank, bypass_no_sync),
        timeout_s=timeout_s,
    )


# ---------------------------------------------------------------------------------------------------
# The default table's measurements
# ---------------------------------------------------------------------------------------------------


def measure_time(rows, args, device, autocast_dtype) -> dict:
    """overhead_ratio, seconds_per_step, tokens_per_s and, on CUDA, mfu."""
    m = args.micro_batch_size
    timed_pairs, warmup_pairs = (4, 1) if args.quick else (100, 3)
    timed_steps, warmup_steps = (2, 1) if args.quick else (10, 2)
    distinct_steps = 8  # the timed loops cycle through the micro-batches of this many optimizer steps

    # One process, A = 8: the bookkeeping's overhead, then tokens per second on this global batch of 8m.
    one_rank_steps = pinned(
        [step_micro_batches(rows, step, m, ACCUMULATION_STEPS, 1, 0) for step in range(distinct_steps)], device
    )
    results = overhead(one_rank_steps, device, autocast_dtype, warmup_pairs, timed_pairs)
    throughput_steps = [one_rank_steps[step % distinct_steps] for step in range(warmup_steps + timed_steps)]
    model = default_model().to(device)
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
        tokens_per_s_two_ranks = run_on_ranks(throughput_worker, RANKS, args=(per_rank_steps, warmup_steps))[0]
    results["tokens_per_s"] = {"ranks1": tokens_per_s_one_rank, "ranks2": tokens_per_s_two_ranks}

    if device.type == "cuda":
        # Every position of every row costs FLOPs, padding included, so the rate here is positions per second.
        positions = ACCUMULATION_STEPS * m * DEFAULTS.data.seq_len
        positions_per_s = positions / results["seconds_per_step"]["optimizer_step"]
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
        model = default_model().to(device)
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
    synced = step_traffic(default_model, per_rank_steps)[0]
    synced_every_micro_batch = step_traffic(default_model, per_rank_steps, bypass_no_sync=True)[0]
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
    rows = build_data(DEFAULTS.data, model_vocab_size=DEFAULTS.model.vocab_size, seed=DEFAULTS.run.seed).train
    return {
        **measure_time(rows, args, device, autocast_dtype),
        **measure_memory(rows, args, device, autocast_dtype),
        **measure_counts(rows, args),
        "machine": machine_description(device, args.threads),
        "device": device.type,
        "threads": {"ranks1": args.threads, "ranks2": 1},
        "model_parameters": count_parameters(default_model()),
    }
