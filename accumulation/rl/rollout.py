"""Rollouts on a verifiable task: arithmetic prompts, completions sampled from the policy with randomness that is
a pure function of (seed, round, row), and rewards computed by a function.

Sampling draws every random number from step_uniforms(seed, round, row ids, ...), never from a global
generator: trajectory r of round k gets the same uniforms on any rank, in any batch, and after any restart,
so with the same weights a resumed run samples the same completions bit for bit. A token is drawn by inverting
the cumulative distribution of the policy's softmax, in float64, at the uniform: the same (logits, u) always give
the same token.
"""

import json
import math
import numbers
import re
from dataclasses import dataclass

import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.data.rows import DataError
from accumulation.data.uniforms import step_uniforms

# Independent streams of step_uniforms for one round: which prompts it asks, and the tokens its completions draw.
PROMPT_STREAM, SAMPLING_STREAM = 11, 12
END_OF_ANSWER = ord("\n")  # a completion ends at its first newline (or at the token budget)
PROBLEM = re.compile(r"Q: (-?\d+) ([-+*]) (-?\d+) =")


def read_prompts(path: str) -> list[str]:
    """The prompts of a {"prompt", "response"} JSONL file whose prompts read 'Q: a op b =' (op one of + - *).
    The responses are not read here: the reward is computed from the prompt."""
    prompts = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            prompt = json.loads(line)["prompt"]
            if PROBLEM.fullmatch(prompt) is None:
                raise ValueError(f"{path}:{number}: prompt {prompt!r} is not of the form 'Q: a op b ='")
            prompts.append(prompt)
    return prompts


def addition_problems(max_operand: int) -> list[tuple[str, str]]:
    """Every 'Q: a + b =' with 0 <= a, b < max_operand, with its answer as the response (' 57\\n'), in a fixed
    order: the same problems, in the same format, as data/sft_arithmetic.jsonl's, small enough to learn on a CPU."""
    return [(f"Q: {a} + {b} =", f" {a + b}\n") for a in range(max_operand) for b in range(max_operand)]


def answer(prompt: str) -> int:
    """The true result of 'Q: a op b ='."""
    left, operator, right = PROBLEM.fullmatch(prompt).groups()
    a, b = int(left), int(right)
    return a + b if operator == "+" else a - b if operator == "-" else a * b


def reward(prompt: str, completion: str) -> float:
    """1 when the completion's last number (after any working, 'a * 40 + ... = 1234') is the true result, else 0."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and int(numbers[-1]) == answer(prompt))


def checked_reward(reward_fn, prompt: str, completion: str) -> float:
    """reward_fn(prompt, completion) as a float, or a DataError naming the prompt and the completion when the
    function raises or returns anything but a finite number: a NaN or inf reward would make every advantage of its
    group non-finite, and the run would skip every update for a "non-finite gradient" without naming the reward."""
    name = f"{getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__qualname__', repr(reward_fn))}"
    where = f"on prompt {prompt!r} and completion {completion!r}"
    try:
        value = reward_fn(prompt, completion)
    except Exception as error:  # the fork's function, whatever it raises: one line that names the input
        raise DataError(
            f"the reward function {name} raised {type(error).__name__}: {error} {where}; fix the function"
        ) from error
    if not isinstance(value, numbers.Real):
        raise DataError(
            f"the reward function {name} returned {value!r} ({type(value).__name__}) {where}; it must return a float"
        )
    if not math.isfinite(value):
        raise DataError(
            f"the reward function {name} returned {value} {where}; it must return a finite float (a non-finite "
            "reward makes its group's advantages, and every gradient, non-finite)"
        )
    return float(value)


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
