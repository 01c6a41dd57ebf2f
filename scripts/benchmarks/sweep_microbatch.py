"""Memory and speed of one optimizer update against the micro-batch size m, at a fixed global batch.

    python scripts/benchmarks/sweep_microbatch.py [--micro 1,2,4,8,16,32] [--png FILE] [--json]
        [--config FILE] [section.key=value ...]
    torchrun --standalone --nproc_per_node=N scripts/benchmarks/sweep_microbatch.py [same arguments]

The global batch G stays as configured; for each m, A = G / (m·D) follows, and an m that does not give a
whole A is reported as skipped, with the reason. Each m gets a fresh model with the same initial weights
and feeds the examples of step 0 of the data order through `optimizer_step` (the function train.py calls)
several times:

  1. warm-up: first-call costs (allocator growth, DDP's buckets, torch.compile) stay out of the numbers;
     the gradient the optimizer is handed is kept for the comparison across m;
  2. timed, TIMED_UPDATES times: supervised tokens (all ranks) per second of wall time, of the fastest;
  3. profiled: peak memory (see testkit/memory.py, peak_memory_bytes_of).

An m that does not fit (torch.OutOfMemoryError) is marked "does not fit" and the sweep goes on to the next
m: finding that size is what the sweep is for on a GPU. (One process only: under torchrun a rank that runs
out of memory leaves the others waiting in DDP's all-reduce, so the error ends the run there.)

The model is the config's (accumulation.models.factory.build_model) with dropout off, trained with the config's loss
and precision, and the optimizer is SGD with learning rate 0, so the weights never move: every update of
every m sees the same model, and the gradients of different m must agree. That SGD holds no state, so the
peak is what depends on m (activations, gradients, temporaries); AdamW would add 2 x 4 bytes per parameter
to every row.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from accumulation.batching import accumulation_steps, collective_device
from accumulation.config.config import Config, ConfigError, load_config
from accumulation.data.rows import DataError
from accumulation.data.sources import build_data, step_row_ids
from accumulation.data.splits import Data
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.factory import (
    resolved_vocab_size,
)
from accumulation.parallel.distributed import DistributedContext, run_and_exit, setup_distributed, teardown_distributed
from accumulation.run.build import build_training, check_device_available
from testkit.memory import peak_memory_bytes_of
from testkit.reference import first_update_probe, max_relative_error, without_dropout

# Tolerance on max |gradient(m) - gradient(first m)| / max |gradient(first m)|, by the loop's precision.
# Different m add the same terms in a different order (other micro-batch sums, other matrix shapes).
# fp32: each m's gradient is within about 1e-7 of the largest entry of the exact one (what
# scripts/checks/check_equivalence.py measures against float64), so two of them differ by about twice that; 1e-5
# leaves a wide margin and is far below the 1e-2 and more of a wrong weighting of micro-batches.
# bf16 and fp16 round each operation to 2^-9 and 2^-12: the bounds of check_equivalence.py, 5e-2 and 1e-2.
RELATIVE_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}

BYTES_PER_MB = 1e6

OUT_OF_MEMORY = "does not fit: out of memory"

# The fastest of a few timed updates: other work on the machine only ever makes an update slower.
TIMED_UPDATES = 3


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's own flags, and the rest: `--config FILE` and `section.key=value`, as train.py takes them."""
    parser = argparse.ArgumentParser(
        description="Peak memory and tokens/s of one optimizer update for several micro-batch sizes "
        "at a fixed global batch.",
        epilog="Config keys and their defaults: python train.py --help (batch.micro_batch_size is replaced by --micro)",
    )
    parser.add_argument("--config", help="TOML config file, as for train.py")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for train.py")
    parser.add_argument(
        "--micro",
        type=positive_integers,
        default=[1, 2, 4, 8, 16, 32],
        help="micro-batch sizes m, comma-separated (default 1,2,4,8,16,32)",
    )
    parser.add_argument(
        "--png", default="sweep_microbatch.png", help="where to write the figure (default sweep_microbatch.png)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    arguments = parser.parse_intermixed_args(argv)
    config_argv = (["--config", arguments.config] if arguments.config else []) + arguments.overrides
    return arguments, config_argv


def positive_integers(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything but positive integers is an argparse error."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def check_figure_folder(png: str) -> None:
    """A ConfigError unless the figure's folder exists and can be written to."""
    folder = Path(png).absolute().parent
    if not folder.is_dir():
        raise ConfigError(f"--png {png}: the folder {folder} does not exist; create it or give another --png")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--png {png}: the folder {folder} is not writable; give another --png")


def main(argv: list[str]) -> int:
    arguments, config_argv = parse_arguments(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(config_argv)
        rows = planned_rows(config.batch.global_batch_size, arguments.micro, world_size)
        if all(row["skipped"] for row in rows):
            raise ConfigError(
                f"--micro: none of {arguments.micro} gives a whole number of accumulation steps ({rows[0]['skipped']})"
            )
        check_device_available(config)
        check_figure_folder(arguments.png)  # before the sweep, which can take minutes
        corpus = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
        vocab_size = resolved_vocab_size(config.model, corpus.vocab_size)
        row_ids = step_row_ids(
            corpus.train.num_rows, config.batch.global_batch_size, config.run.seed, 0, config.batch.tail
        )
    except (ConfigError, DataError) as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    context = setup_distributed(config.device, config.dist.timeout_s)
    try:
        sweep(config, corpus, vocab_size, row_ids, context, rows)
        if not context.is_main:
            return 0
        tolerance = RELATIVE_TOLERANCE[config.precision.dtype]
        agree = gradients_agree(rows, tolerance)
        setting = (
            f"global batch {config.batch.global_batch_size}, {context.world_size} rank(s), "
            f"{context.device}, {config.precision.dtype}"
        )
        # The measurements first: a figure that cannot be written must not cost the table.
        if arguments.json:
            print(json.dumps(rows), flush=True)
        else:
            print(f"sweep: {setting}; the examples of step 0; SGD with lr 0 (no optimizer state); dropout off")
            print(format_table(rows))
            print(
                f"gradients across m: {'agree' if agree else 'DIFFER'} (tolerance {tolerance:g} relative to the "
                f"largest entry, for {config.precision.dtype}; see RELATIVE_TOLERANCE)",
                flush=True,
            )
        try:
            draw_figure(rows, arguments.png, setting)
        except OSError as error:
            print(
                f"error: --png {arguments.png}: the figure could not be written ({error.strerror or error})",
                file=sys.stderr,
            )
            return 1
        if not arguments.json:
            print(f"figure: {arguments.png}")
        return 0 if agree else 1
    finally:
        teardown_distributed()


def planned_rows(global_batch_size: int, micro_batch_sizes: list[int], world_size: int) -> list[dict]:
    """One row per m, in the order given: micro_batch_size, accumulation_steps (A) and skipped (None, or why
    this m cannot be run: A would not be a whole number)."""
    rows = []
    for micro_batch_size in micro_batch_sizes:
        row = {"micro_batch_size": micro_batch_size, "accumulation_steps": None, "skipped": None}
        try:
            row["accumulation_steps"] = accumulation_steps(global_batch_size, micro_batch_size, world_size)
        except ValueError as error:
            row["skipped"] = str(error)
        rows.append(row)
    return rows


def sweep(
    config: Config,
    corpus: Data,
    vocab_size: int,
    row_ids: torch.Tensor,
    context: DistributedContext,
    rows: list[dict],
) -> None:
    """Measure every row that is not skipped, adding tokens, time_s, tokens_per_s, peak_mem_bytes and, on
    rank 0, grad_max_relative_difference against the first measured m."""
    first_gradients = None
    for row in rows:
        if row["skipped"]:
            continue
        try:
            gradients, measurements = measure_one_update(
                config, corpus, vocab_size, row_ids, context, row["micro_batch_size"]
            )
        except torch.OutOfMemoryError:
            if context.world_size > 1:
                raise
            row["skipped"] = OUT_OF_MEMORY
            if context.device.type == "cuda":
                torch.cuda.empty_cache()  # the failed update's blocks, back for the next m
            continue
        if gradients is None:
            row["skipped"] = (
                "no update was applied (non-finite gradient or no supervised tokens): no gradient to compare"
            )
            continue
        row.update(measurements)
        first_gradients = gradients if first_gradients is None else first_gradients
        if context.is_main:
            row["grad_max_relative_difference"] = max_relative_error(gradients, first_gradients)


def measure_one_update(
    config: Config,
    corpus: Data,
    vocab_size: int,
    row_ids: torch.Tensor,
    context: DistributedContext,
    micro_batch_size: int,
):
    """For one m: (the gradients the warm-up update was handed, or None when it was not applied;
    {tokens, time_s, tokens_per_s, peak_mem_bytes})."""
    device = context.device
    # train.py's assembly with this m (model.loss and model.compile decided with it: the chunked loss lets m grow
    # further on a GPU), dropout off so that every m starts from the same weights and draws no masks
    at_this_m = dataclasses.replace(config, batch=dataclasses.replace(config.batch, micro_batch_size=micro_batch_size))
    training = build_training(without_dropout(at_this_m), vocab_size, None, context)
    optimizer, handed = first_update_probe(training.model)
    micro_batches = build_micro_batches(  # row_ids are step 0's, and the rows are as step 0 sees them
        corpus.train,
        row_ids,
        config.batch.global_batch_size,
        micro_batch_size,
        context.world_size,
        context.rank,
        step=0,
    )

    def one_update():
        return training.step(training.setup, micro_batches, optimizer)

    one_update()
    gradients = handed[0] if handed else None

    seconds = math.inf
    for _ in range(TIMED_UPDATES):
        start = time.perf_counter()
        result = one_update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the update's last kernels may still be running
        seconds = min(seconds, time.perf_counter() - start)

    _, peak_bytes = peak_memory_bytes_of(one_update, device)
    if context.world_size > 1:
        # The rank that needed the most memory sets what the run needs.
        peak = torch.tensor([peak_bytes], dtype=torch.int64, device=collective_device(device))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak_bytes = int(peak.item())
    return gradients, {
        "tokens": result.tokens,
        "time_s": seconds,
        "tokens_per_s": result.tokens / seconds,
        "peak_mem_bytes": peak_bytes,
    }


def gradients_agree(rows: list[dict], tolerance: float) -> bool:
    """True when at least one m was measured and every measured m's gradient is within tolerance of the first."""
    measured = [row for row in rows if row["skipped"] is None]
    return bool(measured) and all(row["grad_max_relative_difference"] <= tolerance for row in measured)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'m':>5} {'A':>5} {'tokens/s':>12} {'peak MB':>10} {'grad rel. diff':>15}"]
    for row in rows:
        if row["skipped"] == OUT_OF_MEMORY:
            lines.append(f"{row['micro_batch_size']:>5} {row['accumulation_steps']:>5}  {OUT_OF_MEMORY}")
            continue
        if row["skipped"] is not None:
            lines.append(f"{row['micro_batch_size']:>5} {'-':>5}  skipped: {row['skipped']}")
            continue
        lines.append(
            f"{row['micro_batch_size']:>5} {row['accumulation_steps']:>5} {row['tokens_per_s']:>12,.0f} "
            f"{row['peak_mem_bytes'] / BYTES_PER_MB:>10.1f} {row['grad_max_relative_difference']:>15.2e}"
        )
    return "\n".join(lines)


def draw_figure(rows: list[dict], path: str, title: str) -> None:
    """Two panels against m on a log2 axis: supervised tokens/s, and peak MB of one update."""
    from matplotlib.figure import Figure  # imported here: only this figure needs matplotlib

    measured = [row for row in rows if row["skipped"] is None]
    micro_batch_sizes = [row["micro_batch_size"] for row in measured]
    figure = Figure(figsize=(10, 4), layout="constrained")
    speed_axes, memory_axes = figure.subplots(1, 2)
    speed_axes.plot(micro_batch_sizes, [row["tokens_per_s"] for row in measured], marker="o")
    speed_axes.set_ylabel("supervised tokens / s")
    memory_axes.plot(micro_batch_sizes, [row["peak_mem_bytes"] / BYTES_PER_MB for row in measured], marker="o")
    memory_axes.set_ylabel("peak memory of one update (MB)")
    for axes in (speed_axes, memory_axes):
        axes.set_xscale("log", base=2)
        axes.set_xticks(micro_batch_sizes, labels=[str(m) for m in micro_batch_sizes])
        axes.set_xlabel("micro-batch size m (examples)")
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
