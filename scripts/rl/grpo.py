"""GRPO on arithmetic: the project's GPT learns to answer 'Q: a op b =' from a reward a function computes.

    python scripts/rl/grpo.py --config scripts/rl/grpo.toml [section.key=value ...]
    torchrun --standalone --nproc_per_node=2 scripts/rl/grpo.py --config scripts/rl/grpo.toml

Two phases in one run directory, <run.out_dir>/<run.name>/:
1. SFT: the policy first learns the answers of the training prompts by supervised fine-tuning (cross-entropy on
   the response bytes), written to sft.pt (and its greedy held-out reward to sft.json); a restart reuses it.
2. GRPO rounds: sample batch_size × group_size completions from the current policy (accumulation/rl/rollout.py),
   score them, compute group-relative advantages, and take rollout / (mini-batch · D) optimizer steps of the
   clipped surrogate, each aggregated and normalised as rl.loss_aggregation says (accumulation/rl/objectives.py).
   The round's checkpoint is checkpoints/latest.pt; a restart continues from it, and the sampling stream is a
   function of (seed, round, row), so the continued run is the uninterrupted one bit for bit (CPU).

metrics.jsonl holds one line per round, in RL's units: rounds, trajectories, completion tokens, optimizer steps,
mean reward, clip fraction, approximate KL to the sampling policy, and the greedy mean reward on held-out prompts
every run.eval_every rounds.
"""

import dataclasses
import json
import os
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, accumulation_steps, count_supervised_tokens
from accumulation.data.uniforms import step_uniforms
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.distributed import run_and_exit, setup_distributed, teardown_distributed
from accumulation.rl.objectives import NORMALISER_UNITS, PolicyLoss, completion_lengths, group_relative_advantages
from accumulation.rl.rollout import addition_problems, read_prompts, reward, round_prompts, sample
from accumulation.rl.sizes import SizeError, round_sizes
from accumulation.rl.update import RoundTable, policy_updates
from accumulation.step import optimizer_step

SFT_STREAM = 13  # step_uniforms stream of the SFT phase's example draws


@dataclasses.dataclass
class Run:
    name: str = "grpo"
    out_dir: str = "runs"
    seed: int = 0
    rounds: int = 40  # GRPO rounds, counted over the whole run, restarts included
    eval_every: int = 10  # rounds between held-out evaluations
    resume: str = "auto"  # "auto": continue from checkpoints/latest.pt when there is one; "never"


@dataclasses.dataclass
class Task:
    source: str = "additions"  # "additions" (every a + b below max_operand), or a {"prompt", "response"} JSONL
    max_operand: int = 20  # additions only
    longest_answer: int = 8  # JSONL only: bytes of the reference response, to keep problems answered without working
    held_out: int = 40  # prompts kept out of SFT and GRPO, for the greedy evaluation


@dataclasses.dataclass
class Sft:
    steps: int = 400
    global_batch_size: int = 32
    micro_batch_size: int = 16
    lr: float = 3e-3


@dataclasses.dataclass
class Rl:
    batch_size: int = 8  # prompts per round
    group_size: int = 8  # completions per prompt
    mini_batch_size: int = 0  # trajectories per optimizer step per rank; 0: RL's default, the micro-batch
    micro_batch_size: int = 8  # trajectories per backward per rank
    ppo_epochs: int = 1
    max_new_tokens: int = 6
    clip_ratio: float = 0.2
    loss_aggregation: str = "seq-mean-token-mean"
    norm_constant: float = 0.0  # C of seq-mean-token-sum-norm; 0: max_new_tokens
    scale_advantages: bool = True  # divide by the group's standard deviation (GRPO); false: Dr. GRPO
    lr: float = 1e-4
    grad_clip: float = 1.0


@dataclasses.dataclass
class Model:
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 20


TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
SECTIONS = {"run": Run, "task": Task, "sft": Sft, "rl": Rl, "model": Model}


class ConfigError(ValueError):
    """One line naming the key and what is allowed."""


def load_settings(argv: list[str]) -> dict:
    """The TOML file after --config (optional), then section.key=value overrides; unknown keys and wrong types
    are refused."""
    values: dict[str, dict] = {name: {} for name in SECTIONS}
    if argv[:1] == ["--config"]:
        if len(argv) < 2:
            raise ConfigError("--config needs a file")
        try:
            with open(argv[1], "rb") as file:
                values.update({k: dict(v) for k, v in tomllib.load(file).items()})
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"cannot read config {argv[1]}: {error}") from None
        argv = argv[2:]
    for override in argv:
        key, equals, text = override.partition("=")
        section, dot, name = key.partition(".")
        if not (equals and dot):
            raise ConfigError(f"override {override!r} is not section.key=value")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare string
        values.setdefault(section, {})[name] = value
    settings = {}
    for section, entries in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; the sections are {', '.join(SECTIONS)}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        for name, value in entries.items():
            if name not in fields:
                raise ConfigError(f"unknown key {section}.{name}; {section} has {', '.join(fields)}")
            expected = fields[name].type
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                entries[name] = value = float(value)
            if type(value) is not expected:
                raise ConfigError(f"{section}.{name} must be {TYPE_WORDS[expected]}, got {value!r}")
        settings[section] = SECTIONS[section](**entries)
    rl = settings["rl"]
    if rl.loss_aggregation not in NORMALISER_UNITS:
        raise ConfigError(
            f"rl.loss_aggregation must be one of {', '.join(NORMALISER_UNITS)}, got {rl.loss_aggregation!r}"
        )
    if settings["run"].resume not in ("auto", "never"):
        raise ConfigError(f"run.resume must be 'auto' or 'never', got {settings['run'].resume!r}")
    return settings


def split_task(task: Task) -> tuple[list[tuple[str, str]], list[str]]:
    """(prompt, response) pairs for training, and the held-out prompts: every tenth problem is held out."""
    if task.source == "additions":
        short = addition_problems(task.max_operand)
    else:
        read_prompts(task.source)  # every prompt must be 'Q: a op b =': refused here otherwise
        with open(task.source, encoding="utf-8") as lines:
            pairs = [(e["prompt"], e["response"]) for e in map(json.loads, lines)]
        short = [(p, r) for p, r in pairs if len(r.encode()) <= task.longest_answer]
    held_out = [p for p, _ in short[::10]][: task.held_out]
    training = [pair for pair in short if pair[0] not in set(held_out)]
    return training, held_out


def sft_rows(pairs: list[tuple[str, str]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [rows, seq_len] (prompt and response bytes) and labels supervising the response bytes only."""
    tokens = torch.zeros(len(pairs), seq_len, dtype=torch.int64)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    for i, (prompt, response) in enumerate(pairs):
        prompt_bytes, text = prompt.encode(), (prompt + response).encode()
        tokens[i, : len(text)] = torch.tensor(list(text))
        labels[i, len(prompt_bytes) - 1 : len(text) - 1] = tokens[i, len(prompt_bytes) : len(text)]
    return tokens, labels


def supervised_phase(model, settings, training, rank, ranks, device) -> None:
    """SFT: `sft.steps` optimizer steps of token cross-entropy; step s's examples are a pure function of (seed, s)."""
    sft, seed = settings["sft"], settings["run"].seed
    tokens, labels = sft_rows(training, settings["model"].seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.1)
    per_rank = sft.global_batch_size // ranks
    for step in range(sft.steps):
        draws = step_uniforms(seed, step, torch.arange(sft.global_batch_size), 1, SFT_STREAM)[:, 0]
        rows = torch.tensor([int(u * len(training)) for u in draws])
        counts = GlobalCounts(count_supervised_tokens(labels[rows]), len(rows))  # N of the global batch, on the host
        mine = rows[rank * per_rank : (rank + 1) * per_rank]
        m = sft.micro_batch_size
        micro_batches = [MicroBatch(tokens[mine[k : k + m]], labels[mine[k : k + m]], m) for k in range(0, per_rank, m)]
        result = optimizer_step(model, micro_batches, optimizer, device=device, global_counts=counts)
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"sft step {step + 1}/{sft.steps}: loss {result.loss:.4f}", flush=True)


@torch.no_grad()
def held_out_reward(policy, prompts, settings) -> float:
    """Mean reward of greedy completions of the held-out prompts."""
    drawn = sample(
        policy,
        prompts,
        torch.arange(len(prompts)),
        0,
        0,
        settings["rl"].max_new_tokens,
        settings["model"].seq_len,
        greedy=True,
    )
    return sum(reward(p, c) for p, c in zip(prompts, drawn.completions, strict=True)) / len(prompts)


def save_atomically(state: dict, path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def gather_rows(values: torch.Tensor, ranks: int) -> torch.Tensor:
    """Every rank's float64 [rows, k] table, concatenated in rank order (the round's one exchange)."""
    if ranks == 1:
        return values
    gathered = [torch.empty_like(values) for _ in range(ranks)]
    dist.all_gather(gathered, values)
    return torch.cat(gathered)


def main(argv: list[str]) -> int:
    try:
        settings = load_settings(argv)
        training, held_out = split_task(settings["task"])
    except (ConfigError, ValueError, OSError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run, rl, model_settings = settings["run"], settings["rl"], settings["model"]
    # A caller that set up the process group itself (a test's gloo ranks) keeps it; else torchrun's environment.
    launched_here = not dist.is_initialized()
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if launched_here else dist.get_world_size()
    mini = rl.mini_batch_size or None  # 0: the algorithm's default
    try:
        sizes = round_sizes(rl.batch_size, rl.group_size, ranks, rl.micro_batch_size, mini, rl.ppo_epochs)
        accumulation_steps(settings["sft"].global_batch_size, settings["sft"].micro_batch_size, ranks)
    except (SizeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if launched_here:
        setup_distributed("cpu", timeout_s=300)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))  # ranks share the cores
    rank, device = (dist.get_rank() if ranks > 1 else 0), torch.device("cpu")
    torch.manual_seed(run.seed)
    run_dir = Path(run.out_dir) / run.name
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    config = GPTConfig(
        model_settings.seq_len, model_settings.n_layer, model_settings.n_head, model_settings.d_model, 256
    )
    policy = GPT(config, seed=run.seed)
    model = DistributedDataParallel(policy) if ranks > 1 else policy
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"grpo: {sizes.describe()}; loss {rl.loss_aggregation}, normalised by {NORMALISER_UNITS[rl.loss_aggregation]}")

    latest, sft_path = run_dir / "checkpoints" / "latest.pt", run_dir / "sft.pt"
    optimizer = torch.optim.AdamW(model.parameters(), lr=rl.lr, weight_decay=0.0)
    counters = {"rounds": 0, "trajectories": 0, "completion_tokens": 0, "optimizer_steps": 0}
    if run.resume == "auto" and latest.exists():
        state = torch.load(latest, weights_only=True)
        policy.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        counters = state["counters"]
        say(f"resumed after round {counters['rounds']}")
    elif sft_path.exists() and run.resume == "auto":
        policy.load_state_dict(torch.load(sft_path, weights_only=True))
    else:
        started = time.perf_counter()
        supervised_phase(model, settings, training, rank, ranks, device)
        if rank == 0:
            save_atomically(policy.state_dict(), sft_path)
        sft_seconds = time.perf_counter() - started
        if rank == 0:  # the starting point GRPO is measured against
            before = {"sft_steps": settings["sft"].steps, "seconds": sft_seconds}
            before["held_out_reward"] = held_out_reward(policy, held_out, settings)
            (run_dir / "sft.json").write_text(json.dumps(before) + "\n")
            say(f"sft: {sft_seconds:.0f} s, held-out reward {before['held_out_reward']:.3f}")
    metrics_path = run_dir / "metrics.jsonl"
    if rank == 0:  # the lines of the rounds the checkpoint holds, and no more
        kept = metrics_path.read_text().splitlines()[: counters["rounds"]] if metrics_path.exists() else []
        metrics_path.write_text("".join(line + "\n" for line in kept))

    loss = PolicyLoss(rl.clip_ratio)
    constant = rl.norm_constant or float(rl.max_new_tokens)
    per_rank = sizes.trajectories_per_rank
    pool = [prompt for prompt, _ in training]
    while counters["rounds"] < run.rounds:
        started = time.perf_counter()
        round_index = counters["rounds"]
        # ROLLOUT: this rank samples its own trajectories; trajectory j answers prompt j // group_size.
        asked = round_prompts(run.seed, round_index, rl.batch_size, len(pool))
        mine = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        prompts = [pool[asked[j // rl.group_size]] for j in mine.tolist()]
        policy.eval()
        local = sample(policy, prompts, mine, run.seed, round_index, rl.max_new_tokens, model_settings.seq_len)
        policy.train()
        rewards = [reward(p, c) for p, c in zip(prompts, local.completions, strict=True)]
        exchanged = gather_rows(
            torch.tensor([rewards, completion_lengths(local.labels).tolist()], dtype=torch.float64).T.contiguous(),
            ranks,
        )
        group_ids = torch.arange(sizes.rollout_trajectories) // rl.group_size
        advantages = group_relative_advantages(exchanged[:, 0], group_ids, rl.scale_advantages)
        table = RoundTable(exchanged[:, 0], exchanged[:, 1].long(), group_ids, advantages)

        # UPDATE: rollout / (mini-batch · D) optimizer steps, each normalised in its objective's unit.
        results = policy_updates(
            model, optimizer, loss, local, table, sizes, rank, rl.loss_aggregation, constant, device, rl.grad_clip
        )
        statistics = loss.take_sums()
        if ranks > 1:
            dist.all_reduce(statistics)
        clipped, kl_sum, tokens_seen = statistics.tolist()

        counters["rounds"] += 1
        counters["trajectories"] += sizes.rollout_trajectories
        counters["completion_tokens"] += int(table.lengths.sum())
        counters["optimizer_steps"] += len(results)
        line = {
            **counters,
            "optimizer_steps_this_round": len(results),
            "mean_reward": float(table.rewards.mean()),
            "clip_fraction": clipped / max(tokens_seen, 1.0),
            "approx_kl": kl_sum / max(tokens_seen, 1.0),
            "surrogate": sum(r.loss for r in results) / len(results),
            "applied": sum(r.applied for r in results),
        }
        if counters["rounds"] % run.eval_every == 0:  # at the cadence only: a continued run logs what a whole one does
            line["held_out_reward"] = held_out_reward(policy, held_out, settings) if rank == 0 else None
        line["time_s"] = time.perf_counter() - started
        if rank == 0:
            with open(metrics_path, "a") as metrics:
                metrics.write(json.dumps(line) + "\n")
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}
            print(" ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
            save_atomically(
                {"model": policy.state_dict(), "optimizer": optimizer.state_dict(), "counters": counters}, latest
            )
    if launched_here:
        teardown_distributed()
    return 0


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
