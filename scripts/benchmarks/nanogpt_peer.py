"""bench.py --config FILE: any config's model, this project's step against its peer, nanoGPT's training loop,
on the same model and micro-batches, step for step: seconds per step, MFU, peak memory, and on CUDA the syncs
of one step."""

import argparse
import contextlib
import dataclasses
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch
from accumulation.config.config import Config, resolved_compile, resolved_grad_scaler
from accumulation.data.sources import build_data
from accumulation.models.factory import (
    build_model,
    resolved_vocab_size,
)
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import autocast_dtype_for, build_optimizer, build_training, set_tf32
from scripts.benchmarks.measuring import (
    cpu_model,
    flops_per_token,
    global_counts_of,
    machine_description,
    peak_tflops,
    pinned,
    step_micro_batches,
    timed,
)
from testkit.memory import peak_memory_bytes_of
from testkit.syncs import cuda_syncs_of


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
    loss: str = "plain"  # the loss it runs: model.loss as train.py decides it, or nanoGPT's plain one


def project_loop(config: Config, vocab_size: int, device: torch.device, compiled: bool) -> PeerLoop:
    """This project's step as train.py runs it: build_training's model, loss (model.loss decided), module
    (compiled when `compiled`), optimizer, scaler, clipping and autocast, and the step's counts given."""
    as_run = dataclasses.replace(config, model=dataclasses.replace(config.model, compile=compiled))
    single = DistributedContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)
    training = build_training(as_run, vocab_size, None, single)

    def step(micro_batches: list[MicroBatch], global_counts: GlobalCounts) -> None:
        training.step(training.setup, micro_batches, training.optimizer, global_counts=global_counts)

    return PeerLoop("optimizer_step", training.model, training.optimizer, step, training.model_config.loss)


def nanogpt_loop(config: Config, vocab_size: int, device: torch.device, compiled: bool) -> PeerLoop:
    """nanoGPT's training loop (its train.py), in our words, on the same model, optimizer, scaler and clipping.

    Per micro-batch: forward and mean cross-entropy under autocast, the loss divided by A, backward, with DDP's
    gradient sync only in the last micro-batch; then unscale, clip, step, update and zero the gradients. The mean
    over a micro-batch divided by A weights every token equally only when every micro-batch holds the same number
    of supervised targets (packed rows, every target supervised): that is the case the comparison runs."""
    model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed).to(device)
    model_and_loss = MeanCrossEntropy(model)
    model_and_loss = torch.compile(model_and_loss) if compiled else model_and_loss
    optimizer = build_optimizer(config.optim, model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    autocast_dtype = autocast_dtype_for(config.precision)

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
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    vocab_size = resolved_vocab_size(config.model, data.vocab_size)
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
    model = our_loop.model
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
        "loss": our_loop.loss,
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
