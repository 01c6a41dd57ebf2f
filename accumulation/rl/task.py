"""The task of a GRPO run: its problems (prompts with reference answers), from a JSONL file (data.prompts) or the
arithmetic of configs/grpo.toml ("Q: a + b =" below data.max_operand); the reward, a function named "module:name"
(data.reward, TRL's reward_funcs), by default the arithmetic's; and the problems as rows (the SFT steps' and
validation's, one answer each)."""

import importlib
import json
import math
import numbers
import re

import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.config.registry import import_problem
from accumulation.data.rows import BYTES, DataError, RawExample, RunTokenizer

PROBLEM = re.compile(r"Q: (-?\d+) ([-+*]) (-?\d+) =")
# Every problem of "Q: a + b =" for a, b < max_operand is built in memory, about 205 bytes each with its answer row:
# 300 makes 90,000 of them, built in about 2 s; a larger task belongs in a file.
MAX_OPERAND = 300


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


def read_task(path: str, held_out: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prompt, answer) pairs for training and for validation from a JSONL file of {"prompt": ..., "response": ...}
    rows (the response: the reference answer the SFT steps train on): every tenth row, up to `held_out`, is held out.
    A DataError in one line naming the file and line for a row that is not such an object."""
    pairs = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                try:
                    row = json.loads(line)
                    pair = (row["prompt"], row["response"])
                except (ValueError, KeyError, TypeError):
                    pair = None
                if pair is None or not all(isinstance(text, str) and text for text in pair):
                    raise DataError(
                        f'{path}:{number}: expected a JSON object with non-empty "prompt" and "response" strings'
                    )
                pairs.append(pair)
    except OSError as error:
        raise DataError(f"data.prompts={path!r}: cannot read it ({error.strerror})") from None
    kept_out = -(-len(pairs) // 10)
    if held_out > kept_out:
        raise DataError(
            f"data.held_out={held_out}: only every tenth of the {len(pairs):,} rows of {path} is held out, "
            f"{kept_out:,} of them; set data.held_out={kept_out} or less"
        )
    validation = pairs[::10][:held_out]
    kept = set(validation)
    return [pair for pair in pairs if pair not in kept], validation


def reward_function(name: str):
    """The reward function data.reward names ("module:name", called as name(prompt, completion) -> float), or a
    ValueError in one line."""
    module_name, _, function_name = name.partition(":")
    problem = import_problem(module_name) if function_name else "expected module:name"
    function = None if problem else getattr(importlib.import_module(module_name), function_name, None)
    if problem or not callable(function):
        raise ValueError(f'data.reward="{name}": {problem or f"{module_name} has no function {function_name}"}')
    return function


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


def split_problems(max_operand: int, held_out: int) -> tuple[list, list]:
    """(prompt, answer) pairs for training and for validation: every tenth problem, up to data.held_out, is held
    out of both SFT and GRPO."""
    problems = addition_problems(max_operand)
    kept_out = problems[::10][:held_out]
    kept = set(kept_out)
    return [pair for pair in problems if pair not in kept], kept_out


def answer_rows(
    pairs: list[tuple[str, str]], seq_len: int, tokenizer: RunTokenizer = BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs [rows, seq_len] (the prompt's tokens, the answer's, then zeros) and labels supervising the answer's
    tokens. Prompt and answer are tokenised apart, then joined: the sampler encodes the prompt and draws the answer
    token by token after it, and a tokenizer's merge across their boundary (a prompt's " =" and an answer's " 7"
    as " = " and "7") would supervise tokens it never draws. Bytes are the same either way."""
    tokens = torch.zeros(len(pairs), seq_len + 1, dtype=torch.int64)
    labels = torch.full((len(pairs), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for i, (prompt, response) in enumerate(pairs):
        prompt_ids, response_ids = tokenizer.encode(prompt), tokenizer.encode(response)
        text = prompt_ids + response_ids
        tokens[i, : len(text)] = torch.tensor(text)
        # position j predicts token j + 1: the last prompt token predicts the answer's first, and so on
        supervised = slice(len(prompt_ids) - 1, len(text) - 1)
        labels[i, supervised] = tokens[i, supervised.start + 1 : supervised.stop + 1]
    return tokens[:, :-1], labels


def raw_row(inputs: torch.Tensor, labels: torch.Tensor) -> RawExample:
    supervised = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    last = max([*supervised, int(inputs.nonzero().max()) if inputs.any() else 0]) + 1
    return RawExample(inputs[:last].tolist(), {j: int(labels[j]) for j in supervised})


class AnswerRows:
    """Problems with their reference answers, one row each: the SFT steps' rows, and validation's (the step is
    ignored)."""

    def __init__(self, pairs: list[tuple[str, str]], seq_len: int, tokenizer: RunTokenizer = BYTES):
        self.inputs, self.labels = answer_rows(pairs, seq_len, tokenizer)

    @property
    def num_rows(self) -> int:
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]

    def examples(self, row_ids: torch.Tensor, step: int):
        return self.inputs[row_ids], self.labels[row_ids]

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        return (self.labels[row_ids] != IGNORE_INDEX).sum(dim=1)

    def raw_example(self, row_id: int, step: int) -> RawExample:
        return raw_row(self.inputs[row_id], self.labels[row_id])
