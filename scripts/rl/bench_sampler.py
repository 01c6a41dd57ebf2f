"""The GRPO sampler's speed against the sampler it replaced, and a round's sampling against its optimizer steps.

    python scripts/rl/bench_sampler.py --config configs/grpo.toml [section.key=value ...] [--repeats 3]

On the config's policy (its initial weights) and one round of its own prompts (data.prompts_per_round x
data.group_size rows, in forwards of data.sample_batch_size; encoded with the run's tokenizer, data.tokenizer): the
time to sample the round with the sampler of accumulation/rl/rollout.py (a key-value cache: the GPT's, or Hugging
Face's for forks/hf_causal_lm.py's models; every row in one batch) and with the sampler it replaced (kept below, as
it was but for the tokenizer: a forward over each whole prefix per token and a Python loop over the rows), and the
time of the
round's optimizer steps (rollout · ppo_epochs / G of them: forward, backward and AdamW over the round's trajectories
in micro-batches of batch.micro_batch_size, the clipped surrogate, as train.py runs them on one rank). Each figure
is the best of --repeats runs; the ratios are of figures from this one run.
"""

import sys
import time

import torch

from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch
from accumulation.config.config import ConfigError, load_config
from accumulation.data.rows import DataError
from accumulation.data.sources import build_data
from accumulation.data.uniforms import step_uniforms
from accumulation.models.factory import build_model, resolved_vocab_size
from accumulation.parallel.distributed import run_and_exit
from accumulation.rl.objectives import PolicyLoss, aggregation, completion_lengths, group_relative_advantages
from accumulation.rl.rollout import SAMPLING_STREAM, round_prompts, sample
from accumulation.step import StepSetup, optimizer_step


@torch.no_grad()
def replaced_sample(model, prompts, row_ids, seed, round_index, max_new_tokens, seq_len, encode, stop):
    """The sampler before the key-value cache, as it was (temperature 1, no nucleus) but for the prompts' encoding
    and the stop tokens, the run's, for the comparison."""
    rows = len(prompts)
    encoded = [encode(prompt) for prompt in prompts]
    tokens = torch.zeros(rows, seq_len, dtype=torch.int64)
    for i, prompt in enumerate(encoded):
        tokens[i, : len(prompt)] = torch.tensor(prompt)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    old_log_probs = torch.zeros(rows, seq_len)
    uniforms = torch.from_numpy(step_uniforms(seed, round_index, row_ids, max_new_tokens, SAMPLING_STREAM))
    device = next(model.parameters()).device
    ends = torch.tensor([len(e) for e in encoded])
    active = torch.ones(rows, dtype=torch.bool)
    for k in range(max_new_tokens):
        logits = model(tokens[:, : int(ends.max())].to(device))
        last = logits[torch.arange(rows), ends - 1].double().cpu()
        log_probs = torch.log_softmax(last, dim=-1)
        cumulative = log_probs.exp().cumsum(dim=-1)
        drawn = (cumulative <= uniforms[:, k : k + 1]).sum(dim=-1).clamp(max=last.shape[-1] - 1)
        for i in torch.nonzero(active).flatten().tolist():
            position = int(ends[i])
            tokens[i, position] = drawn[i]
            labels[i, position - 1] = drawn[i]
            old_log_probs[i, position - 1] = float(log_probs[i, drawn[i]])
            ends[i] += 1
            active[i] = int(drawn[i]) not in stop
        if not active.any():
            break
    return tokens, labels, old_log_probs


def best_of(repeats: int, run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def main(argv: list[str]) -> int:
    repeats = 3
    if "--repeats" in argv:
        at = argv.index("--repeats")
        repeats, argv = int(argv[at + 1]), argv[:at] + argv[at + 2 :]
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if config.data.source != "arithmetic-rollouts":  # a GRPO config's rounds are what it samples
        print(
            f'error: data.source must be "arithmetic-rollouts" (GRPO), got {config.data.source!r}; '
            "e.g. --config configs/grpo.toml",
            file=sys.stderr,
        )
        return 2
    rl, seq_len, seed = config.data.own, config.data.seq_len, config.run.seed
    try:  # the run's prompts and tokenizer, as train.py builds them
        data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=seed)
        vocab_size = resolved_vocab_size(config.model, data.vocab_size)
    except (ConfigError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    task = data.train
    torch.manual_seed(seed)
    policy = build_model(config.model, vocab_size, seq_len=seq_len, seed=seed).eval()
    pool = task.prompts
    rollout = rl.prompts_per_round * rl.group_size
    asked = round_prompts(seed, 0, rl.prompts_per_round, len(pool))
    prompts = [pool[asked[j // rl.group_size]] for j in range(rollout)]
    rows = torch.arange(rollout)
    chunks = [slice(first, first + rl.sample_batch_size) for first in range(0, rollout, rl.sample_batch_size)]

    def new():
        return [sample(policy, prompts[c], rows[c], seed, 0, task.drawing, seq_len, task.tokenizer) for c in chunks]

    def old():
        encode, stop = task.tokenizer.encode, task.drawing.stop
        return [
            replaced_sample(policy, prompts[c], rows[c], seed, 0, rl.max_new_tokens, seq_len, encode, stop)
            for c in chunks
        ]

    new_s, drawn = best_of(repeats, new)
    old_s, _ = best_of(repeats, old)
    tokens = torch.cat([d.tokens for d in drawn])
    labels = torch.cat([d.labels for d in drawn])
    old_log_probs = torch.cat([d.old_log_probs for d in drawn])
    group_ids = rows // rl.group_size
    advantages = group_relative_advantages(torch.rand(rollout, dtype=torch.float64), group_ids)
    global_batch, micro = config.batch.global_batch_size, config.batch.micro_batch_size
    steps = rollout * rl.ppo_epochs // global_batch
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    loss = PolicyLoss(rl.objective())

    def optimizer_steps():
        for step in range(steps):
            first = step * global_batch % rollout
            selected = slice(first, first + global_batch)
            declared = aggregation(
                rl.loss_aggregation, completion_lengths(labels[selected]), group_ids[selected], loss.objective.constant
            )
            batches = []
            for start in range(first, first + global_batch, micro):
                part = slice(start, start + micro)
                extras = {
                    "advantages": advantages[part],
                    "old_log_probs": old_log_probs[part],
                    "row_weights": declared.row_weights[start - first : start - first + micro],
                }
                batches.append(MicroBatch(tokens[part], labels[part], micro, extras))
            counts = GlobalCounts(declared.normaliser, global_batch)
            optimizer_step(
                StepSetup(policy, torch.device("cpu"), loss_sum_fn=loss), batches, optimizer, global_counts=counts
            )
            loss.take_sums()

    steps_s, _ = best_of(repeats, optimizer_steps)
    print(
        f"round: {rollout} trajectories ({rl.prompts_per_round} prompts x group {rl.group_size}), up to "
        f"{rl.max_new_tokens} new tokens, forwards of {rl.sample_batch_size} rows; {torch.get_num_threads()} threads"
    )
    print(f"sampler (key-value cache, rows batched): {new_s:.3f} s")
    print(f"the sampler it replaced:                 {old_s:.3f} s  ({old_s / new_s:.1f}x the time)")
    print(f"the round's {steps} optimizer steps (G {global_batch}, m {micro}): {steps_s:.3f} s")
    print(f"sampling / optimizer steps: {new_s / steps_s:.2f} (the replaced sampler: {old_s / steps_s:.2f})")
    return 0


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1:])
