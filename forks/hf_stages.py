"""The Hugging Face fork's decoder cut into pipeline stages (HFCausalLM.pipeline_split, forks/hf_causal_lm.py):
imported only when dist.pipeline_stages > 1 asks for stages (accumulation/parallel/pipeline.py).

Each stage runs what the decoder's forward runs around its share of the layers: the embeddings (GPT-2: token
and learned positions, then dropout) on the first stage; on every stage the positions 0..T-1, the causal mask
that Hugging Face's create_causal_mask builds from them (None where the attention kernel applies causality
itself) and, for rotary models (Llama, Qwen2), the rotary position embeddings of those positions, recomputed on
each stage from the decoder's own rotary module (no parameters: nothing is shared between stages' weights); the
final norm and the output head on the last. The checker's "pipeline stages compute the forward" check runs the
stages one after another against the model's forward, so a stage that computes another function is refused."""

import torch
import torch.nn as nn

# The families whose decoders are cut here: the model_type, and the names of its embeddings, layers and final norm.
FAMILIES = {
    "gpt2": {"embeddings": ("wte", "wpe", "drop"), "layers": "h", "norm": "ln_f"},
    "llama": {"embeddings": ("embed_tokens",), "layers": "layers", "norm": "norm"},
    "qwen2": {"embeddings": ("embed_tokens",), "layers": "layers", "norm": "norm"},
}


def split_into_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """HFCausalLM.pipeline_split's stages: layers shared out as evenly as they go, the earlier stages taking the
    extra ones; a ValueError naming dist.pipeline_stages for another family or a stage without a layer."""
    hf_config = model.hf.config
    if hf_config.model_type not in FAMILIES:
        raise ValueError(
            f"dist.pipeline_stages: the Hugging Face fork cuts {', '.join(sorted(FAMILIES))} decoders into stages, "
            f"and this model is {hf_config.model_type!r}; use dist.pipeline_stages=1 (or dist.strategy=fsdp2)"
        )
    decoder = model.hf.get_decoder()
    layers = getattr(decoder, FAMILIES[hf_config.model_type]["layers"])
    if not 1 <= num_stages <= len(layers):
        raise ValueError(
            f"dist.pipeline_stages: {num_stages} stages need at least one decoder layer each, and the model has "
            f"{len(layers)}; choose at most {len(layers)} stages"
        )
    per_stage, extra = divmod(len(layers), num_stages)
    stages, first_layer = [], 0
    for stage in range(num_stages):
        end_layer = first_layer + per_stage + (stage < extra)
        stages.append(HFStage(model.hf, first_layer, end_layer, first=stage == 0, last=stage == num_stages - 1))
        first_layer = end_layer
    return stages


class HFStage(nn.Module):
    """Decoder layers [first_layer, end_layer) of a Hugging Face causal LM, with the embeddings in front on the first
    stage and the final norm and output head behind on the last. Its submodules are the model's own, so its
    parameters are the model's (the optimizer and checkpoints map them by identity)."""

    def __init__(self, hf_model: nn.Module, first_layer: int, end_layer: int, *, first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = hf_model.config, first, last
        self.family = self.config.model_type
        names, decoder = FAMILIES[self.family], hf_model.get_decoder()
        embeddings = {name: getattr(decoder, name) for name in names["embeddings"]}
        self.embeddings = nn.ModuleDict(embeddings) if first else None
        self.layers = nn.ModuleList(getattr(decoder, names["layers"])[first_layer:end_layer])
        # Rotary models: cos/sin of the positions, computed by the model's own module on each stage (buffers only).
        self.rotary = getattr(decoder, "rotary_emb", None)
        self.norm = getattr(decoder, names["norm"]) if last else None
        self.head = hf_model.get_output_embeddings() if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [rows, seq_len] on the first stage, the residual stream [rows, seq_len, hidden] after it;
        returns the residual stream, or the logits [rows, seq_len, vocab] on the last stage."""
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, seq_len], as the decoder makes them
        if self.first:
            x = self.embed(x, positions)
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
        )
        if self.family == "gpt2":
            for layer in self.layers:
                x = layer(x, None, causal_mask, position_ids=positions)
        else:
            rotary = self.rotary(x, position_ids=positions)  # (cos, sin), the same on every layer
            for layer in self.layers:
                x = layer(x, attention_mask=causal_mask, position_embeddings=rotary, position_ids=positions)
        if self.last:
            x = self.head(self.norm(x))
        return x

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.family == "gpt2":  # token and learned position embeddings, then the embedding dropout
            return self.embeddings["drop"](self.embeddings["wte"](tokens) + self.embeddings["wpe"](positions))
        return self.embeddings["embed_tokens"](tokens)
