"""model.loss = "chunked", or "auto" on CUDA: whether this model and loss run the chunked loss
(accumulation/chunked_loss.py) or the plain one (accumulation/models/factory.py, decided_model_config, the only
caller). Imported only on those paths: on the CPU "auto" is plain without asking."""

import torch

from accumulation.config.config import Config, ConfigError
from accumulation.step import token_cross_entropy_sum


def has_output_head(model: torch.nn.Module) -> bool:
    """Whether the model offers what the chunked loss needs: hidden_states() and a bias-free output_head."""
    head = getattr(model, "output_head", None)
    return hasattr(model, "hidden_states") and isinstance(head, torch.nn.Linear) and head.bias is None


def chunked_or_plain(config: Config, model: torch.nn.Module, device: torch.device, loss_sum_fn) -> str:
    """model.loss "chunked" or "auto" decided on `device`, for the configured loss (loss_sum_fn_for). "chunked" is
    refused (ConfigError) for a model without an output head or with another loss than the token cross-entropy.
    "auto" is chunked for a model that allows it, under DDP on one pipeline stage, when accumulation/chunked_loss.py
    finds it pays for the GPU's free memory, alike on every rank; plain otherwise."""
    # The chunked loss computes the token cross-entropy; a fork whose loss_sum_fn_for returns another loss keeps it.
    token_cross_entropy = loss_sum_fn is token_cross_entropy_sum
    if config.model.loss == "chunked":
        if not token_cross_entropy:
            raise ConfigError(
                'model.loss: "chunked" computes the token cross-entropy, but this model\'s loss (model.objective, '
                'or the model\'s registration) is another; use "plain" or "auto"'
            )
        if not has_output_head(model):
            raise ConfigError(
                f'model.loss: "chunked" needs a model with hidden_states() and a bias-free output_head; the '
                f'{config.model.name} model does not have them; use "plain" or "auto"'
            )
        return "chunked"
    single_stage = config.dist.pipeline_stages == 1  # with stages the loss runs on the last one, plain
    if not (config.dist.strategy == "ddp" and single_stage and token_cross_entropy and has_output_head(model)):
        return "plain"
    from accumulation.chunked_loss import chunked_loss_pays_on_cuda

    positions = config.batch.micro_batch_size * config.data.seq_len  # m·T at the configured m
    return "chunked" if chunked_loss_pays_on_cuda(positions, model.output_head.out_features, device) else "plain"
