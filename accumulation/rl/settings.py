"""The settings of a GRPO run through train.py ("arithmetic-rollouts": its data.* keys), the GRPO-family loss they
name, and the combinations train.py cannot run, each refused in one line before anything is written."""

import importlib
from dataclasses import dataclass

from accumulation.config.config_keys import setting
from accumulation.config.registry import import_problem
from accumulation.data.memory import memory_limit_bytes
from accumulation.data.rows import BYTES, RunTokenizer
from accumulation.rl.objectives import IMPORTANCE_LEVELS, KL_ESTIMATORS, NORMALISER_UNITS, PolicyLoss, PolicyObjective
from accumulation.rl.rollout import Sampling, stop_tokens
from accumulation.rl.sizes import SizeError, round_sizes
from accumulation.rl.task import MAX_OPERAND, reward_function

# A round's rollout is held whole on every rank: tokens and labels (int64) and old log-probabilities (float32) per
# position, twice during the all-gather that assembles it.
ROUND_BYTES_PER_POSITION = 2 * (8 + 8 + 4)


@dataclass(frozen=True)
class RolloutSettings:
    """The data.* keys of "arithmetic-rollouts"."""

    mini_batch_size: int = setting(
        16, "trajectories per optimizer step, all ranks: must equal batch.global_batch_size", "trajectories", at_least=1
    )
    max_operand: int = setting(
        20,
        "problems are every 'Q: a + b =' with a, b below this (all built in memory: at most 300, 90,000 problems)",
        "operand",
        at_least=2,
        at_most=MAX_OPERAND,
    )
    held_out: int = setting(
        40,
        "problems kept out of training (every tenth, at most a tenth of them), for validation",
        "prompts",
        at_least=1,
    )
    sft_steps: int = setting(
        200, "the run's first optimizer steps, supervised on the reference answers, before GRPO", "steps", at_least=0
    )
    prompts_per_round: int = setting(8, "prompts each GRPO round asks, all ranks", "prompts", at_least=1)
    group_size: int = setting(
        8, "completions sampled per prompt (2 at least: advantages are group-relative)", "completions", at_least=1
    )
    sample_batch_size: int = setting(
        256, "trajectories per sampling forward, on one rank: memory only", "trajectories", at_least=1
    )
    ppo_epochs: int = setting(1, "passes over a round's rollout", "epochs", at_least=1)
    prompts: str = setting(
        "",
        'a JSONL file of {"prompt", "response"} rows, the response the reference answer; "" = every "Q: a + b =" '
        "below data.max_operand",
    )
    reward: str = setting(
        "accumulation.rl.task:reward",
        'the reward function, "module:name", called as name(prompt, completion) -> float (TRL\'s reward_funcs)',
    )
    max_new_tokens: int = setting(6, "longest completion the sampler writes", "tokens", at_least=1)
    temperature: float = setting(
        1.0, "the sampler's and the loss's π_T = softmax(logits / temperature) (TRL's temperature)", above=0
    )
    top_p: float = setting(
        1.0, "sample from the fewest most likely tokens whose probability reaches this", above=0, at_most=1
    )
    stop: str = setting(
        "\n",
        "characters that end a completion (each a stop token: its bytes, or one token of data.tokenizer; the newline "
        "ends an answer)",
    )
    loss_aggregation: str = setting(
        "seq-mean-token-mean", "how the policy loss aggregates (docs/rl.md)", choices=tuple(NORMALISER_UNITS)
    )
    norm_constant: float = setting(
        0.0, "C of seq-mean-token-sum-norm (Dr. GRPO); 0 = data.max_new_tokens", "tokens", at_least=0
    )
    scale_advantages: bool = setting(True, "divide advantages by their group's standard deviation (false: Dr. GRPO)")
    clip_ratio: float = setting(0.2, "PPO's clip range ε (ε_low when data.clip_ratio_high is set)", above=0, below=1)
    clip_ratio_high: float = setting(
        0.0,
        "ε_high of an asymmetric clip (DAPO's clip-higher): the ratio's upper bound 1 + ε_high; 0 = data.clip_ratio",
        at_least=0,
    )
    importance_level: str = setting(
        "token", "the importance ratio per token (GRPO) or per sequence (GSPO)", choices=IMPORTANCE_LEVELS
    )
    kl_coef: float = setting(
        0.0, "β of a KL penalty to the frozen reference policy (the policy at the end of SFT); 0 = none", at_least=0
    )
    kl_estimator: str = setting(
        "k3", "the KL penalty's estimator: k1 (log-ratio) or k3 (Schulman's)", choices=KL_ESTIMATORS
    )
    policy_loss: str = setting(
        "",
        'a GRPO-family loss: "module:Class", a subclass of accumulation.rl.objectives.PolicyLoss (docs/rl.md, "Add an '
        'objective"); "" = the clipped surrogate',
    )
    entropy_coef: float = setting(0.0, "coefficient of an entropy bonus (the entropy is logged whatever)", at_least=0)

    def sampling(self, tokenizer: RunTokenizer = BYTES, greedy: bool = False) -> Sampling:
        """How the rounds (or, greedy, the held-out evaluation) draw their completions, data.stop's characters
        encoded with the run's tokenizer (rollout.stop_tokens)."""
        stop = stop_tokens(self.stop, tokenizer)
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, stop, greedy)

    def objective(self) -> PolicyObjective:
        """The objective these settings declare (objectives.PolicyObjective)."""
        return PolicyObjective(
            aggregation=self.loss_aggregation,
            constant=self.norm_constant or float(self.max_new_tokens),
            clip_low=self.clip_ratio,
            clip_high=self.clip_ratio_high or self.clip_ratio,
            level=self.importance_level,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            temperature=self.temperature,
            loss_class=policy_loss_class(self.policy_loss),
        )


def policy_loss_class(name: str) -> type:
    """The PolicyLoss subclass data.policy_loss names ("module:Class"; "" is the clipped surrogate), or a
    ValueError in one line."""
    if not name:
        return PolicyLoss
    module_name, _, class_name = name.partition(":")
    problem = import_problem(module_name) if class_name else None
    if not class_name or problem:
        raise ValueError(f'data.policy_loss="{name}": {problem or "expected module:Class"}')
    loss_class = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(loss_class, type) and issubclass(loss_class, PolicyLoss)):
        raise ValueError(
            f'data.policy_loss="{name}" is not a subclass of accumulation.rl.objectives.PolicyLoss; a GRPO-family '
            'loss subclasses it (docs/rl.md, "Add an objective")'
        )
    return loss_class


def check_rollout_config(config) -> None:
    """One line for a combination train.py cannot run GRPO with (docs/rl.md, the three sizes)."""
    settings, batch = config.data.own, config.batch
    prompts, epochs = settings.prompts_per_round, settings.ppo_epochs
    if config.model.objective != "clipped-surrogate":
        raise ValueError(
            'data.source="arithmetic-rollouts" trains with model.objective="clipped-surrogate" (a GRPO-family loss of '
            'your own is data.policy_loss="module:Class")'
        )
    policy_loss_class(settings.policy_loss)
    if settings.group_size < 2:
        raise ValueError(
            "data.group_size=1: every advantage is its reward minus its group's mean, 0 in a group of one, so GRPO "
            "would learn nothing; set data.group_size=2 or more"
        )
    if batch.global_batch_size != settings.mini_batch_size:
        raise ValueError(
            f"batch.global_batch_size={batch.global_batch_size} must equal data.mini_batch_size="
            f"{settings.mini_batch_size}, the trajectories of one optimizer step (all ranks)"
        )
    # The three sizes' rules (sizes.py) over all ranks at once: train.py then checks that G = m · A · D for its D.
    try:
        round_sizes(prompts, settings.group_size, 1, batch.micro_batch_size, settings.mini_batch_size, epochs)
    except SizeError as error:
        raise ValueError(f"data.mini_batch_size: {error}") from None
    reward_function(settings.reward)
    problems = settings.max_operand**2
    kept_out = -(-problems // 10)  # every tenth problem
    if not settings.prompts and settings.held_out > kept_out:
        raise ValueError(
            f"data.held_out={settings.held_out}: only every tenth of the {problems:,} problems below "
            f"data.max_operand={settings.max_operand} is held out, {kept_out:,} of them; set data.held_out={kept_out} "
            "or less, or raise data.max_operand"
        )
    rollout = prompts * settings.group_size
    round_bytes = rollout * config.data.seq_len * ROUND_BYTES_PER_POSITION
    memory_bytes, where = memory_limit_bytes()
    if round_bytes > memory_bytes:
        raise ValueError(
            f"data.prompts_per_round={prompts}: a round of {rollout:,} trajectories ({prompts} prompts x group "
            f"{settings.group_size}) of {config.data.seq_len} positions is held whole on every rank, at least "
            f"{round_bytes / 2**30:,.1f} GiB, more than the {memory_bytes / 2**30:,.1f} GiB of {where}; lower "
            "data.prompts_per_round"
        )
    if config.dist.pipeline_stages != 1 or config.dist.strategy != "ddp":
        raise ValueError("GRPO samples from the whole model on every rank: dist.strategy=ddp, dist.pipeline_stages=1")
    longest = len(f"Q: {settings.max_operand - 1} + {settings.max_operand - 1} =")
    generated_bytes = not settings.prompts and config.data.tokenizer == "bytes"  # a file's or a tokenizer's: when read
    if generated_bytes and longest + settings.max_new_tokens > config.data.seq_len:
        raise ValueError(
            f"data.seq_len={config.data.seq_len} cannot hold a {longest}-byte prompt and data.max_new_tokens="
            f"{settings.max_new_tokens}; set data.seq_len={longest + settings.max_new_tokens}"
        )
