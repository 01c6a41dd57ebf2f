"""The GPT cut into pipeline stages (GPT.pipeline_split, accumulation/models/gpt.py): imported only when
dist.pipeline_stages > 1 asks for stages (accumulation/parallel/pipeline.py)."""

import torch
import torch.nn as nn


def split_into_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """GPT.pipeline_split's stages of `model` (a GPT): blocks shared out as evenly as they go, the earlier stages
    taking the extra ones; a ValueError naming dist.pipeline_stages when a stage would hold no block."""
    n_layer = len(model.blocks)
    if not 1 <= num_stages <= n_layer:
        raise ValueError(
            f"dist.pipeline_stages: {num_stages} stages need at least one transformer block each, and "
            f"model.n_layer is {n_layer}; choose at most {n_layer} stages or more layers"
        )
    per_stage, extra = divmod(n_layer, num_stages)
    stages, first_block = [], 0
    for stage in range(num_stages):
        end_block = first_block + per_stage + (stage < extra)
        stages.append(GPTStage(model, first_block, end_block, first=stage == 0, last=stage == num_stages - 1))
        first_block = end_block
    return stages


class GPTStage(nn.Module):
    """One pipeline stage of a GPT (GPT.pipeline_split): blocks [first_block, end_block), with the embeddings in
    front on the first stage and the final norm and output head behind on the last. Its submodules are the
    GPT's own, so its parameters are the GPT's parameters (the optimizer and checkpoints map them by identity)."""

    def __init__(self, model: nn.Module, first_block: int, end_block: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.token_embedding = model.token_embedding
            self.position_embedding = model.position_embedding
            self.embed_dropout = model.embed_dropout
        self.blocks = nn.ModuleList(model.blocks[first_block:end_block])
        if last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [rows, seq_len] on the first stage, the residual stream [rows, seq_len, d_model] after it;
        returns the residual stream, or the logits [rows, seq_len, vocab_size] on the last stage."""
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed_dropout(self.token_embedding(x) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.final_norm(x))
        return x
