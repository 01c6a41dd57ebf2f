"""A small GPT: pre-norm transformer blocks with causal attention, token ids [rows, seq_len] to logits
[rows, seq_len, vocab_size]. Its weights are drawn from an explicit generator, the same on every rank and in every
dtype (build in float32, then `.double()`). Registered as `model.name = "gpt"`, at the end."""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from accumulation.config.registry import register_model


@dataclass
class GPTConfig:
    seq_len: int  # longest input the position table covers, in tokens
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int  # token ids run from 0 to vocab_size - 1
    dropout: float = 0.0


class SelfAttention(nn.Module):
    """Multi-head self-attention; causal: position j attends to positions <= j only (the GPT), else to every
    position (the encoder, accumulation/models/encoder.py)."""

    def __init__(self, config: GPTConfig, causal: bool = True):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.causal = causal
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq_len, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        # [rows, seq_len, d_model] -> [rows, n_head, seq_len, head_dim]
        q, k, v = (t.view(rows, seq_len, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout_p)
        return self.proj(y.transpose(1, 2).reshape(rows, seq_len, d_model))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). The GPT's blocks are causal, the encoder's not."""

    def __init__(self, config: GPTConfig, causal: bool = True):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config, causal)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x)))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.initialise(seed)

    @torch.no_grad()
    def initialise(self, seed: int) -> None:
        """Every parameter set to its value from initial_values(seed)."""
        parameters = dict(self.named_parameters())
        for name, value in self.initial_values(seed):
            parameters[name].copy_(value)

    def initial_values(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole initial value on the host) for each parameter in turn, one tensor alive at a time: Normal(0,
        0.02) weights, zero biases, unit norms; residual projections scaled by 1/sqrt(2·n_layer) so the residual
        stream's variance does not grow with depth (GPT-2's rule). One generator draws them in parameter order, so
        a sharded build (accumulation/parallel/fsdp.py, initialise_shards) that keeps each rank's rows of each value
        starts from the weights of a one-process build, bit for bit."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / (2 * self.config.n_layer) ** 0.5
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                yield name, torch.zeros(param.shape)
            elif "norm" in name:
                yield name, torch.ones(param.shape)
            else:
                std = residual_std if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                yield name, torch.randn(param.shape, generator=generator) * std

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states [rows, seq_len, d_model] that lm_head maps to logits (model.loss = "chunked")."""
        rows, seq_len = tokens.shape
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.embed_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)

    @property
    def output_head(self) -> nn.Linear:
        """The layer from hidden_states() to logits: what the chunked loss needs besides the hidden states."""
        return self.lm_head

    def fsdp_units(self) -> list[nn.Module]:
        """The modules dist.strategy = "fsdp2" shards one by one (docs/sharding.md): the transformer blocks."""
        return list(self.blocks)

    def pipeline_split(self, num_stages: int) -> list[nn.Module]:
        """The model cut into `num_stages` pipeline stages of its own modules (dist.pipeline_stages): token ids in,
        runs of blocks, logits out (docs/forking.md, "Pipeline stages for your model")."""
        from accumulation.models.gpt_stages import split_into_stages  # imported only for dist.pipeline_stages > 1

        return split_into_stages(self, num_stages)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per position, for MFU: 6 per parameter that multiplies (forward 2, backward 4; embedding
        tables are looked up, not multiplied), plus attention's 12 · n_layer · d_model · seq_len (Q·Kᵀ and the
        weighted sum of V, 2 FLOPs per multiply-add, times 3 for forward and backward), counting the whole
        seq_len x seq_len square as the usual convention does (PaLM, Chowdhery et al. 2022, appendix B)."""
        config = self.config
        tables = self.token_embedding.weight.numel() + self.position_embedding.weight.numel()
        multiplying = self.num_parameters() - tables
        return 6 * multiplying + 12 * config.n_layer * config.d_model * config.seq_len

    def describe(self) -> str:
        """The banner's line, e.g. "gpt: 875,264 parameters (4 layers, d_model 128, 4 heads, vocab 256)"."""
        config = self.config
        return (
            f"gpt: {self.num_parameters():,} parameters ({config.n_layer} layers, d_model {config.d_model}, "
            f"{config.n_head} heads, vocab {config.vocab_size})"
        )

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, num_new_tokens: int, generator: torch.Generator) -> torch.Tensor:
        """Sample `num_new_tokens` tokens after `prompt` (1-D token ids), each from the softmax of the logits."""
        tokens = prompt.view(1, -1)
        for _ in range(num_new_tokens):
            logits = self(tokens[:, -self.config.seq_len :])[0, -1].float()
            probabilities = torch.softmax(logits, dim=-1)
            next_token = torch.multinomial(probabilities.cpu(), 1, generator=generator).to(tokens.device)
            tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
        return tokens[0]


def gpt_config(model_config, vocab_size: int, seq_len: int) -> GPTConfig:
    """The GPT's shape from config.model (n_layer, n_head, d_model, dropout) and the data's vocabulary and seq_len."""
    return GPTConfig(
        seq_len=seq_len,
        n_layer=model_config.n_layer,
        n_head=model_config.n_head,
        d_model=model_config.d_model,
        vocab_size=vocab_size,
        dropout=model_config.dropout,
    )


def check_heads_divide_width(config) -> None:
    """The heads split d_model evenly (the GPT, and the encoder built of its blocks)."""
    model = config.model
    if model.d_model % model.n_head != 0:
        raise ValueError(
            f"model.d_model: expected a multiple of model.n_head ({model.n_head}) for the {model.name}, "
            f"got {model.d_model}"
        )


def build_gpt(model_config, vocab_size: int, *, seq_len: int, seed: int) -> GPT:
    return GPT(gpt_config(model_config, vocab_size, seq_len), seed=seed)


register_model("gpt", build_gpt, check=check_heads_divide_width)
