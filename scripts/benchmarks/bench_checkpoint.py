"""Benchmark: fsdp2's checkpoints, the single file gathered on rank 0 against the sharded folder (DCP), side by side.

    python scripts/benchmarks/bench_checkpoint.py          # 2 and 4 gloo ranks, 3 GPT sizes; about a minute
    python scripts/benchmarks/bench_checkpoint.py --json   # one JSON object instead

Each rank builds the GPT, shards it (FSDP2), takes one AdamW update (so the optimizer holds its moments), then:

    save       the old path: the shards gathered whole, tensor by tensor, and rank 0 writing one file
               (accumulation/parallel/fsdp.py's full_*_state_dict, accumulation/run/checkpoint.py's
               save_checkpoint); the sharded one ("sharded": run.sharded_save = "staged", the default):
               accumulation/run/sharded_checkpoint.py's writer, whose save() copies this rank's shards to the
               host and returns while a thread writes them, and finish() waits for the write and publishes the
               folder
    resume     into a fresh sharded model and optimizer: the old path reads the whole file on every rank (its CRC
               pass, then torch.load) and cuts it into shards; the sharded one verifies every file's size, the small
               files' CRC-32s and its share of the shard files' (one file in D, verdicts gathered), reads this
               rank's pieces (dcp.load) and loads them

Figures per rank, the largest over the ranks:

    save_rise_B_per_param    the host memory (resident set, sampled every millisecond) above what the rank held
                             before the save, at its peak, divided by the model's parameters
    resume_rise_B_per_param  the same for the resume, above the fresh sharded model and optimizer
    save_blocked_s           how long training is held up: the whole save for the old path (every rank waits for
                             rank 0's write), save() for the sharded one
    save_total_s             save() + finish(): until the checkpoint is published
    at-once                  the sharded save of a run's last checkpoint and a stop's (and of every one with
                             run.sharded_save = "at_once"): written from the shards where they are (dcp.save, no
                             host copy) and published before it returns
    overlapped               run.sharded_save = "overlapped": written from the live shards in the background, no
                             copy, while the next step's forward and backward run; the update waits for the rest.
                             Its blocked seconds: save() plus the write's time beyond one forward and backward of
                             this benchmark's 2 rows (measured apart, so that the step's memory does not count)
    async_share              1 - blocked/total: the part of a sharded save that runs while training goes on
    resume_s                 the resume, every rank done

Resident-set sampling sees what the allocator took from the system: a figure of a few MB on top of tensors this
small is noise (the table prints the megabytes too). The figures are rank-local; the machine's other work shifts
the seconds.
"""

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accumulation.config.config import load_config  # noqa: E402
from accumulation.models.factory import build_model, count_parameters  # noqa: E402
from accumulation.parallel.distributed import DistributedContext  # noqa: E402
from accumulation.parallel.fsdp import full_model_state_dict, full_optimizer_state_dict, shard_model  # noqa: E402
from accumulation.run.build import build_optimizer  # noqa: E402
from accumulation.run.checkpoint import save_checkpoint  # noqa: E402
from accumulation.run.checkpoint_checks import check_archive  # noqa: E402
from accumulation.run.optimizer_state import load_optimizer_state  # noqa: E402
from accumulation.run.sharded_checkpoint import (  # noqa: E402
    ShardedCheckpointWriter,
    described,
    load_sharded_state,
    verify_files,
    verify_shares_together,
)
from testkit.ranks import run_on_ranks  # noqa: E402

CPU = torch.device("cpu")
SIZES = [(2, 128), (4, 256), (6, 384)]  # (n_layer, d_model): 0.5 M, 3.3 M and 10.8 M parameters
PAGE_BYTES = 4096


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


class PeakRise:
    """The most resident memory above the level at entry while the block runs, sampled every millisecond."""

    def __enter__(self):
        gc.collect()
        self.start = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())
        self.rise = self.peak - self.start


def fresh(config, context):
    model = build_model(config.model, 256, seq_len=config.data.seq_len, seed=0)
    shard_model(model, context, None)
    return model, build_optimizer(config.optim, model, CPU)


def ranks_done(start: float) -> float:
    dist.barrier()
    return time.perf_counter() - start


def measure_worker(rank: int, world_size: int, folder: str, sizes: list) -> list[dict]:
    context = DistributedContext(rank, rank, world_size, CPU, "gloo")
    results = []
    for n_layer, d_model in sizes:
        config = load_config([f"model.n_layer={n_layer}", f"model.d_model={d_model}", "model.n_head=4"])
        model, optimizer = fresh(config, context)
        parameters = count_parameters(model)
        tokens = torch.randint(0, 256, (2, config.data.seq_len))
        model(tokens).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        root = Path(folder) / f"{world_size}_{n_layer}_{d_model}"
        figures = {"world_size": world_size, "parameters": parameters}
        # the old path: gathered whole on rank 0, one file
        dist.barrier()
        with PeakRise() as memory:
            start = time.perf_counter()
            payload = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(optimizer)}
            if rank == 0:
                save_checkpoint(payload, root / "file", 1, keep=1)
            del payload
            figures["old save_blocked_s"] = figures["old save_total_s"] = ranks_done(start)
        figures["old save_rise"] = memory.rise
        # the sharded path
        writer = ShardedCheckpointWriter(root / "sharded", 1, context)
        dist.barrier()
        with PeakRise() as memory:
            start = time.perf_counter()
            payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counters": {"steps": 1}}
            writer.save(payload, optimizer, 1)
            del payload
            figures["sharded save_blocked_s"] = ranks_done(start)
            writer.finish()
            figures["sharded save_total_s"] = ranks_done(start)
        figures["sharded save_rise"] = memory.rise
        # a run's last checkpoint and a stop's: written at once from the shards, no host copy
        dist.barrier()
        with PeakRise() as memory:
            start = time.perf_counter()
            payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counters": {"steps": 2}}
            writer.save(payload, optimizer, 2, "at_once")
            del payload
            figures["at-once save_blocked_s"] = figures["at-once save_total_s"] = ranks_done(start)
        figures["at-once save_rise"] = memory.rise
        # "overlapped": written from the live shards, no copy, while the next step's forward and backward run; that
        # step's update waits for the rest of the write. Measured without the step (its own memory would count):
        # the write's seconds beyond one forward and backward of this benchmark's batch are what training waits.
        forward_start = time.perf_counter()
        model(tokens).float().square().mean().backward()
        forward_backward_s = ranks_done(forward_start)
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        with PeakRise() as memory:
            start = time.perf_counter()
            payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counters": {"steps": 3}}
            writer.save(payload, optimizer, 3, "overlapped")
            del payload
            save_call_s = ranks_done(start)
            writer.wait_for_write()  # what the update's pre-hook does
            written_s = ranks_done(start)
            writer.finish()
            figures["overlapped save_total_s"] = ranks_done(start)
        figures["overlapped save_blocked_s"] = save_call_s + max(0.0, written_s - save_call_s - forward_backward_s)
        figures["overlapped save_rise"] = memory.rise
        # resumes, each into a fresh sharded model and optimizer
        for path in ("old", "sharded"):
            del model, optimizer
            model, optimizer = fresh(config, context)
            dist.barrier()
            with PeakRise() as memory:
                start = time.perf_counter()
                if path == "old":
                    check_archive(root / "file" / "step_000001.pt")  # read_checkpoint without its key checks
                    payload = torch.load(root / "file" / "step_000001.pt", weights_only=True)
                    model.load_state_dict(sharded_like(model, payload["model"]))
                    load_optimizer_state(optimizer, payload["optimizer"], sharded=True)
                else:
                    # as a resume on D ranks: sizes and the small files on each rank, the shard files shared out
                    verify_files(root / "sharded" / "step_000003.dcp", shard_checksums=False)
                    payload = described(root / "sharded" / "step_000003.dcp")
                    verify_shares_together(root / "sharded" / "step_000003.dcp")
                    load_sharded_state(payload, model, optimizer)
                    load_optimizer_state(optimizer, payload["optimizer"])
                del payload
                figures[f"{path} resume_s"] = ranks_done(start)
            figures[f"{path} resume_rise"] = memory.rise
        del model, optimizer
        results.append(figures)
    return results


def sharded_like(model: torch.nn.Module, whole: dict) -> dict:
    """Whole weights cut into this rank's shards, as a resume from the single file does (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    current = model.state_dict()
    return {
        name: distribute_tensor(value, current[name].device_mesh, current[name].placements, src_data_rank=None)
        for name, value in whole.items()
    }


def measure(world_sizes=(2, 4), sizes=SIZES) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as folder:
        for world_size in world_sizes:
            per_rank = run_on_ranks(measure_worker, world_size, (folder, list(sizes)), timeout_s=600)
            for index, figures in enumerate(per_rank[0]):
                row = dict(figures)
                for key in figures:  # the worst rank
                    if key.endswith("_rise") or key.endswith("_s"):
                        row[key] = max(ranks[index][key] for ranks in per_rank)
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'D':>2} {'params':>11} {'path':<10} {'save B/param':>12} {'(MB)':>7} {'blocked s':>9} {'total s':>8} "
        f"{'async':>6} {'resume B/param':>14} {'(MB)':>7} {'resume s':>8}"
    ]
    for row in rows:
        for path in ("old", "sharded", "at-once", "overlapped"):
            blocked, total = row[f"{path} save_blocked_s"], row[f"{path} save_total_s"]
            save, resume = row[f"{path} save_rise"], row.get(f"{path} resume_rise")
            resumed = (
                ""
                if resume is None
                else (f" {resume / row['parameters']:>14.2f} {resume / 2**20:>7.1f} {row[f'{path} resume_s']:>8.3f}")
            )
            lines.append(
                f"{row['world_size']:>2} {row['parameters']:>11,} {path:<10} {save / row['parameters']:>12.2f} "
                f"{save / 2**20:>7.1f} {blocked:>9.3f} {total:>8.3f} {1 - blocked / total:>6.0%}" + resumed
            )
        ratios = [row[f"{path} save_blocked_s"] / row["old save_blocked_s"] for path in ("sharded", "overlapped")]
        lines.append(f"{'':>26}sharded blocked / old blocked = {ratios[0]:.2f}, overlapped / old = {ratios[1]:.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args(argv)
    rows = measure()
    print(
        json.dumps(rows, indent=1)
        if arguments.json
        else f"torch {torch.__version__}; gloo ranks on the CPU\n" + table(rows)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
