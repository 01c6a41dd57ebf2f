"""The CUDA paths, checked on one GPU within 5 minutes (not yet timed): PASS/FAIL with the figures behind each.

    python scripts/checks/gpu_check.py            # the table; exit 1 if any check fails
    python scripts/checks/gpu_check.py --json     # one JSON object instead
    python scripts/checks/gpu_check.py --only sync_audit,fp16_overflow

    python scripts/checks/gpu_check.py --perf     # this project's step against nanoGPT's loop: the speed table

Without a GPU it prints one line saying so and exits 0. Every check runs on the first GPU with small models
on the project's own source files as text (no download); a check that raises is a FAIL with its error.

    bf16_equivalence, fp16_equivalence  one step (m = 4, A = 4) against the float64 full-batch reference
    fp32_equivalence                    the same in fp32 with TF32 off (what the equivalence checker runs)
    bf16_chunked_loss                   the bf16 step with model.loss = "chunked" against the same reference
    bf16_chunked_loss_50304             the same at GPT-2's vocabulary (50,304), 3 chunks per micro-batch
    ddp_two_ranks                       2 gloo ranks, DDP with no_sync: gradient bytes per update (counted by a
                                        communication hook) = one gradient; ranks agree; reference. On one GPU
                                        both ranks share it (plain loss, eager); with 2+ GPUs a GPU each and the
                                        chunked loss compiled with the model in one region, as gpu_8x runs
    sync_audit                          synchronising CUDA calls in one bf16 step with fused AdamW
                                        (torch.cuda.set_sync_debug_mode): at most 1, the boundary's read-back
    fp16_overflow                       an injected inf with fused AdamW and the GradScaler: weights and the
                                        optimizer's step counts unchanged, scale halved, the next step applied
    compile                             5 bf16 steps with model.compile (the model and the chunked loss compiled,
                                        as train.py does on CUDA): time to the first step; losses within bf16
                                        tolerance of eager with the plain loss
    resume_dropout                      train.py with dropout, 4 steps in one go vs 2 + 2 resumed: the same bits
                                        (and whether two uninterrupted runs agree, to tell a resume bug from
                                        nondeterministic kernels)
    oom_recovery                        a real out-of-memory (allocator capped) at m = 64: the step redone at a
                                        smaller m equals the m = 8 update
    mfu_gpt2_small                      configs/gpu_8x.toml's model (GPT-2 small) at its m: MFU, tokens/s, memory
    cpu_checkpoint_on_cuda              a run saved on the CPU resumed on the GPU: fused AdamW, counters on the
                                        GPU, training continues

--perf prints instead the speed table (issues 18 and 29): configs/gpu_8x.toml's model (163 M parameters, vocabulary
50,304, seq 1024) at m = 16, A = 4 on packed rows of this project's source files (every target supervised), this
project's optimizer_step against nanoGPT's loop, the two loops taking turns step by step: seconds per step, the
ratio, MFU and peak memory of each, one row per mode: the plain and the chunked loss (at V = 50,304 its
multi-chunk path), eager and compiled. Each mode is one run of `scripts/benchmarks/bench.py --config
configs/gpu_8x.toml --json` (see compare_with_nanogpt in scripts/benchmarks/nanogpt_peer.py) in a process of its
own with a timeout (PERF_TIMEOUT_S; --perf-timeout-s), printed as soon as it ends: a mode that times out or
fails says so on its line and the table goes on. --perf-modes runs some modes only. At most 14 minutes with a
cold Inductor cache; not yet timed on a GPU. A hidden flag, --perf-toy-cpu, runs the same script on the CPU at a
toy size (tests/test_cuda.py). The table's code is scripts/checks/gpu_perf.py.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Run as `python scripts/checks/gpu_check.py`, Python puts only this file's folder on sys.path: the repository
# root goes first, so that the table's module below imports as scripts.checks.gpu_perf.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import accumulation
from accumulation.batching import MicroBatch
from accumulation.chunked_loss import ChunkedCrossEntropySum, FinalHiddenStates
from accumulation.config.config import load_config
from accumulation.data.rows import make_rows
from accumulation.data.sources import step_row_ids
from accumulation.data.step_tools import build_micro_batches, step_counts
from accumulation.models.factory import build_model
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import AUTOCAST_DTYPES, build_optimizer, build_training, set_tf32
from accumulation.run.optimizer_state import load_optimizer_state
from accumulation.shrink_on_oom import ShrinkOnOutOfMemory, optimizer_step_shrinking_on_oom
from accumulation.step import StepSetup, optimizer_step
from scripts.checks.gpu_perf import PERF_MODES, PERF_TIMEOUT_S, last_line, run_perf, text_folder
from testkit.ranks import run_on_ranks
from testkit.reference import (
    capture_gradients,
    counting_allreduce_hook,
    float64_reference_gradient,
    max_relative_error,
)
from testkit.syncs import cuda_syncs_of

REPOSITORY = Path(__file__).resolve().parents[2]
SEQ_LEN = 64
SMALL = GPTConfig(seq_len=SEQ_LEN, n_layer=2, n_head=4, d_model=128, vocab_size=256)
# Relative to the largest entry of the float64 gradient, as scripts/checks/check_equivalence.py bounds them: fp32
# (TF32 off) about 1e-7 per operation; bf16 and fp16 round each operation to 2^-9 and 2^-12.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
MAX_SYNCS_PER_UPDATE = 1
# train.py settings of the resume and checkpoint checks: a small model that trains in seconds.
SMALL_RUN = [
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=64",
    "data.seq_len=64",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "run.eval_every=0",
    "run.sample_bytes=0",
    "run.log_every=1",
    "run.checkpoint_every=2",
]


def corpus_rows(seq_len: int = SEQ_LEN):
    """Rows cut from this project's own Python files: real text of uneven lengths, on every machine."""
    documents = [path.read_bytes() for path in sorted(Path(accumulation.__file__).parent.glob("*.py"))]
    return make_rows(documents, seq_len)


def step_batches(rows, global_batch_size: int, micro_batch_size: int, world_size: int = 1, rank: int = 0):
    """Rank `rank`'s micro-batches of step 0 and the step's counts over all ranks, as train.py makes them."""
    row_ids = step_row_ids(rows.num_rows, global_batch_size, 1337, 0, "drop")
    counts = step_counts(rows, row_ids, 0)
    return build_micro_batches(rows, row_ids, global_batch_size, micro_batch_size, world_size, rank, step=0), counts


def pinned(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    return [micro_batch.pinned() for micro_batch in micro_batches]


def sgd_gradient(model, micro_batches, counts, device, shrink_on_oom=False, **options):
    """The gradient an SGD optimizer is handed by one optimizer_step (batch.on_oom = "shrink"'s with
    `shrink_on_oom`), and the StepResult. `options`: StepSetup's loss_sum_fn, scaler, autocast_dtype."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # FinalHiddenStates holds the model's parameters
    captured = capture_gradients(optimizer)
    if shrink_on_oom:
        setup = StepSetup(model, device, strategy=ShrinkOnOutOfMemory(model), **options)
        result = optimizer_step_shrinking_on_oom(setup, micro_batches, optimizer, global_counts=counts)
    else:
        result = optimizer_step(StepSetup(model, device, **options), micro_batches, optimizer, global_counts=counts)
    return captured[0], result


# ---------------------------------------------------------------------------------------------------------
# The checks: each returns (passed, figures in words)
# ---------------------------------------------------------------------------------------------------------


def equivalence(
    dtype_name: str, device: torch.device, chunked: bool = False, vocab_size: int = 256, chunk_positions: int = 0
) -> tuple[bool, str]:
    """One step against the float64 reference; `chunked`: with model.loss = "chunked" (hidden states, chunked loss),
    `chunk_positions` per chunk (0: the default, one chunk per micro-batch at this size)."""
    set_tf32(False)
    micro_batches, counts = step_batches(corpus_rows(), 16, 4)
    model = GPT(dataclasses.replace(SMALL, vocab_size=vocab_size), seed=1)
    reference = float64_reference_gradient(model, micro_batches)
    autocast_dtype = AUTOCAST_DTYPES[dtype_name]
    scaler = torch.amp.GradScaler(device.type) if dtype_name == "fp16" else None
    model = model.to(device)
    forward_module, loss_sum_fn = (
        (FinalHiddenStates(model), ChunkedCrossEntropySum(model.output_head, chunk_positions or None))
        if chunked
        else (model, None)
    )
    options = {"autocast_dtype": autocast_dtype, "scaler": scaler}
    if loss_sum_fn is not None:
        options["loss_sum_fn"] = loss_sum_fn
    gradient, result = sgd_gradient(forward_module, pinned(micro_batches), counts, device, **options)
    error = max_relative_error(gradient, reference)
    passed = result.applied and error < TOLERANCE[dtype_name]
    return passed, f"max relative error {error:.2e} (tolerance {TOLERANCE[dtype_name]:g}), N = {result.tokens}"


def ddp_worker(rank: int, world_size: int, compiled_chunked: bool) -> dict:
    """`compiled_chunked` (2+ GPUs, a GPU each): the chunked loss compiled with the model in one region inside
    DDP, as train.py runs gpu_8x; else both ranks share the one GPU and run the plain loss eagerly."""
    device = torch.device("cuda", rank if compiled_chunked else 0)  # gloo all-reduces CUDA tensors too
    torch.cuda.set_device(device)
    # train.py's assembly: the chunked loss compiled with the model in one region, in DDP; or plain and eager
    loss = (
        ["model.loss=chunked", "model.compile=true"]
        if compiled_chunked
        else ["model.loss=plain", "model.compile=false"]
    )
    config = load_config(["precision.tf32=false", *loss])
    context = DistributedContext(rank, rank, world_size, device, "gloo")
    training = build_training(config, SMALL.vocab_size, None, context, model=GPT(SMALL, seed=1))
    model, wrapped, loss_sum_fn = training.model, training.setup.module, training.setup.loss_sum_fn
    state = {"bytes": 0}
    wrapped.register_comm_hook(state, counting_allreduce_hook)
    rows = corpus_rows()
    bytes_per_update, gradients = [], []
    for _ in range(2):  # DDP rebuilds its buckets after the first step: count both
        micro_batches, counts = step_batches(rows, 16, 2, world_size, rank)  # A = 4 per rank
        state["bytes"] = 0
        gradient, _ = sgd_gradient(wrapped, pinned(micro_batches), counts, device, loss_sum_fn=loss_sum_fn)
        bytes_per_update.append(state["bytes"])
        gradients.append([g.cpu() for g in gradient])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"bytes": bytes_per_update, "grad_bytes": grad_bytes, "first_gradient": gradients[0]}


def check_ddp_two_ranks(device: torch.device) -> tuple[bool, str]:
    compiled_chunked = torch.cuda.device_count() >= 2
    # Compiling takes a minute or two with a cold Inductor cache.
    rank0, rank1 = run_on_ranks(ddp_worker, 2, args=(compiled_chunked,), timeout_s=300.0 if compiled_chunked else 120.0)
    every_micro_batch = [mb for rank in range(2) for mb in step_batches(corpus_rows(), 16, 2, 2, rank)[0]]
    error = max_relative_error(
        rank0["first_gradient"], float64_reference_gradient(GPT(SMALL, seed=1), every_micro_batch)
    )
    ranks_agree = all(torch.equal(a, b) for a, b in zip(rank0["first_gradient"], rank1["first_gradient"], strict=True))
    one_gradient = rank0["bytes"] == rank1["bytes"] == [rank0["grad_bytes"]] * 2
    passed = one_gradient and ranks_agree and error < TOLERANCE["fp32"]
    return passed, (
        f"{'compiled chunked loss, 2 GPUs' if compiled_chunked else 'plain loss, 1 GPU'}: "
        f"bytes per update {rank0['bytes'][-1]:,} (one gradient: {rank0['grad_bytes']:,}); "
        f"ranks equal: {ranks_agree}; vs float64 {error:.2e}"
    )


def check_sync_audit(device: torch.device) -> tuple[bool, str]:
    set_tf32(True)
    model = GPT(SMALL, seed=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    setup = StepSetup(model, device, grad_clip=1.0, autocast_dtype=torch.bfloat16)
    rows = corpus_rows()

    def one_step(step: int):
        row_ids = step_row_ids(rows.num_rows, 16, 1337, step, "drop")
        counts = step_counts(rows, row_ids, step)
        micro_batches = pinned(build_micro_batches(rows, row_ids, 16, 4, 1, 0, step=step))
        return lambda: optimizer_step(setup, micro_batches, optimizer, global_counts=counts)

    one_step(0)()  # warm-up: the optimizer's state and cuBLAS's workspaces
    torch.cuda.synchronize(device)
    step = one_step(1)
    _, syncs = cuda_syncs_of(step)
    return len(syncs) <= MAX_SYNCS_PER_UPDATE, f"{len(syncs)} per update" + (f": {'; '.join(syncs)}" if syncs else "")


def check_fp16_overflow(device: torch.device) -> tuple[bool, str]:
    model = GPT(SMALL, seed=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    rows = corpus_rows()
    micro_batches, counts = step_batches(rows, 16, 4)
    setup = StepSetup(model, device, scaler=scaler, autocast_dtype=torch.float16)
    first = optimizer_step(setup, pinned(micro_batches), optimizer, global_counts=counts)
    weights = copy.deepcopy(model.state_dict())
    steps_before = [state["step"].clone() for state in optimizer.state.values()]
    handle = model.lm_head.weight.register_hook(lambda grad: grad * math.inf)
    overflow = optimizer_step(setup, pinned(micro_batches), optimizer, global_counts=counts)
    handle.remove()
    unchanged = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    steps_unchanged = all(
        torch.equal(a, s["step"]) for a, s in zip(steps_before, optimizer.state.values(), strict=True)
    )
    scale = scaler.get_scale()
    after = optimizer_step(setup, pinned(micro_batches), optimizer, global_counts=counts)
    passed = first.applied and not overflow.applied and unchanged and steps_unchanged
    passed = passed and scale == 2.0**9 and after.applied
    return passed, (
        f"overflow applied: {overflow.applied}; weights unchanged: {unchanged}; step counts unchanged: "
        f"{steps_unchanged}; scale 1024 -> {scale:g}; next step applied: {after.applied}"
    )


def check_compile(device: torch.device) -> tuple[bool, str]:
    set_tf32(True)
    rows = corpus_rows()
    single = DistributedContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)
    losses, first_step_seconds = {}, None
    for compiled in (False, True):
        # train.py's assembly, compiled or eager (model.loss as train.py decides it, compiled with the model)
        settings = [f"model.compile={str(compiled).lower()}", "precision.dtype=bf16", "optim.lr=1e-3"]
        training = build_training(load_config(settings), SMALL.vocab_size, None, single, model=GPT(SMALL, seed=1))
        losses[compiled] = []
        for step in range(5):
            row_ids = step_row_ids(rows.num_rows, 16, 1337, step, "drop")
            counts = step_counts(rows, row_ids, step)
            micro_batches = pinned(build_micro_batches(rows, row_ids, 16, 4, 1, 0, step=step))
            start = time.perf_counter()
            result = training.step(training.setup, micro_batches, training.optimizer, global_counts=counts)
            if compiled and step == 0:
                first_step_seconds = time.perf_counter() - start
            losses[compiled].append(result.loss)
    # bf16 rounds each operation to 2^-9; compiled kernels fuse and reorder them, so losses differ by a few
    # times that after 5 updates. 2e-2 relative is far below the change of the loss over those updates.
    difference = max(abs(c - e) / e for c, e in zip(losses[True], losses[False], strict=True))
    return difference < 2e-2, (
        f"first step {first_step_seconds:.1f} s (compiling); loss {losses[True][-1]:.4f} vs eager "
        f"{losses[False][-1]:.4f}, max relative difference {difference:.1e} (tolerance 2e-2)"
    )


def train(run_dir: Path, *arguments: str) -> list[dict]:
    """python train.py with SMALL_RUN and `arguments`; the metrics lines of the run."""
    command = [sys.executable, str(REPOSITORY / "train.py"), *SMALL_RUN, *arguments]
    subprocess.run(command, cwd=run_dir, check=True, capture_output=True, text=True, timeout=240)
    metrics = Path(run_dir, "runs", "check", "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in metrics]


def check_resume_dropout(device: torch.device) -> tuple[bool, str]:
    """4 steps in one go, twice (are CUDA's kernels deterministic here at all?), and 2 steps resumed to 4."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = text_folder(Path(scratch))
        common = ["device=cuda", "model.dropout=0.1", f"data.source={folder}", "run.name=check"]
        runs = {name: Path(scratch, name) for name in ("whole", "again", "split")}
        for run_dir in runs.values():
            run_dir.mkdir()
        whole = [line["loss"] for line in train(runs["whole"], *common, "run.max_steps=4")]
        again = [line["loss"] for line in train(runs["again"], *common, "run.max_steps=4")]
        train(runs["split"], *common, "run.max_steps=2")
        resumed = [line["loss"] for line in train(runs["split"], *common, "run.max_steps=4")]
    return resumed == whole, (
        f"resumed == uninterrupted: {resumed == whole} (losses {whole}); two uninterrupted runs equal: {again == whole}"
    )


def check_oom_recovery(device: torch.device) -> tuple[bool, str]:
    set_tf32(False)
    config = GPTConfig(seq_len=256, n_layer=4, n_head=4, d_model=256, vocab_size=256)
    rows = corpus_rows(256)
    small_batches, counts = step_batches(rows, 64, 8)  # m = 8, A = 8
    large_batches, _ = step_batches(rows, 64, 64)  # m = 64, A = 1
    model = GPT(config, seed=1).to(device)
    expected, _ = sgd_gradient(copy.deepcopy(model), pinned(small_batches), counts, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base_bytes = torch.cuda.memory_allocated(device)
    sgd_gradient(copy.deepcopy(model), pinned(small_batches), counts, device)
    small_peak = torch.cuda.max_memory_allocated(device) - base_bytes
    # Room for twice what m = 8 needs (plus the copies made here): m = 64 needs about 8 times the activations.
    limit_bytes = base_bytes + 2 * small_peak + 4 * sum(p.numel() * 4 for p in model.parameters())
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total_bytes, device)
    try:
        recovered, result = sgd_gradient(
            copy.deepcopy(model), pinned(large_batches), counts, device, shrink_on_oom=True
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    error = max_relative_error(recovered, expected)
    passed = result.applied and result.micro_batch_size < 64 and error < TOLERANCE["fp32"]
    return passed, (
        f"m 64 -> {result.micro_batch_size} (A = {result.micro_batches}) under a {limit_bytes / 2**20:.0f} MiB cap; "
        f"vs the m = 8 update {error:.1e}"
    )


def check_mfu(device: torch.device) -> tuple[bool, str]:
    """scripts/benchmarks/bench.py --config configs/gpu_8x.toml (on a small text corpus: the model is what counts)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = text_folder(Path(scratch))
        config_file = REPOSITORY / "configs" / "gpu_8x.toml"
        bench = REPOSITORY / "scripts" / "benchmarks" / "bench.py"
        # The config trains on prepared token files; the benchmark only needs rows of its seq_len to time the model.
        command = [sys.executable, str(bench), "--config", str(config_file), "--json", f"data.source={folder}"]
        # Two copies of the model, compiled when the config compiles (tens of seconds each on a GPU).
        completed = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300, cwd=scratch)
    results = json.loads(completed.stdout)
    no_peak = "n/a (device not in PEAK_TFLOPS, accumulation/run/mfu.py)"
    mfu = no_peak if results["mfu"] is None else f"{results['mfu']:.3f}"
    return results["seconds_per_step"] > 0, (
        f"MFU {mfu} at m = {results['micro_batch_size']}, {results['precision']} "
        f"(peak {results['peak_tflops']} TFLOPS); {results['tokens_per_s']:,.0f} tokens/s; "
        f"peak {results['peak_mem_bytes'] / 2**30:.1f} GiB; {results['cuda_syncs_per_update']} syncs per update"
    )


def check_cpu_checkpoint_on_cuda(device: torch.device) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = text_folder(Path(scratch))
        common = [f"data.source={folder}", "run.name=check"]
        train(Path(scratch), *common, "device=cpu", "run.max_steps=2")
        checkpoint = torch.load(Path(scratch, "runs", "check", "checkpoints", "latest.pt"), weights_only=True)
        resumed = train(Path(scratch), *common, "device=cuda", "run.max_steps=4")
    config = load_config([*SMALL_RUN, f"data.source={folder}"])
    # bytes, as the run's data
    model = build_model(config.model, vocab_size=256, seq_len=config.data.seq_len, seed=config.run.seed).to(device)
    model.load_state_dict(checkpoint["model"])
    optimizer = build_optimizer(config.optim, model, device)
    load_optimizer_state(optimizer, checkpoint["optimizer"])
    fused = all(group.get("fused") for group in optimizer.param_groups)
    on_gpu = all(state["step"].device.type == "cuda" for state in optimizer.state.values())
    continued = [line["steps"] for line in resumed] == [1, 2, 3, 4] and all(line["updates"] for line in resumed)
    return fused and on_gpu and continued, (
        f"fused after load: {fused}; step counters on the GPU: {on_gpu}; steps 3-4 trained on CUDA: {continued}"
    )


CHECKS = {
    "bf16_equivalence": lambda device: equivalence("bf16", device),
    "fp16_equivalence": lambda device: equivalence("fp16", device),
    "fp32_equivalence": lambda device: equivalence("fp32", device),
    "bf16_chunked_loss": lambda device: equivalence("bf16", device, chunked=True),
    # GPT-2's vocabulary, 96 positions per chunk: 3 chunks per micro-batch of 256 positions, the last one shorter
    "bf16_chunked_loss_50304": lambda device: equivalence(
        "bf16", device, chunked=True, vocab_size=50_304, chunk_positions=96
    ),
    "ddp_two_ranks": check_ddp_two_ranks,
    "sync_audit": check_sync_audit,
    "fp16_overflow": check_fp16_overflow,
    "compile": check_compile,
    "resume_dropout": check_resume_dropout,
    "oom_recovery": check_oom_recovery,
    "mfu_gpt2_small": check_mfu,
    "cpu_checkpoint_on_cuda": check_cpu_checkpoint_on_cuda,
}


def run_checks(names: list[str], device: torch.device) -> list[dict]:
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            passed, figures = CHECKS[name](device)
        except Exception as error:  # a check that raises is a FAIL with its error, and the others still run
            passed, figures = False, f"{type(error).__name__}: {last_line(str(error))}"
            if isinstance(error, subprocess.CalledProcessError):
                figures += f" | train.py: {last_line(error.stderr)}"
        results.append({"check": name, "passed": passed, "seconds": time.perf_counter() - start, "figures": figures})
        torch.cuda.empty_cache()
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--only", help=f"comma-separated checks to run (default all: {', '.join(CHECKS)})")
    parser.add_argument(
        "--perf",
        action="store_true",
        help="instead of the checks: optimizer_step against nanoGPT's loop, eager and compiled (the speed table); "
        "without a GPU one line, exit 0",
    )
    parser.add_argument(
        "--perf-modes",
        default=",".join(PERF_MODES),
        help=f"--perf: comma-separated modes to run (default all: {', '.join(PERF_MODES)})",
    )
    parser.add_argument(
        "--perf-timeout-s",
        type=float,
        default=None,
        help=f"--perf: seconds each mode may take (default {PERF_TIMEOUT_S['eager']} eager, "
        f"{PERF_TIMEOUT_S['compiled']} compiled)",
    )
    parser.add_argument("--perf-toy-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: CPU, toy size
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="--perf only: overrides of configs/gpu_8x.toml"
    )
    arguments = parser.parse_args(argv)
    if arguments.perf or arguments.perf_toy_cpu:
        modes = arguments.perf_modes.split(",")
        unknown = [mode for mode in modes if mode not in PERF_MODES]
        if unknown:
            print(
                f"error: --perf-modes: unknown mode {', '.join(unknown)} (modes: {', '.join(PERF_MODES)})",
                file=sys.stderr,
            )
            return 2
        return run_perf(arguments.overrides, modes, arguments.perf_timeout_s, arguments.perf_toy_cpu)
    if arguments.overrides:
        print("error: section.key=value overrides apply to --perf only", file=sys.stderr)
        return 2
    names = arguments.only.split(",") if arguments.only else list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        print(f"error: --only: unknown check {', '.join(unknown)} (checks: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing checked (run it where torch.cuda.is_available())")
        return 0
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gpu-check-inductor-"))
    device = torch.device("cuda", 0)
    started = time.perf_counter()
    results = run_checks(names, device)
    summary = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": time.perf_counter() - started,
        "checks": results,
    }
    if arguments.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"gpu_check on {summary['device']} (torch {summary['torch']}, CUDA {summary['cuda']})")
        width = max(len(name) for name in names)
        for result in results:
            mark = "PASS" if result["passed"] else "FAIL"
            print(f"{result['check']:<{width}}  {mark}  {result['seconds']:6.1f} s  {result['figures']}")
        print(f"total {summary['seconds']:.0f} s")
    return 0 if all(result["passed"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
