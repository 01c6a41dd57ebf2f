"""Rollouts: a round's prompts and the completions sampled from the policy, with randomness that is a pure function
of (seed, round, row); the task they answer and its reward are task.py's.

Sampling draws every random number from step_uniforms(seed, round, row ids, ...), never from a global
generator: trajectory r of round k gets the same uniforms on any rank, in any batch, and after any restart,
so with the same weights a resumed run samples the same completions bit for bit. A token is drawn by inverting
the cumulative distribution of the policy's softmax, in float64, at the uniform: the same (logits, u) always give
the same token.
"""

from dataclasses import dataclass

import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.data.uniforms import step_uniforms

# Independent streams of step_uniforms for one round: which prompts it asks, and the tokens its completions draw.
PROMPT_STREAM, SAMPLING_STREAM = 11, 12
END_OF_ANSWER = ord("\n")  # a completion ends at its first newline (or at the token budget)


def round_prompts(seed: int, round_index: int, prompts: int, pool: int) -> list[int]:
    """Indices into the prompt pool of round `round_index`'s prompts, drawn with replacement: a pure function
    of (seed, round)."""
    uniforms = step_uniforms(seed, round_index, torch.arange(prompts), 1, PROMPT_STREAM)[:, 0]
    return [int(u * pool) for u in uniforms]


@dataclass
class Trajectories:
    """Sampled completions, one row each, as the step and the loss read them (host tensors)."""

    tokens: torch.Tensor  # int64 [rows, seq_len]: prompt, completion, then zeros
    labels: torch.Tensor  # int64 [rows, seq_len]: the next completion token, IGNORE_INDEX elsewhere
    old_log_probs: torch.Tensor  # float32 [rows, seq_len]: log π_old(label) at sampling time, 0 elsewhere
    completions: list[str]


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[str],
    row_ids: torch.Tensor,
    seed: int,
    round_index: int,
    max_new_tokens: int,
    seq_len: int,
    greedy: bool = False,
) -> Trajectories:
    """Complete each prompt with up to `max_new_tokens` bytes from the policy, row i drawing the uniforms of
    (seed, round_index, row_ids[i]); greedy takes the most likely byte instead. The log-probability of each drawn
    byte under the policy is recorded for PPO's ratio. Rows are right-padded; a causal model's logits at a
    position never see the padding after it."""
    rows = len(prompts)
    encoded = [list(prompt.encode()) for prompt in prompts]
    if max(len(e) for e in encoded) + max_new_tokens > seq_len:
        raise ValueError(f"prompts plus {max_new_tokens} new bytes exceed the model's {seq_len} positions")
    tokens = torch.zeros(rows, seq_len, dtype=torch.int64)
    for i, prompt in enumerate(encoded):
        tokens[i, : len(prompt)] = torch.tensor(prompt)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    old_log_probs = torch.zeros(rows, seq_len)
    uniforms = torch.from_numpy(step_uniforms(seed, round_index, row_ids, max_new_tokens, SAMPLING_STREAM))
    device = next(model.parameters()).device  # the rows are built on the host, the forward runs where the model is
    ends = torch.tensor([len(e) for e in encoded])  # the next position to fill, per row
    active = torch.ones(rows, dtype=torch.bool)
    for k in range(max_new_tokens):
        logits = model(tokens[:, : int(ends.max())].to(device))
        last = logits[torch.arange(rows), ends - 1].double().cpu()  # the logits that predict position `ends`
        log_probs = torch.log_softmax(last, dim=-1)
        if greedy:
            drawn = log_probs.argmax(dim=-1)
        else:
            # Inverse CDF: the first byte whose cumulative probability exceeds u (the clamp guards the last
            # byte against a total just below 1 by rounding).
            cumulative = log_probs.exp().cumsum(dim=-1)
            drawn = (cumulative <= uniforms[:, k : k + 1]).sum(dim=-1).clamp(max=last.shape[-1] - 1)
        for i in torch.nonzero(active).flatten().tolist():
            position = int(ends[i])
            tokens[i, position] = drawn[i]
            labels[i, position - 1] = drawn[i]
            old_log_probs[i, position - 1] = float(log_probs[i, drawn[i]])
            ends[i] += 1
            active[i] = drawn[i] != END_OF_ANSWER
        if not active.any():
            break
    completions = [
        bytes(tokens[i, len(encoded[i]) : int(ends[i])].tolist()).decode("utf-8", errors="replace") for i in range(rows)
    ]
    return Trajectories(tokens, labels, old_log_probs, completions)
