"""The three sizes of a GRPO update, and the arithmetic that ties them together.

    rollout batch   batch_size × group_size trajectories per round, over all ranks: batch_size prompts, each
                    answered group_size times
    mini-batch      trajectories per optimizer step, on one rank
    micro-batch     trajectories per forward and backward, on one rank

    trajectories per rank      = rollout batch / D                 (D data-parallel ranks)
    accumulation               = mini-batch / micro-batch          (backwards per optimizer step)
    optimizer steps per round  = trajectories per rank / mini-batch, times ppo_epochs

Every quotient must be whole: a size that does not divide is refused, never rounded, and every rank derives the
same widths from the same numbers. Left unset, the mini-batch follows the algorithm's default: for RL, one
optimizer step per backward (mini-batch = micro-batch), so a round takes as many small policy steps as a rank has
micro-batches; a supervised phase (SFT, DPO) takes one optimizer step per rank batch instead.
"""

from dataclasses import dataclass


class SizeError(ValueError):
    """Sizes that do not divide: the message is one line saying which and what would."""


@dataclass(frozen=True)
class RoundSizes:
    """The derived sizes of one round, the same on every rank."""

    prompts: int  # batch_size: prompts per round, all ranks
    group_size: int  # trajectories sampled per prompt
    ranks: int  # D
    mini_batch: int  # trajectories per optimizer step, per rank
    micro_batch: int  # trajectories per backward, per rank
    ppo_epochs: int  # passes over the round's trajectories

    @property
    def rollout_trajectories(self) -> int:
        return self.prompts * self.group_size

    @property
    def trajectories_per_rank(self) -> int:
        return self.rollout_trajectories // self.ranks

    @property
    def accumulation(self) -> int:
        return self.mini_batch // self.micro_batch

    @property
    def optimizer_steps_per_round(self) -> int:
        """rollout / (mini-batch · D), times the epochs: the same count on every rank."""
        return self.trajectories_per_rank // self.mini_batch * self.ppo_epochs

    def describe(self) -> str:
        """The derivation as printed at start-up."""
        return (
            f"rollout {self.rollout_trajectories} = {self.prompts} prompts x group {self.group_size}; "
            f"{self.trajectories_per_rank} per rank x ranks {self.ranks}; "
            f"mini-batch {self.mini_batch} = micro {self.micro_batch} x accum {self.accumulation}; "
            f"{self.optimizer_steps_per_round} optimizer steps per round"
        )


def round_sizes(
    prompts: int,
    group_size: int,
    ranks: int,
    micro_batch: int,
    mini_batch: int | None = None,
    ppo_epochs: int = 1,
    algorithm: str = "rl",
) -> RoundSizes:
    """The sizes of a round, checked. `mini_batch` None takes the algorithm's default: "rl" one optimizer step
    per backward (the micro-batch), "sft" or "dpo" one optimizer step per rank batch (all its trajectories)."""
    for name, value in (
        ("batch_size", prompts),
        ("group_size", group_size),
        ("ranks", ranks),
        ("micro_batch_size", micro_batch),
        ("ppo_epochs", ppo_epochs),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SizeError(f"{name} must be a positive integer, got {value!r}")
    rollout = prompts * group_size
    if rollout % ranks != 0:
        raise SizeError(
            f"a rollout of {rollout} trajectories ({prompts} prompts x group {group_size}) "
            f"does not split evenly over {ranks} ranks"
        )
    per_rank = rollout // ranks
    if mini_batch is None:
        if algorithm not in ("rl", "sft", "dpo"):
            raise SizeError(f"algorithm must be 'rl', 'sft' or 'dpo', got {algorithm!r}")
        mini_batch = micro_batch if algorithm == "rl" else per_rank
    if isinstance(mini_batch, bool) or not isinstance(mini_batch, int) or mini_batch < 1:
        raise SizeError(f"mini_batch_size must be a positive integer, got {mini_batch!r}")
    if per_rank % mini_batch != 0:
        raise SizeError(f"{per_rank} trajectories do not divide into mini-batches of {mini_batch}")
    if mini_batch % micro_batch != 0:
        raise SizeError(
            f"a mini-batch of {mini_batch} trajectories does not divide into micro-batches of {micro_batch}"
        )
    return RoundSizes(prompts, group_size, ranks, mini_batch, micro_batch, ppo_epochs)
