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
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX
from accumulation.data.rows import BYTES, DataError, RunTokenizer
from accumulation.data.uniforms import step_uniforms
from accumulation.models.gpt import GPT

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


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: π_T = softmax(logits / temperature), restricted to its top-p nucleus (the fewest
    most likely tokens whose probability reaches top_p) when top_p < 1, each completion ending at its first stop
    token or at max_new_tokens. greedy takes the most likely token instead."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[int, ...] = (END_OF_ANSWER,)
    greedy: bool = False


def stop_tokens(stop: str, tokenizer: RunTokenizer = BYTES) -> tuple[int, ...]:
    """The token ids of data.stop's characters, each a stop token: under bytes, each character's UTF-8 bytes; under
    a tokenizer, each character must be one token of it (a character it writes as two tokens, or drops, could never
    be drawn as one token), else a DataError in one line naming it."""
    if not tokenizer.files:
        return tuple(stop.encode())
    ids = []
    for character in stop:
        encoded = tokenizer.encode(character)
        if len(encoded) != 1:
            raise DataError(
                f"data.stop: {character!r} is {len(encoded)} tokens under {tokenizer.files[0]} ({encoded}), not "
                "one; each character of data.stop must be a single token of the tokenizer"
            )
        ids += encoded
    return tuple(ids)


def draw(log_probs: torch.Tensor, uniforms: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row from log π_T [rows, vocab] (float64) at the row's uniform [rows]: the first token, in
    vocabulary order, whose cumulative probability within the nucleus exceeds u (the clamp guards the last token
    against a total just below 1 by rounding). The same (logits, u) always give the same token."""
    if sampling.greedy:
        return log_probs.argmax(dim=-1)
    probabilities = log_probs.exp()
    if sampling.top_p < 1:
        ordered, order = probabilities.sort(dim=-1, descending=True, stable=True)
        before = ordered.cumsum(dim=-1) - ordered  # the probability of the more likely tokens
        keep = torch.zeros_like(probabilities, dtype=torch.bool).scatter_(-1, order, before < sampling.top_p)
        probabilities = probabilities * keep
        probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
    cumulative = probabilities.cumsum(dim=-1)
    return (cumulative <= uniforms[:, None]).sum(dim=-1).clamp(max=log_probs.shape[-1] - 1)


class FullForward:
    """Next-token logits from a forward over each row's whole prefix: any causal model."""

    def __init__(self, model: torch.nn.Module, rows: int, seq_len: int):
        self.model = model

    def logits(self, tokens: torch.Tensor, ends: torch.Tensor, first: bool) -> torch.Tensor:
        """The logits [rows, vocab] predicting position ends[i] of each row (tokens on the model's device)."""
        return self.model(tokens[:, : int(ends.max())])[torch.arange(len(ends), device=ends.device), ends - 1]


class GPTKeyValueCache:
    """Next-token logits of the project's GPT (accumulation/models/gpt.py) with a key-value cache: the prompts' keys
    and values once, then one position per row per token. Rows sit at their own positions (prompts of different
    lengths, right-padded): the new token of row i is at ends[i] − 1, and attends to that row's positions up to it.
    Eval mode only (no dropout), as the sampler runs it."""

    def __init__(self, model: torch.nn.Module, rows: int, seq_len: int):
        self.model = model
        config, device, dtype = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
        shape = (rows, config.n_head, seq_len, config.d_model // config.n_head)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]

    def logits(self, tokens: torch.Tensor, ends: torch.Tensor, first: bool) -> torch.Tensor:
        model = self.model
        rows = torch.arange(len(ends), device=ends.device)  # every row, indexing tensors where the model is
        if first:  # every prompt's positions at once, causal: a position never sees the padding after it
            width = int(ends.max())
            positions = torch.arange(width, device=tokens.device)
            x = model.token_embedding(tokens[:, :width]) + model.position_embedding(positions)
            for block, keys, values in zip(model.blocks, self.keys, self.values, strict=True):
                q, k, v = self.heads(block, block.attn_norm(x))
                keys[:, :, :width], values[:, :, :width] = k, v
                x = self.after_attention(block, x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return model.lm_head(model.final_norm(x))[rows, ends - 1]
        position = ends - 1  # each row's newest token
        x = (model.token_embedding(tokens[rows, position]) + model.position_embedding(position))[:, None]
        seen = torch.arange(self.keys[0].shape[2], device=tokens.device)[None, :] <= position[:, None]
        for block, keys, values in zip(model.blocks, self.keys, self.values, strict=True):
            q, k, v = self.heads(block, block.attn_norm(x))
            keys[rows, :, position], values[rows, :, position] = k[:, :, 0], v[:, :, 0]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None, None, :])
            x = self.after_attention(block, x, attended)
        return model.lm_head(model.final_norm(x))[:, 0]

    @staticmethod
    def heads(block, h: torch.Tensor):
        rows, length, d_model = h.shape
        q, k, v = block.attn.qkv(h).split(d_model, dim=2)
        return (t.view(rows, length, block.attn.n_head, -1).transpose(1, 2) for t in (q, k, v))

    @staticmethod
    def after_attention(block, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        rows, _, length, _ = attended.shape
        x = x + block.attn.proj(attended.transpose(1, 2).reshape(rows, length, -1))
        return x + block.mlp(block.mlp_norm(x))


def decoder_for(model: torch.nn.Module, rows: int, seq_len: int):
    """The key-value cache where the model is the project's GPT, or the model's own where it declares one (the
    optional `key_value_decoder(rows, seq_len)` of the model contract: forks/hf_causal_lm.py's), else a forward over
    the whole prefix per token."""
    if isinstance(model, GPT):
        return GPTKeyValueCache(model, rows, seq_len)
    own = getattr(model, "key_value_decoder", None)
    return own(rows, seq_len) if own is not None else FullForward(model, rows, seq_len)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[str],
    row_ids: torch.Tensor,
    seed: int,
    round_index: int,
    sampling: Sampling,
    seq_len: int,
    tokenizer: RunTokenizer = BYTES,
) -> Trajectories:
    """Complete each prompt with up to `sampling.max_new_tokens` tokens from the policy, all rows in one batch, row i
    drawing the uniforms of (seed, round_index, row_ids[i]). The prompts are encoded, and the completions decoded,
    with `tokenizer` (bytes by default). The log-probability of each drawn token under π_T (the temperature's,
    before the nucleus: what the loss computes) is recorded for PPO's ratio. Rows are right-padded; a causal model's
    logits at a position never see the padding after it."""
    rows, max_new_tokens = len(prompts), sampling.max_new_tokens
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    if max(len(e) for e in encoded) + max_new_tokens > seq_len:
        raise ValueError(f"prompts plus {max_new_tokens} new tokens exceed the model's {seq_len} positions")
    tokens = torch.zeros(rows, seq_len, dtype=torch.int64)
    for i, prompt in enumerate(encoded):
        tokens[i, : len(prompt)] = torch.tensor(prompt)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    old_log_probs = torch.zeros(rows, seq_len)
    uniforms = torch.from_numpy(step_uniforms(seed, round_index, row_ids, max_new_tokens, SAMPLING_STREAM))
    device = next(model.parameters()).device  # the rows are built on the host, the forward runs where the model is
    ends = torch.tensor([len(e) for e in encoded])  # the next position to fill, per row
    active = torch.ones(rows, dtype=torch.bool)
    stop = torch.tensor(sampling.stop, dtype=torch.int64)
    decoder = decoder_for(model, rows, seq_len)
    on_device = tokens.to(device)
    for k in range(max_new_tokens):
        last = decoder.logits(on_device, ends.to(device), first=k == 0).double().cpu()  # predicting position `ends`
        log_probs = torch.log_softmax(last / sampling.temperature, dim=-1)
        drawn = draw(log_probs, uniforms[:, k], sampling)
        writing = active.nonzero().flatten()
        position = ends[writing]
        tokens[writing, position] = drawn[writing]
        labels[writing, position - 1] = drawn[writing]
        old_log_probs[writing, position - 1] = log_probs[writing, drawn[writing]].float()
        ends[writing] += 1
        active &= ~torch.isin(drawn, stop)
        if not active.any():
            break
        on_device[writing, position] = drawn[writing].to(device)
    completions = [tokenizer.decode(tokens[i, len(encoded[i]) : int(ends[i])].tolist()) for i in range(rows)]
    return Trajectories(tokens, labels, old_log_probs, completions)
