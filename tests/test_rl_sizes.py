"""The three sizes of a GRPO update (accumulation/rl/sizes.py): seed 000's rules and its worked example."""

import pytest

from accumulation.rl.sizes import SizeError, round_sizes


def test_the_worked_example_batch_2_group_5_two_ranks_micro_1():
    unset = round_sizes(prompts=2, group_size=5, ranks=2, micro_batch=1)
    assert (unset.rollout_trajectories, unset.trajectories_per_rank) == (10, 5)
    assert (unset.mini_batch, unset.accumulation, unset.optimizer_steps_per_round) == (1, 1, 5)
    whole = round_sizes(prompts=2, group_size=5, ranks=2, micro_batch=1, mini_batch=5)
    assert (whole.accumulation, whole.optimizer_steps_per_round) == (5, 1)
    with pytest.raises(SizeError, match="^5 trajectories do not divide into mini-batches of 3$"):
        round_sizes(prompts=2, group_size=5, ranks=2, micro_batch=1, mini_batch=3)


def test_the_defaults_follow_the_algorithm():
    rl = round_sizes(prompts=4, group_size=4, ranks=2, micro_batch=2)
    sft = round_sizes(prompts=4, group_size=4, ranks=2, micro_batch=2, algorithm="sft")
    assert (rl.mini_batch, rl.optimizer_steps_per_round) == (2, 4)  # one optimizer step per backward
    assert (sft.mini_batch, sft.optimizer_steps_per_round) == (8, 1)  # one optimizer step per rank batch


def test_steps_per_round_is_rollout_over_mini_batch_times_ranks_times_epochs():
    sizes = round_sizes(prompts=8, group_size=4, ranks=2, micro_batch=2, mini_batch=4, ppo_epochs=3)
    assert sizes.optimizer_steps_per_round == 32 // (4 * 2) * 3
    assert "12 optimizer steps per round" in sizes.describe()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(prompts=3, group_size=3, ranks=2, micro_batch=1), "9 trajectories .* does not split evenly over 2"),
        (dict(prompts=2, group_size=4, ranks=1, micro_batch=3, mini_batch=4), "mini-batch of 4 .* micro-batches of 3"),
        (dict(prompts=2, group_size=4, ranks=1, micro_batch=3), "8 trajectories do not divide into mini-batches of 3"),
        (dict(prompts=0, group_size=4, ranks=1, micro_batch=1), "batch_size must be a positive integer"),
        (dict(prompts=2, group_size=4, ranks=1, micro_batch=1, mini_batch=0), "mini_batch_size must be a positive"),
    ],
)
def test_sizes_that_do_not_divide_are_refused_never_rounded(arguments, message):
    with pytest.raises(SizeError, match=message):
        round_sizes(**arguments)
