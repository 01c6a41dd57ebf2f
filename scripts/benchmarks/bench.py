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
                                                                                                + grad_bytes
    tokens_per_s                     supervised tokens per second, 1 process and 2 gloo ranks, same global batch
    cuda_syncs_per_update            CUDA only: synchronising calls of one bf16 step, counted by
                                     torch.cuda.set_sync_debug_mode                             target <= 1
    mfu                              CUDA only: model FLOPs utilisation

With --config FILE the benchmark measures that config's model instead (its m, seq_len and precision, A = 2
on one process): seconds per step, positions per second, FLOPs per token, MFU against the device's peak
(PEAK_TFLOPS in accumulation/run/mfu.py, or --peak-tflops), CUDA syncs per update and peak memory.

The counts come from 2 gloo ranks on the CPU whatever the hardware: they are properties of the code. The
timings and the memory peaks run on the GPU when there is one, else on the CPU. Threads: the single process
uses --threads (default: torch's default, every core, as `python train.py` runs); each gloo rank uses one
(testkit/ranks.py), so on a 2-core CPU both tokens_per_s runs use the same two cores. This file is the command
line and the tables; the functions that measure are plain and importable, next to it: invariants.py (the default
table), nanogpt_peer.py (--config: the comparison with nanoGPT's loop) and measuring.py (what both use).
tests/test_performance.py asserts the invariants with the same functions.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from accumulation.config.config import ConfigError, load_config

# Run as `python scripts/benchmarks/bench.py`, Python puts only this file's folder on sys.path: the repository
# root goes first, so the benchmark's other files import as scripts.benchmarks.*, as the tests import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks.invariants import (
    ACCUMULATION_STEPS,
    MIN_8M_OVER_M_A8,
    RANKS,
    TARGET_CUDA_SYNCS,
    TARGET_MEMORY_RATIO,
    TARGET_OVERHEAD_RATIO,
    TARGET_SCALAR_COLLECTIVES,
    default_model_config,
    measure,
)
from scripts.benchmarks.measuring import DEFAULTS
from scripts.benchmarks.nanogpt_peer import measure_config


def mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def invariant_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """The default table's rows of (measure, value, target, mark), measured on any device."""
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
            # The one gradient buffer that accumulation keeps between micro-batches is allowed on top (the
            # same bound tests/test_performance.py asserts): in this small model it is a large share of memory.
            f"<= {TARGET_MEMORY_RATIO} x m_A1 + grad_bytes",
            mark(memory["m_A8"] <= TARGET_MEMORY_RATIO * memory["m_A1"] + grad_bytes),
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
    return rows


def gpu_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """The rows measured on CUDA only: the synchronising calls of one step, and MFU."""
    rows = []
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
    return rows


def table(results: dict, args: argparse.Namespace) -> str:
    """The measurements as aligned rows of (measure, value, target, mark), with the machine above and notes below."""
    rows = invariant_rows(results) + gpu_rows(results)
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
