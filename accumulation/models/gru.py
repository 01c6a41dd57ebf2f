"""A GRU language model: the second architecture, from a different family than the GPT.

It is here to prove the model seam by use, and it keeps the contract every model keeps (accumulation/models/factory.py
states it in full):

    forward(tokens) -> logits    int64 token ids [rows, seq_len] -> [rows, seq_len, vocab_size], the outputs
                                 the loss takes with the labels
    same initial weights         drawn from an explicit generator seeded with `seed`: the same on every rank and
                                 in every dtype (build in float32, then `.double()`), and built on the meta device
                                 too (shapes only, no memory)
    describe()                   the banner's line

It deliberately has no `generate`: it is the example of a model without one, for which the end-of-run sample
is skipped.

A GRU reads left to right, so the logits at position t depend on tokens 0..t only, as next-token prediction
requires; the GPT gets the same from its causal mask.
"""

import torch
import torch.nn as nn

from accumulation.config.registry import register_model


class GRULanguageModel(nn.Module):
    """token embedding -> GRU (n_layer layers, d_model wide) -> LayerNorm -> linear head to vocabulary logits."""

    def __init__(self, vocab_size: int, d_model: int, n_layer: int, dropout: float, seed: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layer = n_layer
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        # nn.GRU drops out the outputs of every layer but the last, so one layer has nothing to drop
        # (and PyTorch warns if asked to).
        self.gru = nn.GRU(d_model, d_model, num_layers=n_layer, batch_first=True, dropout=dropout if n_layer > 1 else 0)
        self.final_norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.initialise(seed)

    @torch.no_grad()
    def initialise(self, seed: int) -> None:
        """Embedding Normal(0, 1), unit-scale inputs to the GRU; every GRU weight and bias Uniform(-k, k) with
        k = 1/sqrt(d_model), PyTorch's own rule for a GRU; unit norm; head Normal(0, 0.02), so the first logits
        are nearly equal and the first loss is close to ln(vocab_size)."""
        generator = torch.Generator().manual_seed(seed)
        self.token_embedding.weight.copy_(torch.randn(self.token_embedding.weight.shape, generator=generator))
        bound = self.d_model**-0.5
        for param in self.gru.parameters():  # always in the same order: layer by layer, weights then biases
            uniform_0_1 = torch.rand(param.shape, generator=generator)
            param.copy_((2 * uniform_0_1 - 1) * bound)
        self.final_norm.weight.fill_(1.0)
        self.final_norm.bias.zero_()
        self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=generator) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden_states, _ = self.gru(self.token_embedding(tokens))  # [rows, seq_len, d_model]; starts from zeros
        return self.lm_head(self.final_norm(hidden_states))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> str:
        """The banner's line, e.g. "gru: 462,080 parameters (4 layers, d_model 128, vocab 256)"."""
        return (
            f"gru: {self.num_parameters():,} parameters ({self.n_layer} layers, d_model {self.d_model}, "
            f"vocab {self.vocab_size})"
        )


def build_gru(model_config, vocab_size: int, *, seq_len: int, seed: int) -> GRULanguageModel:
    """model.n_layer GRU layers of width model.d_model; a GRU reads rows of any length, so seq_len is not needed."""
    model = model_config
    return GRULanguageModel(vocab_size, model.d_model, model.n_layer, model.dropout, seed=seed)


register_model("gru", build_gru)
