"""A fork's GPT with its output head tied to the token embedding (GPT-2's wte / lm_head): one Parameter used by
the first layer and by the last. The built-in "gpt" is its untied twin. Named in a config as
`model.name = "tests.tied_gpt:tied-gpt"` (tests/test_pipeline_ties.py)."""

from accumulation.config.registry import register_model
from accumulation.models.gpt import build_gpt


def build_tied_gpt(model_config, vocab_size: int, *, seq_len: int, seed: int):
    model = build_gpt(model_config, vocab_size, seq_len=seq_len, seed=seed)
    # Both are [vocab_size, d_model]: the head's logits are the hidden state's dot products with the embeddings.
    model.lm_head.weight = model.token_embedding.weight
    return model


register_model("tied-gpt", build_tied_gpt)
