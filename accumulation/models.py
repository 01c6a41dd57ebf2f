"""The model factory and the loss: what turns config.model into the model and its loss.

`build_model(config.model, vocab_size, seq_len=..., seed=...)` is used everywhere a model is made; `model.name`
chooses the architecture among the registered ones (accumulation/registry.py): a model registers itself in the
file that defines it (`register_model("gru", build_gru)` at the end of accumulation/gru.py), and a fork's module is
named by import path (`model.name = "forks.image_classifier:image-classifier"`). Nothing here lists the models.
`loss_sum_fn_for(config.model)` is the loss train.py, validation and the equivalence checker use: model.objective's
registered loss, or the model's own (its registration's loss_sum_fn), or the token cross-entropy.

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
        `with torch.device("meta"):` must work too: count_parameters does that, allocating nothing.
    describe() -> str
        the one-line banner for this model, e.g. "gpt: 875,264 parameters (4 layers, d_model 128, 4 heads,
        vocab 256)": it comes from the model, so no caller reads architecture-specific keys.
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
        is sharded as one piece (accumulation/fsdp.py).

The vocabulary size comes from the data (256 for bytes) unless model.vocab_size asks for more:
resolved_vocab_size decides, and build_model takes the result.
"""

from collections.abc import Callable

import torch

from accumulation.chunked_loss import ChunkedCrossEntropySum, FinalHiddenStates
from accumulation.config import ConfigError, DistConfig, ModelConfig
from accumulation.model import gpt_config  # noqa: F401 (re-exported: scripts build the GPT's shape from config.model)
from accumulation.registry import lookup
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
    default device: call `.to(device)` afterwards. The Config already checked that the name is registered."""
    piece = lookup("model", model_config.name)
    return piece.build(model_config, vocab_size, seq_len=seq_len, seed=seed)


def model_fingerprint(model_config: ModelConfig) -> str:
    """What the chosen model's registration says about state its keys do not show (e.g. a hash of a model
    folder's config.json), "" when it says nothing: stored in checkpoints and compared on resume."""
    fingerprint = lookup("model", model_config.name).fingerprint
    return fingerprint(model_config) if fingerprint is not None else ""


def count_parameters(model_config: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """The configured model's parameter count, from a build on PyTorch's "meta" device: every shape, no
    memory and no values, so any depth or width is counted exactly and at once."""
    with torch.device("meta"):
        model = build_model(model_config, vocab_size, seq_len=seq_len, seed=0)  # no values: any seed
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


def uses_chunked_loss(
    model_config: ModelConfig, dist_config: DistConfig, model: torch.nn.Module, device_type: str
) -> bool:
    """model.loss resolved: "auto" is chunked on CUDA under DDP for a model with an output head and the token
    cross-entropy as its loss, plain otherwise (on the CPU the logits' memory matters less, the chunks' smaller
    products cost time (scripts/benchmarks/bench_loss.py), and the plain loss is the one a reader knows)."""
    if model_config.loss == "plain":
        return False
    # The chunked loss computes the token cross-entropy; a fork whose loss_sum_fn_for returns another loss keeps it.
    token_cross_entropy = loss_sum_fn_for(model_config) is token_cross_entropy_sum
    if model_config.loss == "chunked":
        if not token_cross_entropy:
            raise ConfigError(
                'model.loss: "chunked" computes the token cross-entropy, but this model\'s loss (model.objective, '
                'or the model\'s registration) is another; use "plain" or "auto"'
            )
        if not has_output_head(model):
            raise ConfigError(
                f'model.loss: "chunked" needs a model with hidden_states() and a bias-free output_head; the '
                f'{model_config.name} model does not have them; use "plain" or "auto"'
            )
        return True
    return device_type == "cuda" and dist_config.strategy == "ddp" and token_cross_entropy and has_output_head(model)


def training_forward_and_loss(
    model_config: ModelConfig,
    dist_config: DistConfig,
    model: torch.nn.Module,
    device_type: str,
    compile: bool = False,
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """What the step runs: the module whose outputs go to the loss, and loss_sum_fn(outputs, labels).

    Plain: the model itself (logits) and loss_sum_fn_for(model_config). Chunked: FinalHiddenStates(model) (the same
    parameters; the model's hidden states) and ChunkedCrossEntropySum over its output head: the same SUM.
    `compile` (model.compile resolved) compiles the loss too, so neither its kernels nor its memory stay
    outside the compiled region; wrap_for_training compiles the module."""
    if uses_chunked_loss(model_config, dist_config, model, device_type):
        return FinalHiddenStates(model), ChunkedCrossEntropySum(model.output_head, compile=compile)
    loss_sum_fn = loss_sum_fn_for(model_config)
    return model, torch.compile(loss_sum_fn) if compile else loss_sum_fn
