"""One round's policy updates: the rollout cut into optimizer steps and micro-batches, each step's normaliser counted
in its objective's unit, and accumulation/step.py's optimizer_step doing the rest.

Rank r owns the round's trajectories [r·T, (r+1)·T) (T = trajectories per rank). Optimizer step s of an epoch takes
each rank's s-th mini-batch of its own trajectories, so its global rows are, rank after rank,

    r·T + s·mini + (0 .. mini − 1)        for r = 0 .. D − 1

and its objective is defined over those mini · D trajectories. Every rank holds the whole round's table (rewards,
completion lengths, groups, advantages) after the round's one exchange, so each counts the step's row weights
and normaliser on the host, the same numbers on every rank, with no collective in the step.
"""

from dataclasses import dataclass

import torch

from accumulation.batching import GlobalCounts, MicroBatch
from accumulation.rl.objectives import PolicyLoss, aggregation
from accumulation.rl.rollout import Trajectories
from accumulation.rl.sizes import RoundSizes
from accumulation.step import StepResult, optimizer_step


@dataclass(frozen=True)
class RoundTable:
    """What every rank knows of every trajectory of the round (host tensors [rollout trajectories])."""

    rewards: torch.Tensor  # float64
    lengths: torch.Tensor  # int64: completion tokens
    group_ids: torch.Tensor  # int64: the prompt each trajectory answers
    advantages: torch.Tensor  # float64


def step_row_ids(sizes: RoundSizes, step_in_epoch: int) -> torch.Tensor:
    """The global rows of optimizer step `step_in_epoch`: each rank's mini-batch of that index, rank after rank."""
    per_rank, mini = sizes.trajectories_per_rank, sizes.mini_batch
    first = step_in_epoch * mini
    return torch.cat([rank * per_rank + first + torch.arange(mini) for rank in range(sizes.ranks)])


def step_micro_batches(
    local: Trajectories, table: RoundTable, sizes: RoundSizes, rank: int, step_in_epoch: int, row_weights: torch.Tensor
) -> list[MicroBatch]:
    """This rank's micro-batches for one optimizer step, each carrying its rows' advantages, old log-probabilities
    and weights (`row_weights`: this rank's share of the step's, in row order)."""
    m, first_local = sizes.micro_batch, step_in_epoch * sizes.mini_batch
    first_global = rank * sizes.trajectories_per_rank + first_local
    batches = []
    for k in range(sizes.accumulation):
        local_rows = slice(first_local + k * m, first_local + (k + 1) * m)
        global_rows = slice(first_global + k * m, first_global + (k + 1) * m)
        extras = {
            "advantages": table.advantages[global_rows],
            "old_log_probs": local.old_log_probs[local_rows],
            "row_weights": row_weights[k * m : (k + 1) * m],
        }
        batches.append(MicroBatch(local.tokens[local_rows], local.labels[local_rows], m, extras))
    return batches


def policy_updates(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: PolicyLoss,
    local: Trajectories,
    table: RoundTable,
    sizes: RoundSizes,
    rank: int,
    mode: str,
    constant: float,
    device: torch.device,
    grad_clip: float,
) -> list[StepResult]:
    """rollout / (mini · D) optimizer steps per epoch, `sizes.ppo_epochs` epochs, over this rank's trajectories."""
    results = []
    for _ in range(sizes.ppo_epochs):
        for step_in_epoch in range(sizes.trajectories_per_rank // sizes.mini_batch):
            rows = step_row_ids(sizes, step_in_epoch)
            step = aggregation(mode, table.lengths[rows], table.group_ids[rows], constant)
            mine = step.row_weights[rank * sizes.mini_batch : (rank + 1) * sizes.mini_batch]
            # The step divides Σ S by the count it is given: here the objective's normaliser, in its unit.
            counts = GlobalCounts(step.normaliser, len(rows))
            micro_batches = step_micro_batches(local, table, sizes, rank, step_in_epoch, mine)
            results.append(
                optimizer_step(
                    model,
                    micro_batches,
                    optimizer,
                    device=device,
                    loss_sum_fn=loss,
                    grad_clip=grad_clip,
                    global_counts=counts,
                )
            )
    return results
