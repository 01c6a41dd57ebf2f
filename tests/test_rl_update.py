"""A round cut into optimizer steps (accumulation/rl/update.py): step s takes each rank's s-th mini-batch of its own
trajectories, and each micro-batch carries the advantages, old log-probabilities and weights of its own rows."""

import torch

from accumulation.rl.objective_check import RELATIVE_TOLERANCE, reference_gradient, relative_error
from accumulation.rl.objectives import PolicyLoss, completion_lengths
from accumulation.rl.rollout import Trajectories
from accumulation.rl.sizes import round_sizes
from accumulation.rl.update import RoundTable, policy_updates, step_micro_batches, step_row_ids
from testkit.ranks import run_on_ranks
from tests.test_rl_objectives import CONSTANT, MODES, step_rows, tiny_policy


def test_step_s_takes_each_ranks_s_th_mini_batch_rank_after_rank():
    sizes = round_sizes(prompts=2, group_size=4, ranks=2, micro_batch=1, mini_batch=2)  # 4 trajectories per rank
    assert step_row_ids(sizes, 0).tolist() == [0, 1, 4, 5]
    assert step_row_ids(sizes, 1).tolist() == [2, 3, 6, 7]


def test_each_micro_batch_carries_its_own_rows_extras():
    sizes = round_sizes(prompts=2, group_size=4, ranks=2, micro_batch=1, mini_batch=2)
    rank = 1  # owns trajectories 4..7
    rows = torch.arange(4, 8)
    local = Trajectories(rows[:, None].repeat(1, 3), rows[:, None].repeat(1, 3), rows[:, None].float().repeat(1, 3), [])
    table = RoundTable(torch.zeros(8), torch.ones(8, dtype=torch.int64), torch.arange(8) // 4, torch.arange(8.0) * 10)
    weights = torch.tensor([0.5, 0.25])  # this rank's share of step 1's weights, rows 6 and 7
    batches = step_micro_batches(local, table, sizes, rank, 1, weights)
    assert [int(b.inputs[0, 0]) for b in batches] == [6, 7]
    assert [float(b.extras["advantages"][0]) for b in batches] == [60.0, 70.0]
    assert [float(b.extras["old_log_probs"][0, 0]) for b in batches] == [6.0, 7.0]
    assert [float(b.extras["row_weights"][0]) for b in batches] == [0.5, 0.25]


def fork_update_errors(rank: int, ranks: int) -> dict:
    """One optimizer step of the fork's own path (policy_updates: step rows, weights, N, micro-batches) on this
    rank, SGD at lr 1 on the float64 policy, against the objective's float64 gradient over all 12 rows."""
    model = torch.nn.parallel.DistributedDataParallel(tiny_policy())
    rows = step_rows(model.module)
    sizes = round_sizes(prompts=3, group_size=4, ranks=ranks, micro_batch=2, mini_batch=6)  # one step, A = 3
    mine = slice(rank * 6, (rank + 1) * 6)
    local = Trajectories(rows.tokens[mine], rows.labels[mine], rows.old_log_probs[mine], [])
    table = RoundTable(torch.zeros(12), completion_lengths(rows.labels), rows.group_ids, rows.advantages)
    errors = {}
    for mode in MODES:
        reference = reference_gradient(model.module, mode, rows, CONSTANT, 0.2)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        policy_updates(
            model, optimizer, PolicyLoss(0.2), local, table, sizes, rank, mode, CONSTANT, torch.device("cpu"), 0.0
        )
        with torch.no_grad():
            update = [old - p for old, p in zip(before, model.parameters(), strict=True)]
            for p, old in zip(model.parameters(), before, strict=True):
                p.copy_(old)
        errors[mode] = relative_error(update, reference)
    return errors


def test_the_forks_own_update_on_two_ranks_is_the_objectives_gradient():
    per_rank = run_on_ranks(fork_update_errors, 2)
    for mode in MODES:
        assert per_rank[0][mode] <= RELATIVE_TOLERANCE, (mode, per_rank[0][mode])
