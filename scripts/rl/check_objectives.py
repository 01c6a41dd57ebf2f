"""The objective-level check of GRPO's configured loss aggregation (configs/grpo.toml): accumulated by optimizer_step
over several micro-batch sizes, against the float64 gradient of the objective written from its definition.

    python scripts/rl/check_objectives.py [--config configs/grpo.toml] [section.key=value ...] [--inject-bug BUG]

The rows are one mini-batch of the run's own first round (its task, prompts, group size and sampler; float64),
their old log-probabilities those recorded at sampling. A group whose rewards are all equal has zero advantages
and adds nothing to any gradient, so its rewards are replaced by uniforms (step_uniforms of the seed), and when
every completion has the same length (an untrained policy writes to the token budget), each is cut at a length
drawn the same way, since equal lengths make the token and sequence means coincide: the check is of the
aggregation, not of the reward or the policy. The policy is the run's latest checkpoint when there is one, else the
initial weights. --inject-bug wrong-normaliser declares the mode's wrong normaliser
(accumulation/rl/objective_check.py, WRONG_NORMALISERS) and must FAIL, naming it.
Exit status: 0 PASS, 1 FAIL, 2 bad config (one line on stderr).
"""

import sys
from pathlib import Path

import torch

from accumulation.batching import IGNORE_INDEX, divisors
from accumulation.config.config import ConfigError, load_config
from accumulation.data.uniforms import step_uniforms
from accumulation.models.factory import build_model
from accumulation.parallel.distributed import run_and_exit
from accumulation.rl.objective_check import WRONG_NORMALISERS, StepRows, check_objective, declared_by_the_library
from accumulation.rl.objectives import completion_lengths, group_relative_advantages
from accumulation.rl.on_policy import BYTE_VOCABULARY, split_problems
from accumulation.rl.rollout import reward, round_prompts, sample

REWARD_STREAM, LENGTH_STREAM = 14, 15  # step_uniforms streams of the replacement rewards and lengths


def main(argv: list[str]) -> int:
    inject = None
    if "--inject-bug" in argv:
        at = argv.index("--inject-bug")
        inject = argv[at + 1] if at + 1 < len(argv) else ""
        argv = argv[:at] + argv[at + 2 :]
        if inject != "wrong-normaliser":
            print("error: --inject-bug takes wrong-normaliser", file=sys.stderr)
            return 2
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if config.data.source != "arithmetic-rollouts":
        print(f'error: data.source must be "arithmetic-rollouts" (GRPO), got {config.data.source!r}', file=sys.stderr)
        return 2
    rl, seq_len, seed = config.data.own, config.data.seq_len, config.run.seed
    training, _ = split_problems(rl)
    # One optimizer step's rows, and at least one whole group, so that advantages can differ.
    rows_total = max(rl.mini_batch_size, rl.group_size)
    policy = build_model(config.model, BYTE_VOCABULARY, seq_len=seq_len, seed=seed)
    latest = Path(config.run.out_dir) / config.run.name / "checkpoints" / "latest.pt"
    if latest.exists():
        policy.load_state_dict(torch.load(latest, weights_only=True)["model"])
        print(f"policy: {latest}")
    policy = policy.double()
    pool = [prompt for prompt, _ in training]
    asked = round_prompts(seed, 0, rl.prompts_per_round, len(pool))
    prompts = [pool[asked[j // rl.group_size]] for j in range(rows_total)]
    drawn = sample(policy, prompts, torch.arange(rows_total), seed, 0, rl.max_new_tokens, seq_len)
    group_ids = torch.arange(rows_total) // rl.group_size
    rewards = torch.tensor([reward(p, c) for p, c in zip(prompts, drawn.completions, strict=True)])
    replacements = torch.from_numpy(step_uniforms(seed, 0, torch.arange(rows_total), 1, REWARD_STREAM)[:, 0])
    for group in group_ids.unique():
        members = group_ids == group
        if rewards[members].unique().numel() == 1:
            rewards[members] = replacements[members].float()
    lengths = completion_lengths(drawn.labels)
    if lengths.unique().numel() == 1:
        cuts = step_uniforms(seed, 0, torch.arange(rows_total), 1, LENGTH_STREAM)[:, 0]
        for i, u in enumerate(cuts):
            keep = 1 + int(u * int(lengths[i]))  # 1 .. L tokens; the later positions are no longer targets
            positions = torch.nonzero(drawn.labels[i] != IGNORE_INDEX).flatten()[keep:]
            drawn.labels[i, positions], drawn.old_log_probs[i, positions] = IGNORE_INDEX, 0.0
    advantages = group_relative_advantages(rewards, group_ids, rl.scale_advantages)
    rows = StepRows(drawn.tokens, drawn.labels, drawn.old_log_probs.double(), advantages, group_ids)
    declare = WRONG_NORMALISERS[rl.loss_aggregation] if inject else declared_by_the_library
    constant = rl.norm_constant or float(rl.max_new_tokens)
    result = check_objective(policy, rl.loss_aggregation, rows, divisors(rows_total), declare, constant, rl.clip_ratio)
    print(
        f"{rows_total} trajectories of {rows_total // rl.group_size} prompts, micro-batch sizes {divisors(rows_total)}"
    )
    print(result.line())
    return 0 if result.passed else 1


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
