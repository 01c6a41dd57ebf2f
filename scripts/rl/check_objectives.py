"""The objective-level check of GRPO's configured objective (configs/grpo.toml: the aggregation, the clip, the ratio's
level, the KL and entropy terms): the loss accumulated by optimizer_step over several micro-batch sizes, against the
float64 gradient of the objective the config declares, written from its definition at the level it is defined.

    python scripts/rl/check_objectives.py [--config configs/grpo.toml] [section.key=value ...] [--inject-bug BUG]

The rows are one mini-batch of the run's own first round (its task, prompts, group size and sampler; float64),
their old log-probabilities those recorded at sampling, by a policy some updates away from the checked one
(objective_check.offset_policy): the ratio differs from 1, and the clip binds on some tokens (the verdict says on
how many), as in a later epoch of a round. Under a KL penalty the reference policy is the sampling one, as for a
run's round 0. A group whose rewards are all equal has zero advantages
and adds nothing to any gradient, so its rewards are replaced by uniforms (step_uniforms of the seed), and when
every completion has the same length (an untrained policy writes to the token budget), each is cut at a length
drawn the same way, since equal lengths make the token and sequence means coincide: the check is of the
aggregation, not of the reward or the policy. The policy is the run's latest checkpoint when there is one, else the
initial weights. --inject-bug wrong-normaliser declares the mode's wrong normaliser
(accumulation/rl/objective_check.py, WRONG_NORMALISERS) and must FAIL, naming it; max-for-min (the surrogate's
bound taken with max) and gspo-without-length (data.importance_level="sequence": the sequence ratio without its
1/|y|) plant a wrong loss (WRONG_LOSSES) and must FAIL naming the loss.
Exit status: 0 PASS, 1 FAIL, 2 bad config (one line on stderr).
"""

import copy
import sys
from pathlib import Path

import torch

from accumulation.batching import IGNORE_INDEX, divisors
from accumulation.config.config import ConfigError, load_config
from accumulation.data.rows import DataError
from accumulation.data.sources import build_data
from accumulation.data.uniforms import step_uniforms
from accumulation.models.factory import build_model, resolved_vocab_size
from accumulation.parallel.distributed import run_and_exit
from accumulation.rl.objective_check import (
    WRONG_LOSSES,
    WRONG_NORMALISERS,
    StepRows,
    check_objective,
    declared_by_the_library,
    offset_policy,
)
from accumulation.rl.objectives import completion_lengths, group_relative_advantages
from accumulation.rl.rollout import round_prompts, sample
from accumulation.rl.task import checked_reward

REWARD_STREAM, LENGTH_STREAM = 14, 15  # step_uniforms streams of the replacement rewards and lengths


def main(argv: list[str]) -> int:
    inject = None
    if "--inject-bug" in argv:
        at = argv.index("--inject-bug")
        inject = argv[at + 1] if at + 1 < len(argv) else ""
        argv = argv[:at] + argv[at + 2 :]
        if inject not in ("wrong-normaliser", *WRONG_LOSSES):
            print(f"error: --inject-bug takes one of wrong-normaliser, {', '.join(WRONG_LOSSES)}", file=sys.stderr)
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
    objective = rl.objective()
    if inject == "gspo-without-length" and objective.level != "sequence":
        print('error: --inject-bug gspo-without-length needs data.importance_level="sequence"', file=sys.stderr)
        return 2
    try:  # the run's task, tokenizer and reward, as train.py builds them
        rollouts = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=seed)
        vocab_size = resolved_vocab_size(config.model, rollouts.vocab_size)
        policy = build_model(config.model, vocab_size, seq_len=seq_len, seed=seed)
    except (ConfigError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    task = rollouts.train
    # One optimizer step's rows, and at least one whole group, so that advantages can differ.
    rows_total = max(rl.mini_batch_size, rl.group_size)
    latest = Path(config.run.out_dir) / config.run.name / "checkpoints" / "latest.pt"
    if latest.exists():
        policy.load_state_dict(torch.load(latest, weights_only=True)["model"])
        print(f"policy: {latest}")
    policy = policy.double()
    sampling_policy = copy.deepcopy(policy)
    offset_policy(sampling_policy, seed)
    asked = round_prompts(seed, 0, rl.prompts_per_round, len(task.prompts))
    prompts = [task.prompts[asked[j // rl.group_size]] for j in range(rows_total)]
    drawn = sample(sampling_policy, prompts, torch.arange(rows_total), seed, 0, task.drawing, seq_len, task.tokenizer)
    group_ids = torch.arange(rows_total) // rl.group_size
    rewards = torch.tensor([checked_reward(task.reward, p, c) for p, c in zip(prompts, drawn.completions, strict=True)])
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
    old_log_probs = drawn.old_log_probs.double()
    ref_log_probs = old_log_probs.clone() if objective.kl_coef else None  # round 0's reference: the sampling policy
    rows = StepRows(drawn.tokens, drawn.labels, old_log_probs, advantages, group_ids, ref_log_probs)
    declare = WRONG_NORMALISERS[objective.aggregation] if inject == "wrong-normaliser" else declared_by_the_library
    loss = WRONG_LOSSES[inject](objective) if inject in WRONG_LOSSES else None
    result = check_objective(policy, rows, divisors(rows_total), objective, declare, loss)
    print(
        f"{rows_total} trajectories of {rows_total // rl.group_size} prompts, micro-batch sizes {divisors(rows_total)}"
    )
    print(result.line())
    return 0 if result.passed else 1


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
