"""Benchmark: pipeline parallelism with P = 2 stages on CPU gloo, each figure a ratio to what it should be.

    python scripts/benchmarks/bench_pipeline.py           # a table, about a minute on a 2-core CPU
    python scripts/benchmarks/bench_pipeline.py --json    # one JSON object instead

A toy token model (an embedding, residual MLP blocks, a norm and a head) cut by hand into two stages of equal
work, run by torch.distributed.pipelining's own schedules with the loss S_mb · D / N and scale_grads=False.
Two launches of gloo ranks on this machine:

1. P = 2, D = 1 on 2 ranks, Schedule1F1B (and ScheduleGPipe at one A): the bubble. Every rank times each
   stage compute (forward_one_chunk, backward_one_chunk) of one schedule.step; the rest of the step's wall
   time is idle. With equal stages and free transfers each rank idles (P - 1) / (A + P - 1) of the step:
   it waits P - 1 slots for the first micro-batch to reach it (or, at the end, for the last one's gradient
   to come back) and works A.
       bubble            1 - busy / wall, the mean over ranks (median of repeats)   target (P-1)/(A+P-1)
2. P = 2, D = 2 on 4 ranks (a 2 x 2 mesh, DDP over each stage's replicas), then DDP on the same 4 ranks with
   the same global batch (m the same, A halved, the project's optimizer_step): the counts and the memory.
       p2p_forward_bytes_per_micro_batch   what stage 0 sends stage 1 per micro-batch    target = activation
       p2p_backward_bytes_per_micro_batch  what stage 1 sends back (its input's grad)     target = activation
       grad_bytes_per_stage_per_update     DDP's all-reduce over the stage's replicas     target = stage grad
       peak_bytes_per_rank                 parameters + optimizer state + the update's peak (activations,
                                           gradients), the most of any rank; PP against DDP: reported.
                                           DDP's bucket buffers (made before the update, a gradient's size
                                           in both runs) are not in it

Counts (bytes) are properties of the code and are what tests/test_bench_pipeline.py asserts; times depend on
the machine and its load, so the bubble is printed, never asserted. The byte counts wrap the stage's own
methods that build its sends (get_fwd_send_ops, get_bwd_send_ops) and DDP's comm hook; nothing is replaced.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

# Run as `python scripts/benchmarks/bench_pipeline.py`, Python puts only this file's folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accumulation.batching import MicroBatch
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.memory import peak_memory_bytes_of
from testkit.ranks import run_on_ranks

CPU = torch.device("cpu")
PIPELINE_STAGES = 2  # P
MESH_REPLICAS = 2  # D of the second launch
VOCAB_SIZE = 256
SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int = 256  # d_model
    blocks_per_stage: int = 2
    seq_len: int = 64
    micro_batch_size: int = 8  # m: rows per micro-batch, per replica
    accumulation_steps: tuple[int, ...] = (2, 4, 8)  # the A swept (1F1B refuses A < P); the last is the mesh's A
    repeats: int = 3

    @property
    def activation_bytes(self) -> int:
        """One micro-batch's activation at the cut: m rows x seq_len positions x width floats."""
        return self.micro_batch_size * self.seq_len * self.width * 4


class Block(nn.Module):
    """x + MLP(LayerNorm(x)): the same work at every depth, so two stages of equal block counts cost the same."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def two_stage_model(sizes: Sizes) -> nn.Sequential:
    """Stage 0: embedding and the first blocks; stage 1: the last blocks, the final norm and the head. The
    embedding and the head (width x 256, an eighth of a block) are the only work the stages do not share."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = nn.Sequential(
            nn.Embedding(VOCAB_SIZE, sizes.width), *(Block(sizes.width) for _ in range(sizes.blocks_per_stage))
        )
        last = nn.Sequential(
            *(Block(sizes.width) for _ in range(sizes.blocks_per_stage)),
            nn.LayerNorm(sizes.width),
            nn.Linear(sizes.width, VOCAB_SIZE),
        )
    return nn.Sequential(first, last)


def step_tokens(sizes: Sizes, accumulation_steps: int, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One replica's A · m rows of a step: random byte tokens and next-token labels, every target supervised."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(
        VOCAB_SIZE, (accumulation_steps * sizes.micro_batch_size, sizes.seq_len + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


class StageMeter:
    """Wraps one PipelineStage's compute and send-building methods: seconds busy computing, and bytes handed
    to point-to-point sends, forward (activations) and backward (input gradients)."""

    def __init__(self, stage: PipelineStage):
        self.busy_s = 0.0
        self.forward_bytes = self.backward_bytes = 0
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, name, self.timed(getattr(stage, name)))
        stage.get_fwd_send_ops = self.counted(stage.get_fwd_send_ops, "forward_bytes")
        stage.get_bwd_send_ops = self.counted(stage.get_bwd_send_ops, "backward_bytes")

    def reset(self) -> None:
        self.busy_s = 0.0
        self.forward_bytes = self.backward_bytes = 0

    def timed(self, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - start

        return wrapper

    def counted(self, method, field: str):
        def wrapper(*args, **kwargs):
            ops = method(*args, **kwargs)
            setattr(self, field, getattr(self, field) + sum(op.tensor.numel() * op.tensor.element_size() for op in ops))
            return ops

        return wrapper


def pipelined(
    stage_module: nn.Module,
    stage_index: int,
    accumulation_steps: int,
    tokens_global: int,
    replicas: int,
    schedule_name: str = "1F1B",
    group=None,
):
    """A PipelineStage for this rank's stage and its schedule over A micro-batches with the exact loss."""

    def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # S_mb · D / N: the micro-batches of all D replicas sum to the token mean Σ S_mb / N once DDP's mean
        # over a stage's D replicas has divided by the D that the loss multiplied in
        return token_cross_entropy_sum(outputs, labels) * replicas / tokens_global

    stage = PipelineStage(stage_module, stage_index, PIPELINE_STAGES, CPU, group=group)
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=accumulation_steps, loss_fn=loss_fn, scale_grads=False)
    return stage, schedule


def run_step(schedule, stage_index: int, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    if stage_index == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=labels)


# ---------------------------------------------------------------------------------------------------------
# Launch 1: the bubble, P = 2 and D = 1 on 2 ranks.
# ---------------------------------------------------------------------------------------------------------


def bubble_on_rank(rank: int, world_size: int, sizes: Sizes) -> dict:
    """This rank's idle fraction of each timed schedule.step, per schedule and A."""
    assert world_size == PIPELINE_STAGES
    model = two_stage_model(sizes)
    runs = [("1F1B", a) for a in sizes.accumulation_steps] + [("GPipe", sizes.accumulation_steps[-1])]
    idle = {}
    for schedule_name, accumulation_steps in runs:
        tokens_global = accumulation_steps * sizes.micro_batch_size * sizes.seq_len
        stage, schedule = pipelined(model[rank], rank, accumulation_steps, tokens_global, 1, schedule_name)
        meter = StageMeter(stage)
        fractions = []
        for step in range(sizes.repeats + 1):  # step 0 warms up (the stage infers shapes, buffers are made)
            inputs, labels = step_tokens(sizes, accumulation_steps, 0, step)
            meter.reset()
            dist.barrier()  # both stages start the step together
            start = time.perf_counter()
            run_step(schedule, rank, inputs, labels)
            wall_s = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step > 0:
                fractions.append(1 - meter.busy_s / wall_s)
        idle[f"{schedule_name} A={accumulation_steps}"] = fractions
    return idle


# ---------------------------------------------------------------------------------------------------------
# Launch 2: the counts and the memory, P = 2 x D = 2 on 4 ranks, then DDP on the same 4 ranks.
# ---------------------------------------------------------------------------------------------------------


def counting_group_allreduce_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce of one bucket over state["group"] (a stage's replicas, not every rank),
    adding its bytes to state["bytes"]."""
    state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(state["group"], bucket)


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters and optimizer state: what a rank holds between updates (gradients are set to None)."""
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    state = sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return parameters + state


def mesh_on_rank(rank: int, world_size: int, sizes: Sizes) -> dict:
    """One rank's counts and peak bytes: first as a stage of the 2 x 2 mesh, then as a DDP replica."""
    assert world_size == PIPELINE_STAGES * MESH_REPLICAS
    accumulation_steps = sizes.accumulation_steps[-1]
    mesh = init_device_mesh("cpu", (MESH_REPLICAS, PIPELINE_STAGES), mesh_dim_names=("dp", "pp"))
    replica, stage_index = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    tokens_global = MESH_REPLICAS * accumulation_steps * sizes.micro_batch_size * sizes.seq_len  # N, all supervised
    figures = {"stage": stage_index}

    # The pipeline: this rank's stage, its gradient averaged over the stage's replicas by DDP (which the stage
    # keeps in no_sync until the last micro-batch's backward), AdamW.
    stage_module = two_stage_model(sizes)[stage_index]
    figures["stage_grad_bytes"] = sum(p.numel() * p.element_size() for p in stage_module.parameters())
    replicated = DistributedDataParallel(stage_module, process_group=mesh["dp"].get_group())
    allreduced = {"bytes": 0, "group": mesh["dp"].get_group()}
    replicated.register_comm_hook(allreduced, counting_group_allreduce_hook)
    stage, schedule = pipelined(
        replicated, stage_index, accumulation_steps, tokens_global, MESH_REPLICAS, group=mesh["pp"].get_group()
    )
    meter = StageMeter(stage)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)

    def pipelined_update(step: int) -> None:
        run_step(schedule, stage_index, *step_tokens(sizes, accumulation_steps, replica, step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    pipelined_update(0)  # warm-up: shapes inferred, AdamW's state made
    meter.reset()
    allreduced["bytes"] = 0
    pipelined_update(1)
    figures["p2p_forward_bytes_per_micro_batch"] = meter.forward_bytes / accumulation_steps
    figures["p2p_backward_bytes_per_micro_batch"] = meter.backward_bytes / accumulation_steps
    figures["grad_bytes_per_update"] = allreduced["bytes"]
    _, peak_step_bytes = peak_memory_bytes_of(lambda: pipelined_update(2), CPU)
    figures["pipeline_peak_bytes"] = held_bytes(stage_module, optimizer) + peak_step_bytes

    # DDP on the same 4 ranks at the same global batch and m: G = m · A · D_pp = m · A_ddp · 4 ranks, so
    # A_ddp = A · 2 / 4 = A / 2 micro-batches per rank, each rank holding the whole model.
    ddp_accumulation_steps = accumulation_steps * MESH_REPLICAS // world_size
    model = two_stage_model(sizes)
    ddp = DistributedDataParallel(model)
    ddp_allreduced = {"bytes": 0, "group": None}  # None: every rank
    ddp.register_comm_hook(ddp_allreduced, counting_group_allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def ddp_update(step: int) -> None:
        inputs, labels = step_tokens(sizes, ddp_accumulation_steps, rank, step)
        micro_batches = [
            MicroBatch(i, lab, sizes.micro_batch_size)
            for i, lab in zip(inputs.split(sizes.micro_batch_size), labels.split(sizes.micro_batch_size), strict=True)
        ]
        optimizer_step(StepSetup(ddp, CPU), micro_batches, optimizer)

    ddp_update(0)
    ddp_allreduced["bytes"] = 0
    ddp_update(1)
    figures["ddp_grad_bytes_per_update"] = ddp_allreduced["bytes"]
    _, peak_step_bytes = peak_memory_bytes_of(lambda: ddp_update(2), CPU)
    figures["ddp_peak_bytes"] = held_bytes(model, optimizer) + peak_step_bytes
    return figures


def mesh_summary(mesh_per_rank: list[dict], sizes: Sizes) -> dict:
    """The counts and the memory of launch 2, by stage: what the table prints and the tests assert."""
    by_stage = {s: [r for r in mesh_per_rank if r["stage"] == s] for s in range(PIPELINE_STAGES)}
    return {
        "activation_bytes": sizes.activation_bytes,
        "p2p_forward_bytes_per_micro_batch": by_stage[0][0]["p2p_forward_bytes_per_micro_batch"],
        "p2p_backward_bytes_per_micro_batch": by_stage[PIPELINE_STAGES - 1][0]["p2p_backward_bytes_per_micro_batch"],
        "stage_grad_bytes": [by_stage[s][0]["stage_grad_bytes"] for s in range(PIPELINE_STAGES)],
        # Every replica of a stage all-reduces the same bucket bytes; a set of one value per stage says so.
        "grad_bytes_per_stage_per_update": [
            sorted({r["grad_bytes_per_update"] for r in by_stage[s]}) for s in range(PIPELINE_STAGES)
        ],
        "ddp_grad_bytes_per_update": mesh_per_rank[0]["ddp_grad_bytes_per_update"],
        "pipeline_peak_bytes_per_rank": max(r["pipeline_peak_bytes"] for r in mesh_per_rank),
        "ddp_peak_bytes_per_rank": max(r["ddp_peak_bytes"] for r in mesh_per_rank),
    }


def measure(sizes: Sizes, timeout_s: float = 600) -> dict:
    bubble_per_rank = run_on_ranks(bubble_on_rank, world_size=PIPELINE_STAGES, args=(sizes,), timeout_s=timeout_s)
    mesh_per_rank = run_on_ranks(
        mesh_on_rank, world_size=PIPELINE_STAGES * MESH_REPLICAS, args=(sizes,), timeout_s=timeout_s
    )
    # The bubble of a step is the mean over the ranks of their idle fractions; the median over repeats
    # keeps one step slowed by the machine's other work from deciding the figure.
    bubble = {
        run: statistics.median(statistics.mean(rank[run][k] for rank in bubble_per_rank) for k in range(sizes.repeats))
        for run in bubble_per_rank[0]
    }
    summary = mesh_summary(mesh_per_rank, sizes)
    return {"sizes": dataclasses.asdict(sizes), "bubble": bubble, **summary, "mesh_per_rank": mesh_per_rank}


def theoretical_bubble(accumulation_steps: int) -> float:
    return (PIPELINE_STAGES - 1) / (accumulation_steps + PIPELINE_STAGES - 1)


def table(results: dict) -> list[tuple[str, str, str, str]]:
    """(measure, value, target, ratio) rows."""
    rows = []
    for run, measured in results["bubble"].items():
        accumulation_steps = int(run.split("A=")[1])
        theory = theoretical_bubble(accumulation_steps)
        rows.append((f"bubble {run}", f"{measured:.3f}", f"(P-1)/(A+P-1) = {theory:.3f}", f"{measured / theory:.2f}"))
    activation = results["activation_bytes"]
    for name in ("p2p_forward_bytes_per_micro_batch", "p2p_backward_bytes_per_micro_batch"):
        value = results[name]
        rows.append((name, f"{value:,.0f}", f"activation {activation:,}", f"{value / activation:.3f}"))
    for stage, (counts, grad_bytes) in enumerate(
        zip(results["grad_bytes_per_stage_per_update"], results["stage_grad_bytes"], strict=True)
    ):
        value = counts[0] if len(counts) == 1 else counts  # the same on every replica of the stage
        ratio = f"{value / grad_bytes:.3f}" if len(counts) == 1 else "replicas differ"
        rows.append((f"grad_bytes_per_update stage {stage}", f"{value:,}", f"stage grad {grad_bytes:,}", ratio))
    ddp = results["ddp_grad_bytes_per_update"]
    rows.append(
        (
            "grad_bytes_per_update ddp",
            f"{ddp:,}",
            f"whole grad {sum(results['stage_grad_bytes']):,}",
            f"{ddp / sum(results['stage_grad_bytes']):.3f}",
        )
    )
    pipeline, ddp_peak = results["pipeline_peak_bytes_per_rank"], results["ddp_peak_bytes_per_rank"]
    rows.append(("peak_bytes_per_rank pipeline", f"{pipeline:,}", f"ddp {ddp_peak:,}", f"{pipeline / ddp_peak:.3f}"))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    arguments = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = Sizes()
    results = measure(sizes)
    if arguments.json:
        print(json.dumps(results))
        return 0
    print(
        f"torch {torch.__version__}; P = {PIPELINE_STAGES} stages of {sizes.blocks_per_stage} blocks, width "
        f"{sizes.width}, seq_len {sizes.seq_len}, m = {sizes.micro_batch_size}; bubble: D = 1 on 2 gloo ranks, "
        f"median of {sizes.repeats} steps; counts and memory: D = {MESH_REPLICAS} on 4 gloo ranks, "
        f"A = {sizes.accumulation_steps[-1]}, against DDP on the same 4 ranks at the same global batch; AdamW"
    )
    print()
    print(f"{'measure':<38}{'value':<16}{'target':<30}ratio")
    for name, value, target, ratio in table(results):
        print(f"{name:<38}{value:<16}{target:<30}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
