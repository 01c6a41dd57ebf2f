"""A bidirectional transformer encoder for masked language modelling (BERT's shape, pre-norm).

The GPT's blocks (accumulation/models/gpt.py's Block) without the causal mask: every position attends to every
other, so the model can use the tokens on both sides of a masked position to predict it. It maps token ids
[rows, seq_len] to logits [rows, seq_len, vocab_size] (the vocabulary includes the [MASK] token), and is trained
only at the masked positions, whose labels the data supplies (accumulation/data/masked_lm.py). Initial weights come
from an explicit generator seeded with config.run.seed, so every rank and every build start equal.
"""

import torch
import torch.nn as nn

from accumulation.config.registry import register_model
from accumulation.models.gpt import Block, GPTConfig, check_heads_divide_width, gpt_config


class Encoder(nn.Module):
    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, causal=False) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # normal(0, 0.02) matrices, zero biases, unit norms
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def describe(self) -> str:
        config = self.config
        return (
            f"encoder: {sum(p.numel() for p in self.parameters()):,} parameters ({config.n_layer} bidirectional "
            f"layers, d_model {config.d_model}, {config.n_head} heads, vocab {config.vocab_size} with [MASK])"
        )


def check_masked_data(config) -> None:
    """It sees every input position, the next one included: next-token prediction would be copying."""
    check_heads_divide_width(config)
    if config.data.task != "masked":
        raise ValueError(
            f'model.name: the encoder sees every input position, so it needs data.task = "masked", got '
            f'"{config.data.task}"; use model.name = "gpt" for next-token prediction'
        )


def build_encoder(model_config, vocab_size: int, *, seq_len: int, seed: int) -> Encoder:
    return Encoder(gpt_config(model_config, vocab_size, seq_len), seed=seed)


register_model("encoder", build_encoder, check=check_masked_data)  # the masked-LM fork (docs/forking.md, example 4)
