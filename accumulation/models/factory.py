"""The model factory and the loss: what turns config.model into the model and the loss the step runs, for every
caller (what a model must do: docs/forking.md, "The model contract")."""

import dataclasses
from collections.abc import Callable

import torch

from accumulation.config.config import Config, ConfigError, ModelConfig
from accumulation.config.registry import fork_raised, lookup
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
    """The model model_config.name names, with vocab_size tokens (resolved_vocab_size), rows of seq_len tokens
    (config.data.seq_len), initialised from `seed` (config.run.seed), on the default device (then `.to(device)`)."""
    piece = lookup("model", model_config.name)
    build = getattr(piece.build, "__qualname__", "its build")
    try:
        model = piece.build(model_config, vocab_size, seq_len=seq_len, seed=seed)
    except (ConfigError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # the fork's own fault: one line, after its traceback when it is a bug
        raise ConfigError(f"model.name: {model_config.name}'s build ({build}) raised {fork_raised(error)}") from None
    if not isinstance(model, torch.nn.Module):
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


def builds_in_parts(model: torch.nn.Module) -> bool:
    """Whether a model built on the meta device can be initialised a part at a time (fsdp2's shards,
    parallel/fsdp.py; a pipeline rank's stage, parallel/pipeline.py): it yields its initial values one parameter
    at a time (`initial_values(seed)`, the GPT's) and has no buffers (to_empty would leave them without values).
    Any other model is built whole, then cut."""
    return callable(getattr(model, "initial_values", None)) and not any(True for _ in model.buffers())


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
    """config.model with model.loss decided, "plain" or "chunked", for every caller: "auto" is plain off CUDA (the
    CPU, the meta device); "chunked", and "auto" on CUDA, are decided by accumulation/models/loss_decision.py."""
    loss = "plain"
    if config.model.loss == "chunked" or (config.model.loss == "auto" and device.type == "cuda"):
        from accumulation.models.loss_decision import chunked_or_plain  # only where the chunked loss may run

        loss = chunked_or_plain(config, model, device, loss_sum_fn_for(config.model))
    return dataclasses.replace(config.model, loss=loss)


def training_forward_and_loss(
    model_config: ModelConfig, model: torch.nn.Module, compile: bool = False, loss_sum_fn: Callable | None = None
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None]:
    """What the step runs for a decided `model_config`: (module, loss_sum_fn(outputs, labels)). Plain: the model and
    `loss_sum_fn` (build_training's: the rows' RowHooks.loss_sum_fn), else loss_sum_fn_for; chunked: the model's
    hidden states (FinalHiddenStates) and ChunkedCrossEntropySum over its output head, the same SUM. With `compile`:
    (ForwardAndLoss of both, None), one region for torch.compile."""
    if model_config.loss not in ("plain", "chunked"):
        raise ValueError(f'model.loss must be decided (decided_model_config), got "{model_config.loss}"')
    if model_config.loss == "chunked":
        from accumulation.chunked_loss import ChunkedCrossEntropySum, FinalHiddenStates  # only when chosen

        forward_module, loss_sum_fn = FinalHiddenStates(model), ChunkedCrossEntropySum(model.output_head)
    else:
        forward_module, loss_sum_fn = model, loss_sum_fn or loss_sum_fn_for(model_config)
    if compile:
        from accumulation.models.forward_and_loss import ForwardAndLoss  # only with model.compile

        return ForwardAndLoss(forward_module, loss_sum_fn), None
    return forward_module, loss_sum_fn
