"""The model factory and the loss: what turns config.model into the model and its loss.

`build_model(config.model, vocab_size, seq_len=..., seed=...)` builds the architecture `model.name` names among the
registered ones (accumulation/config/registry.py); nothing here lists the models. `loss_sum_fn_for(config.model)`
is the configured loss. `decided_model_config` decides model.loss ("auto": plain or chunked), and
`training_forward_and_loss` builds what the step runs from that decision: train.py, validation, the step-0 probe,
the equivalence checker and the benchmarks all take the model and the loss from these functions.

The model contract, what the training loop, the checkpoints and the scripts rely on and nothing more, is written
in docs/forking.md ("The model contract"): forward(inputs) -> outputs for loss_sum_fn_for, the same initial weights
on every rank from config.run.seed, buildable on the meta device, and the optional describe(), generate(),
hidden_states() with output_head, fsdp_units() and pipeline_split().
"""

import dataclasses
from collections.abc import Callable

import torch

from accumulation.config.config import Config, ConfigError, ModelConfig
from accumulation.config.registry import lookup
from accumulation.step import token_cross_entropy_sum


def resolved_vocab_size(model_config: ModelConfig, data_vocab_size: int) -> int:
    """model.vocab_size when set (> 0), else the data's. A vocabulary smaller than the data's would give
    token ids with no embedding row, so it is refused; a larger one only leaves ids that never occur."""
    asked = model_config.vocab_size
    if asked == 0:
        return data_vocab_size
    if asked < data_vocab_size:
        raise ConfigError(
            f"model.vocab_size: expected 0 (from the data) or an integer >= {data_vocab_size}, the data's "
            f"vocabulary size, got {asked}"
        )
    return asked


def build_model(model_config: ModelConfig, vocab_size: int, *, seq_len: int, seed: int) -> torch.nn.Module:
    """The model model_config.name names (config.model), with vocab_size tokens (see resolved_vocab_size), rows
    of seq_len tokens (config.data.seq_len), initialised from `seed` (config.run.seed). Built on the current
    default device: call `.to(device)` afterwards. The Config already checked that the name is registered; a build
    that returns anything but an nn.Module is a ConfigError."""
    piece = lookup("model", model_config.name)
    model = piece.build(model_config, vocab_size, seq_len=seq_len, seed=seed)
    if not isinstance(model, torch.nn.Module):
        build = getattr(piece.build, "__qualname__", "its build")
        raise ConfigError(
            f"model.name: {model_config.name}'s build ({build}) returned {type(model).__name__}, not a "
            f"torch.nn.Module; return the model (the model contract, docs/forking.md)"
        )
    return model


def model_description(model: torch.nn.Module, name: str) -> str:
    """The banner's line for the model: its describe() when it has one, else its name and parameter count."""
    describe = getattr(model, "describe", None)
    return describe() if callable(describe) else f"{name}: {count_parameters(model):,} parameters"


def model_fingerprint(model_config: ModelConfig) -> str:
    """What the chosen model's registration says about state its keys do not show (e.g. a hash of a model
    folder's config.json), "" when it says nothing: stored in checkpoints and compared on resume."""
    fingerprint = lookup("model", model_config.name).fingerprint
    return fingerprint(model_config) if fingerprint is not None else ""


def build_model_on_meta(model_config: ModelConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """The configured model on PyTorch's "meta" device: every shape, no memory and no values, so any depth or
    width is built at once. The start-up checks read it (parameter count, state dict shapes, the output head)."""
    with torch.device("meta"):
        return build_model(model_config, vocab_size, seq_len=seq_len, seed=0)  # no values: any seed


def count_parameters(model: torch.nn.Module) -> int:
    return sum(param.numel() for param in model.parameters())


def loss_sum_fn_for(model_config: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_sum_fn(outputs, labels) -> the SUM of the losses of the supervised targets (labels != -100), never
    their mean: the step divides by the global count N itself. model.objective's registered loss when it names
    one, else the model's own (register_model(..., loss_sum_fn=)), else the token cross-entropy."""
    if model_config.objective:
        return lookup("loss", model_config.objective).loss_sum_fn
    return lookup("model", model_config.name).loss_sum_fn or token_cross_entropy_sum


def decided_model_config(config: Config, model: torch.nn.Module, device: torch.device) -> ModelConfig:
    """config.model with model.loss decided, "plain" or "chunked": the one decision, which train.py, validation, the
    step-0 probe and the equivalence checker share. "plain" stays plain, and "auto" is plain off CUDA (the CPU, and
    the meta device of train.py's check before the run's device is set up); "chunked", and "auto" on CUDA, are
    decided by accumulation/models/loss_decision.py."""
    loss = "plain"
    if config.model.loss == "chunked" or (config.model.loss == "auto" and device.type == "cuda"):
        from accumulation.models.loss_decision import chunked_or_plain  # only where the chunked loss may run

        loss = chunked_or_plain(config, model, device, loss_sum_fn_for(config.model))
    return dataclasses.replace(config.model, loss=loss)


def training_forward_and_loss(
    model_config: ModelConfig, model: torch.nn.Module, compile: bool = False
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None]:
    """What the step runs: the module whose outputs go to the loss, and loss_sum_fn(outputs, labels), for
    `model_config` = decided_model_config(...) (model.loss "plain" or "chunked").

    Plain: the model itself (logits) and loss_sum_fn_for(model_config). Chunked: FinalHiddenStates(model) (the same
    parameters; the model's hidden states) and ChunkedCrossEntropySum over its output head: the same SUM.
    `compile` (model.compile resolved): both in one module, ForwardAndLoss, and None for the loss (the step then
    calls module(inputs, labels, **extras)), so that wrap_for_training compiles the forward and the loss as one
    region."""
    if model_config.loss not in ("plain", "chunked"):
        raise ValueError(f'model.loss must be decided (decided_model_config), got "{model_config.loss}"')
    if model_config.loss == "chunked":
        from accumulation.chunked_loss import ChunkedCrossEntropySum, FinalHiddenStates  # only when chosen

        forward_module, loss_sum_fn = FinalHiddenStates(model), ChunkedCrossEntropySum(model.output_head)
    else:
        forward_module, loss_sum_fn = model, loss_sum_fn_for(model_config)
    if compile:
        from accumulation.models.forward_and_loss import ForwardAndLoss  # only with model.compile

        return ForwardAndLoss(forward_module, loss_sum_fn), None
    return forward_module, loss_sum_fn
