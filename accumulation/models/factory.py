"""The model factory and the loss: what turns config.model into the model and its loss.

`build_model(config.model, vocab_size, seq_len=..., seed=...)` is used everywhere a model is made; `model.name`
chooses the architecture among the registered ones (accumulation/config/registry.py): a model registers itself in
the file that defines it (`register_model("gru", build_gru)` at the end of accumulation/models/gru.py), and a fork's
module is named by import path (`model.name = "forks.image_classifier:image-classifier"`). Nothing here lists the
models.
`loss_sum_fn_for(config.model)` is the configured loss: model.objective's registered loss, or the model's own (its
registration's loss_sum_fn), or the token cross-entropy. `decided_model_config` decides model.loss ("auto": plain or
chunked), and `training_forward_and_loss` builds what the step runs from that decision: train.py, validation,
the step-0 probe, the equivalence checker and the benchmarks all take the model and the loss from these functions.

The contract. The training loop, the checkpoints and the scripts rely on this and nothing more:

    forward(inputs) -> outputs
        inputs: what the data's rows hold: int64 token ids [rows, seq_len] for the language models, or any tensor
        [rows, ...] of any dtype (float images [rows, C, H, W], feature vectors), or a tuple of them.
        outputs: whatever loss_sum_fn_for(config.model) accepts with the
        labels (the default, accumulation.step.token_cross_entropy_sum, takes logits [rows, seq_len, vocab_size]).
        Labels hold -100 where a position has no target (padding, prompt, ignored positions); the model never
        sees them. The loss is a SUM over supervised positions, so outputs at unsupervised positions are harmless.
    the same initial weights on every rank
        drawn from a generator seeded with config.run.seed, never from the global RNG (which dropout uses and
        which differs by rank), so that DDP starts every replica equal. Building under
        `with torch.device("meta"):` must work too: build_model_on_meta does that, allocating nothing.
    describe() -> str (optional)
        the one-line banner for this model, e.g. "gpt: 875,264 parameters (4 layers, d_model 128, 4 heads,
        vocab 256)": it comes from the model, so no caller reads architecture-specific keys. Without it the
        banner says the model's name and parameter count (model_description).
    generate(prompt, num_new_tokens, generator) -> token ids (optional)
        prompt: 1-D int64 token ids; returns them followed by num_new_tokens sampled ones, drawn with the
        given torch.Generator. A model without it (the GRU here) gets no end-of-run sample.
    hidden_states(inputs) -> hidden states, and output_head (optional, for model.loss = "chunked")
        the final hidden states [rows, seq_len, d] and the bias-free nn.Linear that maps them to the logits
        forward returns. A model with both gets the chunked loss (accumulation/chunked_loss.py): the step runs
        hidden_states, and the loss applies output_head a chunk of positions at a time, never building the
        whole logits. Any other model keeps forward + loss_sum_fn(outputs, labels).
    fsdp_units() -> list of submodules (optional)
        the modules dist.strategy = "fsdp2" shards one by one, each its own all-gather and reduce-scatter (the
        GPT: its transformer blocks); the rest is sharded with the whole model. A model without it (the GRU)
        is sharded as one piece (accumulation/parallel/fsdp.py).

The vocabulary size comes from the data (256 for bytes) unless model.vocab_size asks for more:
resolved_vocab_size decides, and build_model takes the result.
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
            f"torch.nn.Module; return the model (the model contract, accumulation/models/factory.py)"
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


def has_output_head(model: torch.nn.Module) -> bool:
    """Whether the model offers what the chunked loss needs: hidden_states() and a bias-free output_head."""
    head = getattr(model, "output_head", None)
    return hasattr(model, "hidden_states") and isinstance(head, torch.nn.Linear) and head.bias is None


def decided_model_config(config: Config, model: torch.nn.Module, device: torch.device) -> ModelConfig:
    """config.model with model.loss decided, "plain" or "chunked": the one decision, which train.py, validation, the
    step-0 probe and the equivalence checker share. "chunked" is refused (ConfigError) for a model without an output
    head or with another loss than the token cross-entropy. "auto" is plain on the CPU and on the meta device
    (train.py's check before the run's device is set up); on CUDA, for a model that allows it, under DDP on one
    pipeline stage, accumulation/chunked_loss.py decides by the GPU's free memory, alike on every rank."""
    # The chunked loss computes the token cross-entropy; a fork whose loss_sum_fn_for returns another loss keeps it.
    token_cross_entropy = loss_sum_fn_for(config.model) is token_cross_entropy_sum
    loss = config.model.loss
    if loss == "chunked" and not token_cross_entropy:
        raise ConfigError(
            'model.loss: "chunked" computes the token cross-entropy, but this model\'s loss (model.objective, '
            'or the model\'s registration) is another; use "plain" or "auto"'
        )
    if loss == "chunked" and not has_output_head(model):
        raise ConfigError(
            f'model.loss: "chunked" needs a model with hidden_states() and a bias-free output_head; the '
            f'{config.model.name} model does not have them; use "plain" or "auto"'
        )
    if loss == "auto":
        single_stage = config.dist.pipeline_stages == 1  # with stages the loss runs on the last one, plain
        eligible = config.dist.strategy == "ddp" and single_stage and token_cross_entropy and has_output_head(model)
        loss = "plain"
        if device.type == "cuda" and eligible:
            from accumulation.chunked_loss import chunked_loss_pays_on_cuda  # only on a GPU

            positions = config.batch.micro_batch_size * config.data.seq_len  # m·T at the configured m
            if chunked_loss_pays_on_cuda(positions, model.output_head.out_features, device):
                loss = "chunked"
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
