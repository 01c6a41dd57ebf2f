"""Which group averages, which sums, and what the × D must be: every reduction topology of accumulation.md
section 22, measured on 4 gloo ranks on this CPU.

    python scripts/teaching/reduction_topology.py [--json]

Every layout trains the same step: a global batch of 16 rows (1 to 8 supervised targets each), one SGD update,
in float64. Each rank backpropagates loss = S · f / N per micro-batch, S its sum of token losses, N the
supervised targets of the whole step (every rank, every micro-batch, every CP rank's part of a row), and f the
factor under test. The layout's reduction then combines the ranks' gradients. The right f is the size of the
group that AVERAGES the parameter's gradient (1 where every reduction sums); each row runs once with the right
f and once with a wrong one, and prints the relative error of the applied update against one float64 update
from the full batch's token-mean gradient (max |Δ - Δ_ref| / max |Δ_ref|). Rounding costs a few 1e-14 (see
ROUNDING_BOUND); a wrong factor costs |f_wrong / f - 1|, 0.5 and more.

The layouts, on the 4 ranks:
  DDP            4 data ranks; DDP all-reduces the mean
  FSDP2          4 shards; reduce-scatter with the mean, in every micro-batch or deferred to the last
                 (set_requires_gradient_sync, set_reshard_after_backward), or summed
                 (set_gradient_divide_factor(1.0), as torchtitan does)
  HSDP           2 replicas × 2 shards: reduce-scatter over the shard pair, all-reduce over the replica pair,
                 the mean over all 4; the all-reduce in every micro-batch or once (set_requires_all_reduce)
  pipeline       2 stages × 2 replicas: each stage's DDP over its 2 replicas; Schedule1F1B, scale_grads=False
  CP             2 CP ranks × 2 data ranks: each CP rank holds half of every row's targets (a simulation:
                 the toy model has no attention, so a row's halves need nothing from each other)
  experts        4 data ranks, experts parallel over pairs (EP = 2): an expert's gradient reaches its host
                 summed over the EP pair (the all-to-all's backward, simulated by a sum), then is averaged over
                 the 2 hosts of the same expert
"""

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# Run as a script, Python puts only this file's folder on sys.path: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks.bench_fsdp import counting_fsdp_collectives  # noqa: E402
from testkit.ranks import run_on_ranks  # noqa: E402

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 16, 8, 8
RANKS, MICRO_BATCH_SIZE, ACCUMULATION_STEPS = 4, 2, 2  # world size, m, A
LR = 0.1  # SGD: the update is -LR · gradient, so its relative error is the gradient's
# What a right factor's residue is printed as. The update is read as weights after minus weights before, which
# carries the weights' own rounding: an ulp of a weight near 1 (2.2e-16) against updates of about 1e-2, a few
# 1e-14 of the largest entry; its digits depend on the CPU's reduction order. 1e-12 bounds it with room; a
# wrong factor costs 0.5 or more.
ROUNDING_BOUND = 1e-12
ROWS = 16  # the global batch: 4 shards of A · m rows, or 2 shards of 2 A · m rows


# ---------------------------------------------------------------------------------------------------------
# The step, the models and the reference.
# ---------------------------------------------------------------------------------------------------------


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ROWS rows of (inputs, labels); each row supervises 1 to SEQ_LEN targets."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(VOCAB_SIZE, (ROWS, SEQ_LEN), generator=generator)
    targets = torch.randint(VOCAB_SIZE, (ROWS, SEQ_LEN), generator=generator)
    lengths = torch.randint(1, SEQ_LEN + 1, (ROWS, 1), generator=generator)
    return inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)


def shard(shard_index: int, shards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One data shard's micro-batches of m rows: the global batch cut into `shards` contiguous shards."""
    inputs, labels = global_batch()
    rows = ROWS // shards
    first = shard_index * rows
    return [
        (inputs[start : start + MICRO_BATCH_SIZE], labels[start : start + MICRO_BATCH_SIZE])
        for start in range(first, first + rows, MICRO_BATCH_SIZE)
    ]


def step_tokens() -> int:
    """N: the supervised targets of the whole step, counted on the host (every rank knows the global batch)."""
    return int((global_batch()[1] != IGNORE_INDEX).sum())


def dense_model() -> nn.Sequential:
    """A token model of two halves (the pipeline's two stages): embed and mix, then mix and project."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)
        )
    return model.double()


class ExpertModel(nn.Module):
    """A token model with one mixture-of-experts layer of 2 experts: a token goes to expert (token id mod 2)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB_SIZE, WIDTH)
            self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
            self.head = nn.Linear(WIDTH, VOCAB_SIZE)
        self.double()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(inputs))
        routed = inputs.remainder(2).unsqueeze(-1) == 0
        # Each expert sees only its tokens (the other's output is masked out, so no gradient reaches it).
        mixed = torch.where(routed, self.experts[0](hidden), self.experts[1](hidden))
        return self.head(torch.tanh(hidden + mixed))


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """S: the sum of the token losses over the supervised targets."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def reference_update(model: nn.Module) -> list[torch.Tensor]:
    """-LR · ∇ of the mean loss over every supervised target of the step, as one float64 batch."""
    inputs, labels = global_batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    return [-LR * g for g in torch.autograd.grad(loss, list(model.parameters()))]


def relative_error(update: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    largest = max(float(r.abs().max()) for r in reference)
    return max(float((u - r).abs().max()) for u, r in zip(update, reference, strict=True)) / largest


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (a collective: every rank calls it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def sgd_update(model: nn.Module, parameters=None) -> list[torch.Tensor]:
    """Apply one SGD step to `parameters` (default: all) and return the whole applied update of each."""
    parameters = list(model.parameters()) if parameters is None else parameters
    with torch.no_grad():
        before = [full(p).clone() for p in parameters]
        torch.optim.SGD(parameters, lr=LR).step()
        return [full(p) - b for p, b in zip(parameters, before, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# The layouts. Each runs on every rank with the factor f and returns the applied update (where a rank holds
# only part of the model, its part); FSDP2's layouts count their collectives into `counts`.
# ---------------------------------------------------------------------------------------------------------


def ddp(rank: int, factor: float, counts: dict) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = dense_model()
    wrapped = DistributedDataParallel(model)  # the default group: all 4 ranks, the mean
    micro_batches, tokens = shard(rank, RANKS), step_tokens()
    for k, (inputs, labels) in enumerate(micro_batches):
        wrapped.require_backward_grad_sync = k == len(micro_batches) - 1  # set before the forward: no_sync's effect
        (loss_sum(wrapped(inputs), labels) * factor / tokens).backward()
    return sgd_update(model)


def fsdp(rank: int, factor: float, counts: dict, mode: str) -> list[torch.Tensor]:
    """FSDP2 in one of its modes: "every" micro-batch reduce-scatters, "deferred" to the last one, "sum" with
    the divide factor 1, "hsdp" on a 2 × 2 mesh, "hsdp-once" with the replicas' all-reduce in the last only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = dense_model()
    if mode.startswith("hsdp"):  # replicate over dim 0, shard over dim 1: shards {0, 1} and {2, 3}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (RANKS,))
    units = [model[0], model[2], model[4], model]  # the root last
    for unit in units:
        fully_shard(unit, mesh=mesh)
    if mode == "sum":
        for unit in units:  # not recursive: each FSDP module's own reduction
            unit.set_gradient_divide_factor(1.0)
    micro_batches, tokens = shard(rank, RANKS), step_tokens()
    last = len(micro_batches) - 1
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):  # HSDP's all-reduce over the replicas, counted
        counts["all_reduces"] += 1
        return all_reduce(*args, **kwargs)

    with counting_fsdp_collectives(counts), mock.patch.object(dist, "all_reduce", counted_all_reduce):
        counts["all_reduces"] = 0
        for k, (inputs, labels) in enumerate(micro_batches):
            if mode == "deferred":
                model.set_requires_gradient_sync(k == last)
                model.set_reshard_after_backward(k == last)
            if mode == "hsdp-once":
                model.set_requires_all_reduce(k == last)
            (loss_sum(model(inputs), labels) * factor / tokens).backward()
    return sgd_update(model)


def pipeline(rank: int, factor: float, counts: dict) -> list[torch.Tensor]:
    """2 stages × 2 replicas: ranks {0, 1} are replica 0's stages 0 and 1, ranks {2, 3} replica 1's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    replica, stage_index = divmod(rank, 2)
    # Every rank creates every group, in the same order (new_group is collective over the world).
    pipeline_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    module = dense_model()[:2] if stage_index == 0 else dense_model()[2:]
    wrapped = DistributedDataParallel(module, process_group=replica_groups[stage_index])  # the mean over 2
    stage = PipelineStage(wrapped, stage_index, 2, torch.device("cpu"), group=pipeline_groups[replica])
    micro_batches, tokens = shard(replica, 2), step_tokens()

    def loss_fn(logits, labels):
        return loss_sum(logits, labels) * factor / tokens

    # scale_grads=False: the schedule's backward passes add the micro-batches' gradients, and nothing divides.
    schedule = Schedule1F1B(stage, len(micro_batches), loss_fn=loss_fn, scale_grads=False)
    if stage_index == 0:
        schedule.step(torch.cat([inputs for inputs, _ in micro_batches]))
    else:
        schedule.step(target=torch.cat([labels for _, labels in micro_batches]))
    return sgd_update(module)


def context_parallel(rank: int, factor: float, counts: dict, count_over_data_ranks: bool = False) -> list:
    """2 CP ranks × 2 data ranks: data shard rank // 2, and CP rank c = rank % 2 holds the targets of positions
    [c · T/2, (c + 1) · T/2) of each of the shard's rows. The dense parameters are replicated on all 4 ranks:
    their gradient is averaged over all 4. With count_over_data_ranks, N is counted as a data-parallel loop
    counts it, over the data ranks only: each CP rank then divides by the targets of its own halves."""
    data_rank, cp_rank = divmod(rank, 2)
    half = SEQ_LEN // 2
    positions = slice(cp_rank * half, (cp_rank + 1) * half)
    micro_batches = shard(data_rank, 2)
    tokens = step_tokens()
    if count_over_data_ranks:
        data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the ranks that hold the same positions
        mine = torch.tensor(sum(int((labels[:, positions] != IGNORE_INDEX).sum()) for _, labels in micro_batches))
        dist.all_reduce(mine, group=data_groups[cp_rank])
        tokens = int(mine)
    model = dense_model()
    for inputs, labels in micro_batches:
        # A per-token model: position t's logits need only token t, so this CP rank's half runs alone.
        (loss_sum(model(inputs[:, positions]), labels[:, positions]) * factor / tokens).backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)  # the sum over the 4 ranks ...
        parameter.grad /= RANKS  # ... and the mean, as DDP (or FSDP over the CP × data ranks) computes it
    return sgd_update(model)


def experts(rank: int, factor: float, counts: dict) -> list[torch.Tensor]:
    """4 data ranks; experts parallel over the pairs {0, 1} and {2, 3} (EP = 2): expert j lives on the pair's
    rank j, and its 2 copies (ranks j and 2 + j) are averaged over the expert's data group {j, 2 + j}. Returns
    the update of the experts' parameters (the dense ones are the DDP row's)."""
    expert_parallel_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    expert_data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, hosted = divmod(rank, 2)
    model = ExpertModel()
    micro_batches, tokens = shard(rank, RANKS), step_tokens()
    for inputs, labels in micro_batches:
        (loss_sum(model(inputs), labels) * factor / tokens).backward()
    # The all-to-all's backward brings the host of expert j the gradient of every token of its EP pair that
    # was routed to j: the sum over the pair of each rank's expert-j gradient.
    for expert in model.experts:
        for parameter in expert.parameters():
            dist.all_reduce(parameter.grad, group=expert_parallel_groups[pair])
    hosted_parameters = list(model.experts[hosted].parameters())
    for parameter in hosted_parameters:
        dist.all_reduce(parameter.grad, group=expert_data_groups[hosted])  # the mean over the expert's 2 hosts
        parameter.grad /= 2
    return sgd_update(model, hosted_parameters)


# ---------------------------------------------------------------------------------------------------------
# The table: each layout with its right and its wrong factor.
# ---------------------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    run: Callable  # the layout's function, run on every rank with the factor f
    arguments: dict
    reduction: str
    group: str  # the ranks the gradient is combined over
    op: str
    right: int  # the right factor f: the size of the averaging group, 1 where every reduction sums
    wrong: int | str  # a wrong factor, or a mistake in N


LAYOUTS = {
    "DDP": Layout(ddp, {}, "all-reduce", "4 data ranks", "avg", right=4, wrong=1),
    "FSDP2, reduce-scatter in every micro-batch": Layout(
        fsdp, {"mode": "every"}, "reduce-scatter", "4 shards", "avg", right=4, wrong=1
    ),
    "FSDP2, deferred (gradient sync, reshard after backward)": Layout(
        fsdp, {"mode": "deferred"}, "reduce-scatter", "4 shards", "avg", right=4, wrong=1
    ),
    "FSDP2, set_gradient_divide_factor(1.0)": Layout(
        fsdp, {"mode": "sum"}, "reduce-scatter", "4 shards", "sum", right=1, wrong=4
    ),
    "HSDP 2 x 2, all-reduce in every micro-batch": Layout(
        fsdp, {"mode": "hsdp"}, "reduce-scatter, all-reduce", "2 shards x 2 replicas", "avg, avg", right=4, wrong=2
    ),
    "HSDP 2 x 2, set_requires_all_reduce(last only)": Layout(
        fsdp, {"mode": "hsdp-once"}, "reduce-scatter, all-reduce", "2 shards x 2 replicas", "avg, avg", 4, 2
    ),
    "pipeline, 2 stages x 2 replicas": Layout(
        pipeline, {}, "all-reduce per stage", "the stage's 2 replicas", "avg", right=2, wrong=4
    ),
    "CP 2 x 2 data ranks": Layout(context_parallel, {}, "all-reduce", "4 ranks (CP x data)", "avg", right=4, wrong=2),
    "CP 2 x 2, N counted over data ranks only": Layout(
        context_parallel, {}, "all-reduce", "4 ranks (CP x data)", "avg", right=4, wrong="N per CP rank"
    ),
    "experts, EP = 2 over 4 data ranks": Layout(
        experts, {}, "all-to-all, all-reduce", "EP pair, then expert's 2 hosts", "sum, avg", right=2, wrong=4
    ),
}


def measure(rank: int, world_size: int) -> dict:
    """On each rank: every layout with its right factor and its wrong one (or its mistake). Returns this rank's
    updates, and its counts of FSDP2's collectives, by layout."""
    assert world_size == RANKS
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # nothing in place
    results = {}
    for name, layout in LAYOUTS.items():
        counts = {}
        right_update = layout.run(rank, layout.right, counts, **layout.arguments)
        if isinstance(layout.wrong, str):  # the right factor, and N counted wrong
            wrong_update = layout.run(rank, layout.right, {}, count_over_data_ranks=True)
        else:
            wrong_update = layout.run(rank, layout.wrong, {}, **layout.arguments)
        results[name] = {"right": right_update, "wrong": wrong_update, "counts": counts}
    return results


def whole_update(name: str, per_rank: list[dict], which: str) -> list[torch.Tensor]:
    """The model's update as the reference lists its parameters: rank 0's where every rank holds the whole
    model; the two stages' (ranks 0 and 1) for the pipeline; the two experts' hosts (ranks 0 and 1) for MoE."""
    if name.startswith("pipeline") or name.startswith("experts"):
        return per_rank[0][name][which] + per_rank[1][name][which]
    return per_rank[0][name][which]


def run() -> list[dict]:
    per_rank = run_on_ranks(measure, RANKS, timeout_s=300)
    dense_reference = reference_update(dense_model())
    expert_reference = reference_update(ExpertModel())[1:5]  # experts 0 and 1: weight and bias each
    rows = []
    for name, layout in LAYOUTS.items():
        reference = expert_reference if name.startswith("experts") else dense_reference
        counts = per_rank[0][name]["counts"]
        rows.append(
            {
                "layout": name,
                "reduction": layout.reduction,
                "group": layout.group,
                "op": layout.op,
                "right_factor": layout.right,
                "right_error": relative_error(whole_update(name, per_rank, "right"), reference),
                "wrong_factor": layout.wrong,
                "wrong_error": relative_error(whole_update(name, per_rank, "wrong"), reference),
                "reduce_scatters": counts.get("reduce_scatters"),
                "all_reduces": counts.get("all_reduces"),
                "all_gathers": counts.get("all_gathers"),
            }
        )
    return rows


def factor(value) -> str:
    return value if isinstance(value, str) else f"x {value}"


def collectives(row: dict) -> str:
    """FSDP2's collectives in the step, where they were counted: the gradient's, then the parameters'."""
    if row["reduce_scatters"] is None:
        return ""
    return f"{row['reduce_scatters']} RS, {row['all_reduces']} AR, {row['all_gathers']} AG"


def table(rows: list[dict]) -> str:
    header = ("layout", "reduction", "group", "op", "right f", "error", "wrong f", "error", "collectives (rank 0)")
    lines = [
        (
            row["layout"],
            row["reduction"],
            row["group"],
            row["op"],
            factor(row["right_factor"]),
            f"< {ROUNDING_BOUND:.0e}" if row["right_error"] < ROUNDING_BOUND else f"{row['right_error']:.3g}",
            factor(row["wrong_factor"]),
            f"{row['wrong_error']:.3g}",
            collectives(row),
        )
        for row in rows
    ]
    widths = [max(len(line[column]) for line in [header, *lines]) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run()
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
