"""The checker's independent reference and its instruments: the step's rows rebuilt from the raw examples,
one float64 forward and backward over all of them, the optimizer that records the gradient it is handed, and
the error measure between two gradients.

Nothing here uses the loop's batching, masking or weighting: the reference is the definition of the step's
objective (the mean loss over every supervised target of the global batch), computed the simplest way.
"""

import collections
import dataclasses
import re

import torch
from torch.distributed.tensor import DTensor

from accumulation.batching import IGNORE_INDEX, count_supervised_tokens
from accumulation.config.config import Config
from accumulation.data.rows import Rows


def reference_rows(rows: Rows, row_ids: torch.Tensor, step: int, seq_len: int) -> tuple:
    """The step's inputs and labels rebuilt from the raw examples, one row per example, position by position:
    the example's inputs as a tensor (token ids, shorter than seq_len, are padded with 0 to seq_len; inputs of
    any other dtype or shape, an image, a feature vector, are taken as they are), label j its target at j (-100
    where none), or one label per row when the examples carry one. Nothing of the loop's batching or masking
    code is used."""
    examples = [rows.raw_example(row_id, step) for row_id in row_ids.tolist()]
    inputs = stacked([padded_inputs(example.inputs, seq_len) for example in examples])
    if all(example.label is not None for example in examples):
        labels = torch.tensor([example.label for example in examples], dtype=torch.long)
    else:
        labels = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        for position, target in example.targets.items():
            labels[row, position] = target
    return inputs, labels


def padded_inputs(inputs, seq_len: int):
    """One example's inputs as tensors: a sequence of token ids is padded with 0 to seq_len positions; several
    tensors (a tuple, list or dict of them) stay several, each taken as it is."""
    if isinstance(inputs, dict):
        return {name: padded_inputs(value, seq_len) for name, value in inputs.items()}
    if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(part, torch.Tensor) for part in inputs):
        return type(inputs)(torch.as_tensor(part) for part in inputs)
    tensor = torch.as_tensor(inputs)
    if tensor.dim() == 1 and not tensor.is_floating_point() and len(tensor) < seq_len:
        tensor = torch.cat([tensor, tensor.new_zeros(seq_len - len(tensor))])
    return tensor


def stacked(examples: list):
    """The rows' inputs as one batch: the examples' tensors stacked along a new first dimension (field by field
    when each example holds several)."""
    first = examples[0]
    if isinstance(first, dict):
        return {name: torch.stack([example[name] for example in examples]) for name in first}
    if isinstance(first, (tuple, list)):
        return type(first)(torch.stack(parts) for parts in zip(*examples, strict=True))
    return torch.stack(examples)


def map_tensors(function, inputs):
    """function applied to the inputs' tensor, or to each of its tensors when the inputs are several."""
    if isinstance(inputs, dict):
        return {name: function(value) for name, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(function(value) for value in inputs)
    return function(inputs)


def as_float64(inputs):
    """The inputs of the float64 reference: floating inputs (images, features) in float64, token ids unchanged."""
    return map_tensors(lambda tensor: tensor.double() if tensor.is_floating_point() else tensor, inputs)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an update moves, in the model's order: those with requires_grad. A frozen one (a LoRA
    base weight, a frozen embedding) gets no gradient (its .grad stays None) and is compared by no check."""
    return [p for p in model.parameters() if p.requires_grad]


def parameters_compared(model: torch.nn.Module) -> str:
    """The model's parameters in words, and which of them the checker compares when some are frozen."""
    parameters = sum(p.numel() for p in model.parameters())
    frozen = parameters - sum(p.numel() for p in trainable_parameters(model))
    if frozen:  # requires_grad off: no gradient to compare, and no update moves them
        return f"{parameters:,} parameters ({parameters - frozen:,} train and are compared, {frozen:,} frozen)"
    return f"{parameters:,} parameters"


def trainable_gradients(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, its gradient) for each trainable parameter, in the model's order (gradients' zeros where None)."""
    parameters = trainable_parameters(model)
    return list(zip(parameters, gradients(parameters), strict=True))


def gradients(parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each trainable parameter's gradient; zeros for one the loss did not reach (its .grad is None)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]


def float64_full_batch(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_sum_fn):
    """∇ of the mean loss over every supervised target of the step as one float64 batch (the trainable
    parameters'), and that loss."""
    model.train()
    mean_loss = loss_sum_fn(model(as_float64(inputs)), labels) / count_supervised_tokens(labels)
    mean_loss.backward()
    return gradients(trainable_parameters(model)), mean_loss.item()


def one_batch_baseline(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_sum_fn, autocast_dtype, device
):
    """The same step without accumulation or ranks (A = 1, D = 1): one forward and backward of the whole step's
    rows in the loop's precision (fp32 parameters, autocast as configured), and its mean loss. Its distance
    from the float64 reference is what rounding alone costs this model: the floor beside every figure, so that
    an error at that floor is told apart from an error of the accumulation."""
    model.train()
    inputs, labels = map_tensors(lambda tensor: tensor.to(device), inputs), labels.to(device)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        mean_loss = loss_sum_fn(model(inputs), labels) / count_supervised_tokens(labels)
    mean_loss.backward()
    return gradients(trainable_parameters(model)), mean_loss.item()


def max_relative_error(gradient: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """max |gradient - reference| over all entries, relative to the largest entry of the reference."""
    largest = max(r.abs().max().item() for r in reference)
    pairs = zip(gradient, reference, strict=True)
    return max((g.double().cpu() - r.double().cpu()).abs().max().item() for g, r in pairs) / largest


def without_dropout(config: Config) -> Config:
    """The config with dropout off: its masks are random, and no reference (or second run) draws the same."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.0))


DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
# A float attribute by one of these names is a dropout probability read at forward time: MultiheadAttention's
# and a GRU's `dropout`, a Hugging Face attention's `attention_dropout`, a Hugging Face config's `resid_pdrop`,
# `hidden_dropout_prob` or `layerdrop` (whole layers skipped at random).
DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop")


def switch_off_dropout(model: torch.nn.Module) -> list[str]:
    """Every dropout of a built model set to probability 0, in place, whatever its config said (model.dropout
    reaches the built-in models only; a fork's or a Hugging Face model keeps its own). The model stays in train
    mode, so the forward is still the training one in everything else. Returns what was switched off, in words
    ("13 Dropout modules (p 0.1 -> 0)"), empty when nothing was on.

    Three places hold a probability: a Dropout-family module's p; a float attribute of a module named like a
    dropout (a Hugging Face attention calls the functional dropout with `self.attention_dropout`); and a
    Hugging Face config shared by the model's modules (`config.resid_pdrop`), which code may read at forward
    time."""
    classes = collections.Counter()  # (Dropout class, its p): how many modules
    attributes = collections.Counter()  # (attribute name, its value): how many modules
    configs = {}
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES) and module.p > 0:
            classes[(type(module).__name__, module.p)] += 1
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if DROPOUT_NAME.search(name) and type(value) is float and value > 0:
                attributes[(name, value)] += 1
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):  # a Hugging Face PretrainedConfig
            configs[id(config)] = config
    switched = [f"{count} {name} module{plural(count)} (p {p:g} -> 0)" for (name, p), count in classes.items()]
    switched += [f"{name} of {count} module{plural(count)} ({v:g} -> 0)" for (name, v), count in attributes.items()]
    for config in configs.values():
        for name, value in list(vars(config).items()):
            if DROPOUT_NAME.search(name) and type(value) is float and value > 0:
                switched.append(f"config.{name} ({value:g} -> 0)")
                setattr(config, name, 0.0)
    return switched


def plural(count: int) -> str:
    return "" if count == 1 else "s"


def first_update_probe(model: torch.nn.Module, fused: bool = False) -> tuple[torch.optim.Optimizer, list]:
    """(an optimizer that never moves the weights, handed): SGD with learning rate 0 and no momentum, so it
    holds no state, whose pre-step hook puts into `handed` the gradients of the first update it is asked to
    apply, as it sees them (after accumulation, DDP's all-reduce, unscaling and clipping). Later updates add
    nothing, so that memory measured around them holds no copies of the probe's. Under FSDP2 the gradients
    are shards (DTensors): each is gathered whole, a collective that every rank's optimizer step takes part in.
    Only the trainable parameters' (trainable_parameters): a frozen one has no gradient to hand. `fused`: SGD's
    fused kernel, so that the step queues the update on the device (accumulation/update_on_device.py) as it does
    for the configured optimizer when that is fused."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, fused=fused or None)
    handed = []

    def whole(grad: torch.Tensor) -> torch.Tensor:
        return grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()

    def record_first_gradient(opt, args, kwargs):
        if not handed:
            handed.append([whole(grad) for grad in gradients(trainable_parameters(model))])

    optimizer.register_step_pre_hook(record_first_gradient)
    return optimizer, handed


def clipped(gradients: list[torch.Tensor], grad_clip: float) -> tuple[list[torch.Tensor], float]:
    """(the gradient as a step clipping at `grad_clip` must hand it on, computed in float64 from its definition:
    g · min(1, grad_clip / (‖g‖ + 1e-6)), unchanged when grad_clip is 0; ‖g‖)."""
    gradients = [gradient.double().cpu() for gradient in gradients]
    norm = torch.linalg.vector_norm(torch.cat([gradient.flatten() for gradient in gradients])).item()
    if grad_clip <= 0:
        return gradients, norm
    return [gradient * min(1.0, grad_clip / (norm + 1e-6)) for gradient in gradients], norm
