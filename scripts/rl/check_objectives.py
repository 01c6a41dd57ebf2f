"""The objective-level check of the GRPO fork: its configured loss aggregation, accumulated by optimizer_step over
several micro-batch sizes, against the float64 gradient of the objective written from its definition.

    python scripts/rl/check_objectives.py [--config scripts/rl/grpo.toml] [section.key=value ...] [--inject-bug BUG]

The rows are one mini-batch of the fork's own rollout at its initial policy (its task, prompts, group size and
sampler; float64), their old log-probabilities those recorded at sampling. A group whose rewards are all equal
has zero advantages and adds nothing to any gradient, so its rewards are replaced by uniforms (step_uniforms of
the seed), and when every completion has the same length (an untrained policy writes to the token budget), each is
cut at a length drawn the same way, since equal lengths make the token and sequence means coincide: the check is
of the aggregation, not of the reward or the policy. The policy is the run's latest checkpoint, or its SFT
checkpoint, or the initial weights, whichever exists first. --inject-bug wrong-normaliser declares the mode's
wrong normaliser (accumulation/rl/objective_check.py, WRONG_NORMALISERS) and must FAIL, naming it.
Exit status: 0 PASS, 1 FAIL, 2 bad config (one line on stderr).
"""

import importlib.util
import sys
from pathlib import Path

import torch

from accumulation.batching import IGNORE_INDEX, divisors
from accumulation.data.uniforms import step_uniforms
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.distributed import run_and_exit
from accumulation.rl.objective_check import WRONG_NORMALISERS, StepRows, check_objective, declared_by_the_library
from accumulation.rl.objectives import completion_lengths, group_relative_advantages
from accumulation.rl.rollout import reward, round_prompts, sample

REWARD_STREAM, LENGTH_STREAM = 14, 15  # step_uniforms streams of the replacement rewards and lengths

spec = importlib.util.spec_from_file_location("grpo_fork", Path(__file__).with_name("grpo.py"))
fork = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fork)


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
        settings = fork.load_settings(argv)
        training, _ = fork.split_task(settings["task"])
    except (fork.ConfigError, ValueError, OSError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run, rl, shape = settings["run"], settings["rl"], settings["model"]
    # One optimizer step's rows, and at least one whole group, so that advantages can differ.
    rows_total = max(rl.mini_batch_size or rl.micro_batch_size, rl.group_size)
    config = GPTConfig(shape.seq_len, shape.n_layer, shape.n_head, shape.d_model, 256)
    policy = GPT(config, seed=run.seed)
    run_dir = Path(run.out_dir) / run.name
    for saved in (run_dir / "checkpoints" / "latest.pt", run_dir / "sft.pt"):
        if saved.exists():
            state = torch.load(saved, weights_only=True)
            policy.load_state_dict(state.get("model", state))
            print(f"policy: {saved}")
            break
    policy = policy.double()
    pool = [prompt for prompt, _ in training]
    asked = round_prompts(run.seed, 0, rl.batch_size, len(pool))
    prompts = [pool[asked[j // rl.group_size]] for j in range(rows_total)]
    drawn = sample(policy, prompts, torch.arange(rows_total), run.seed, 0, rl.max_new_tokens, shape.seq_len)
    group_ids = torch.arange(rows_total) // rl.group_size
    rewards = torch.tensor([reward(p, c) for p, c in zip(prompts, drawn.completions, strict=True)])
    replacements = torch.from_numpy(step_uniforms(run.seed, 0, torch.arange(rows_total), 1, REWARD_STREAM)[:, 0])
    for group in group_ids.unique():
        members = group_ids == group
        if rewards[members].unique().numel() == 1:
            rewards[members] = replacements[members].float()
    lengths = completion_lengths(drawn.labels)
    if lengths.unique().numel() == 1:
        cuts = step_uniforms(run.seed, 0, torch.arange(rows_total), 1, LENGTH_STREAM)[:, 0]
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
