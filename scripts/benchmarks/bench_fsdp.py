"""Benchmark: what FSDP2 (dist.strategy = "fsdp2") communicates and what it saves, against DDP.

    python scripts/benchmarks/bench_fsdp.py           # a table, about half a minute on a 2-core CPU
    python scripts/benchmarks/bench_fsdp.py --json    # one JSON object instead

The project's default model (configs/default.toml: 875,264 parameters, 4 transformer blocks), AdamW, m = 4 rows
of 128 tokens, A = 4 micro-batches per rank on D = 2 gloo ranks of the CPU; the rows are cut from this
project's own source files. Each strategy runs one warm-up update (AdamW creates its state), then the
measured ones:

    grad_bytes                       bytes of the whole fp32 gradient (the model's parameters x 4)
    reduce_scatter_bytes_per_update  bytes one rank feeds FSDP2's reduce-scatters in one update: the whole
                                     gradient, each parameter padded to a multiple of D rows   target = padded grad
    reduce_scatters_per_update       one per FSDP2 group: each block and the root              target = groups
    reduce_scatters_before_last      during the A - 1 micro-batches before the last            target 0
    sync_every_bytes_per_update      the same with synchronisation on in every micro-batch     contrast: A x
    all_gather_bytes_per_update      what FSDP2 sends instead of keeping whole weights: every group's weights
                                     before its forward and (but the root's) before its backward, per micro-batch
    ddp_allreduce_bytes_per_update   DDP's one gradient all-reduce, for comparison
    state_bytes_per_rank             parameters + gradients + optimizer state one rank holds at the optimizer
                                     step, DDP and FSDP2                                       target fsdp2/ddp ~ 1/D
    peak_step_bytes                  the most bytes one update holds at once beyond what it began with
                                     (activations, and under FSDP2 the all-gathered weights and the whole
                                     gradient that accumulates unsharded until the last micro-batch)

Counts are properties of the code; the bytes of memory are the tensors' own sizes (peak: the profiler's record
of every allocation on the CPU, testkit/memory.py). The functions are importable: tests/test_fsdp.py counts
collectives with `counting_fsdp_collectives`.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from accumulation.config.config import Config, load_config
from accumulation.data.rows import BYTE_VOCAB_SIZE, RowSet, make_rows
from accumulation.data.sources import step_row_ids
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.factory import build_model
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import build_training
from testkit.memory import peak_memory_bytes_of
from testkit.ranks import run_on_ranks
from testkit.reference import counting_allreduce_hook

RANKS = 2  # D
MICRO_BATCH_SIZE = 4  # m
ACCUMULATION_STEPS = 4  # A on each rank
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
TARGET_STATE_RATIO_SLACK = 1.05  # fsdp2 / ddp state bytes at most 1.05 / D: padding and AdamW's step counters


@contextlib.contextmanager
def counting_fsdp_collectives(counts: dict):
    """Count FSDP2's reduce-scatters and all-gathers while inside: calls and the bytes each rank feeds them.
    FSDP2 (torch 2.13) calls torch.distributed.reduce_scatter_single and all_gather_single; each is wrapped,
    not replaced, so the training is the same."""
    counts.update(reduce_scatters=0, reduce_scatter_bytes=0, all_gathers=0, all_gather_bytes=0)
    reduce_scatter, all_gather = dist.reduce_scatter_single, dist.all_gather_single

    def counted_reduce_scatter(*args, **kwargs):
        tensor = kwargs["input"]  # the whole gradient of a group, flattened and padded
        counts["reduce_scatters"] += 1
        counts["reduce_scatter_bytes"] += tensor.numel() * tensor.element_size()
        return reduce_scatter(*args, **kwargs)

    def counted_all_gather(output_tensor, input_tensor, *args, **kwargs):
        counts["all_gathers"] += 1
        counts["all_gather_bytes"] += input_tensor.numel() * input_tensor.element_size()  # this rank's shard
        return all_gather(output_tensor, input_tensor, *args, **kwargs)

    with (
        mock.patch.object(dist, "reduce_scatter_single", counted_reduce_scatter),
        mock.patch.object(dist, "all_gather_single", counted_all_gather),
    ):
        yield counts


@contextlib.contextmanager
def sync_in_every_micro_batch():
    """FSDP2's no_sync bypassed: the step's set_requires_gradient_sync(False) is ignored (for contrast)."""
    original = FSDPModule.set_requires_gradient_sync
    with mock.patch.object(
        FSDPModule, "set_requires_gradient_sync", lambda module, _sync, **kwargs: original(module, True, **kwargs)
    ):
        yield


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: its shard for a DTensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def padded_gradient_bytes(model_config: Config, world_size: int) -> int:
    """The whole fp32 gradient with every parameter padded to a multiple of `world_size` rows, as FSDP2
    lays it out for its reduce-scatter."""
    with torch.device("meta"):
        model = build_model(
            model_config.model, BYTE_VOCAB_SIZE, seq_len=model_config.data.seq_len, seed=model_config.run.seed
        )
    total = 0
    for param in model.parameters():
        rows = -(-param.shape[0] // world_size) * world_size
        total += rows * (param.numel() // param.shape[0]) * param.element_size()
    return total


def bench_config(strategy_name: str, overrides: tuple[str, ...] = ()) -> Config:
    """The default model and optimizer; the batch of this benchmark. `overrides`: more section.key=value settings
    (tests/test_fsdp.py runs the benchmark on a smaller model)."""
    global_batch_size = MICRO_BATCH_SIZE * ACCUMULATION_STEPS * RANKS
    return load_config(
        [
            f"dist.strategy={strategy_name}",
            f"batch.micro_batch_size={MICRO_BATCH_SIZE}",
            f"batch.global_batch_size={global_batch_size}",
            *overrides,
        ]
    )


def source_rows(seq_len: int) -> RowSet:
    """Rows of this project's own Python files: real text, no corpus to read."""
    documents = [path.read_bytes() for path in sorted((REPO / "accumulation").glob("*.py"))]
    return make_rows(documents, seq_len)


def step_batches(config: Config, rows: RowSet, step: int, world_size: int, rank: int) -> list:
    global_batch_size = config.batch.global_batch_size
    row_ids = step_row_ids(rows.num_rows, global_batch_size, config.run.seed, step, config.batch.tail)
    return build_micro_batches(
        rows, row_ids, global_batch_size, config.batch.micro_batch_size, world_size, rank, step=step
    )


def measure_on_rank(rank: int, world_size: int, strategy_name: str, overrides: tuple[str, ...] = ()) -> dict:
    """One rank's figures for one strategy, "ddp" or "fsdp2" (run by run_on_ranks)."""
    config = bench_config(strategy_name, overrides)
    rows = source_rows(config.data.seq_len)
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    training = build_training(config, BYTE_VOCAB_SIZE, None, context)  # train.py's assembly: DDP or FSDP2's shards
    model, wrapped, optimizer, setup = training.model, training.setup.module, training.optimizer, training.setup
    figures = {}
    batches = iter(step_batches(config, rows, step, world_size, rank) for step in range(4))
    training.step(setup, next(batches), optimizer)  # warm-up: AdamW creates its state

    def held_at_optimizer_step(opt, args, kwargs):
        parameters = list(model.parameters())
        figures["param_bytes"] = sum(local_bytes(p) for p in parameters)
        figures["grad_bytes_held"] = sum(local_bytes(p.grad) for p in parameters if p.grad is not None)
        figures["optimizer_state_bytes"] = sum(
            local_bytes(value) for state in opt.state.values() for value in state.values()
        )

    hook = optimizer.register_step_pre_hook(held_at_optimizer_step)
    if strategy_name == "ddp":
        allreduced = {"bytes": 0}
        wrapped.register_comm_hook(allreduced, counting_allreduce_hook)
        training.step(setup, next(batches), optimizer)
        figures["ddp_allreduce_bytes_per_update"] = allreduced["bytes"]
    else:
        counts, seen_at_forward = {}, []
        wrapped.register_forward_pre_hook(lambda module, args: seen_at_forward.append(counts["reduce_scatters"]))
        with counting_fsdp_collectives(counts):
            training.step(setup, next(batches), optimizer)
        figures["reduce_scatters_per_update"] = counts["reduce_scatters"]
        figures["reduce_scatter_bytes_per_update"] = counts["reduce_scatter_bytes"]
        figures["all_gather_bytes_per_update"] = counts["all_gather_bytes"]
        figures["reduce_scatters_before_last"] = seen_at_forward[-1]  # done before the last forward began
        with counting_fsdp_collectives(counts), sync_in_every_micro_batch():
            training.step(setup, next(batches), optimizer)
        figures["sync_every_bytes_per_update"] = counts["reduce_scatter_bytes"]
    hook.remove()
    _, figures["peak_step_bytes"] = peak_memory_bytes_of(lambda: training.step(setup, next(batches), optimizer), CPU)
    figures["state_bytes_per_rank"] = (
        figures["param_bytes"] + figures["grad_bytes_held"] + figures["optimizer_state_bytes"]
    )
    return figures


def measure(overrides: tuple[str, ...] = ()) -> dict:
    config = bench_config("fsdp2", overrides)
    with torch.device("meta"):
        model = build_model(config.model, BYTE_VOCAB_SIZE, seq_len=config.data.seq_len, seed=config.run.seed)
    parameters = sum(p.numel() for p in model.parameters())
    results = {
        "parameters": parameters,
        "groups": len(model.fsdp_units()) + 1,
        "grad_bytes": parameters * 4,
        "padded_grad_bytes": padded_gradient_bytes(config, RANKS),
    }
    for strategy_name in ("ddp", "fsdp2"):
        per_rank = run_on_ranks(measure_on_rank, world_size=RANKS, args=(strategy_name, overrides), timeout_s=600)
        results[strategy_name] = per_rank[0]
        results[strategy_name]["state_bytes_per_rank_max"] = max(r["state_bytes_per_rank"] for r in per_rank)
    return results


def table(results: dict) -> list[tuple[str, str, str, str]]:
    """(measure, value, target, mark) rows."""
    ddp, fsdp = results["ddp"], results["fsdp2"]

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    state_ratio = fsdp["state_bytes_per_rank_max"] / ddp["state_bytes_per_rank_max"]
    peak_ratio = fsdp["peak_step_bytes"] / ddp["peak_step_bytes"]
    padded = results["padded_grad_bytes"]
    scattered = fsdp["reduce_scatter_bytes_per_update"]
    return [
        ("grad_bytes", f"{results['grad_bytes']:,}", "", ""),
        (
            "reduce_scatter_bytes_per_update",
            f"{scattered:,} ({scattered / results['grad_bytes']:.4f} x grad_bytes)",
            f"= padded grad {padded:,}",
            mark(scattered == padded),
        ),
        (
            "reduce_scatters_per_update",
            str(fsdp["reduce_scatters_per_update"]),
            f"= groups ({results['groups']})",
            mark(fsdp["reduce_scatters_per_update"] == results["groups"]),
        ),
        (
            "reduce_scatters_before_last",
            str(fsdp["reduce_scatters_before_last"]),
            "0",
            mark(fsdp["reduce_scatters_before_last"] == 0),
        ),
        (
            "sync_every_bytes_per_update",
            f"{fsdp['sync_every_bytes_per_update']:,}",
            f"contrast: {ACCUMULATION_STEPS} x padded grad",
            "",
        ),
        ("all_gather_bytes_per_update", f"{fsdp['all_gather_bytes_per_update']:,}", "reported", ""),
        ("ddp_allreduce_bytes_per_update", f"{ddp['ddp_allreduce_bytes_per_update']:,}", "= grad_bytes", ""),
        ("state_bytes_per_rank ddp", f"{ddp['state_bytes_per_rank_max']:,}", "", ""),
        (
            "state_bytes_per_rank fsdp2",
            f"{fsdp['state_bytes_per_rank_max']:,} ({state_ratio:.4f} x ddp)",
            f"<= {TARGET_STATE_RATIO_SLACK / RANKS:.3f} x ddp",
            mark(state_ratio <= TARGET_STATE_RATIO_SLACK / RANKS),
        ),
        ("peak_step_bytes ddp", f"{ddp['peak_step_bytes']:,}", "", ""),
        ("peak_step_bytes fsdp2", f"{fsdp['peak_step_bytes']:,} ({peak_ratio:.3f} x ddp)", "reported", ""),
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    arguments = parser.parse_args(argv)
    results = measure()
    rows = table(results)
    if arguments.json:
        print(json.dumps({**results, "marks": {name: mark for name, _, _, mark in rows if mark}}))
    else:
        print(
            f"torch {torch.__version__}; model: {results['parameters']:,} parameters, {results['groups']} FSDP2 "
            f"groups; m = {MICRO_BATCH_SIZE}, A = {ACCUMULATION_STEPS}, D = {RANKS} gloo ranks on the CPU, AdamW"
        )
        print()
        print(f"{'measure':<33}{'value':<40}{'target':<28}mark")
        for name, value, target, mark in rows:
            print(f"{name:<33}{value:<40}{target:<28}{mark}")
    return 0 if all(mark != "FAIL" for *_, mark in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
