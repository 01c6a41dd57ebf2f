"""A round cut into optimizer steps (accumulation/rl/update.py): step s takes each rank's s-th mini-batch of its own
trajectories, and each micro-batch carries the advantages, old log-probabilities and weights of its own rows."""

import torch

from accumulation.rl.rollout import Trajectories
from accumulation.rl.sizes import round_sizes
from accumulation.rl.update import RoundTable, step_micro_batches, step_row_ids


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
