"""train.py's probe at step 0, on this rank's first micro-batch: the step divides the sum of the supervised targets'
losses by the global N, the full batch's mean loss only if the loss is additive over its targets and over its rows,
the model's outputs fit the loss, the loss reads no output at a position whose label is -100, and the model treats
each row alone. A mean loss, a loss that trains the positions labelled -100, or a forward or a loss that raises, is
refused (exit 2), each a bug of the fork; a loss that couples the examples, or BatchNorm in train mode, is a
warning line (an error with batch.on_inexact = "error"), a design no accumulation reproduces. The argument and the
cost: docs/forking.md, "What no loop can make exact".
"""

import traceback

import torch

from accumulation.batching import IGNORE_INDEX, MicroBatch

# Relative difference between the loss of the whole and the sum of its parts above which they differ. The probe
# runs in float32 without autocast: a sum of a few thousand float32 terms is exact to about 1e-6 relative; a
# mean is off by a factor near 2 for two halves, an InfoNCE by the log of the batch size, far above 1e-4.
ADDITIVE_TOLERANCE = 1e-4


class InexactStep(ValueError):
    """What the probe refuses: one line naming the cause and the fix."""


class StepZeroFailed(InexactStep):
    """The model's forward, or the loss on its outputs, raised on the first micro-batch."""


def fault_text(error: BaseException) -> str:
    """ "ValueError: message (at path/to/fork.py:12)": the error and where it was raised, or for a syntax error
    where the parser stopped."""
    if isinstance(error, SyntaxError):
        message, where = error.msg, f"{error.filename}:{error.lineno}"
    else:
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<")]
        message, where = str(error), f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown"
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    name = type(error).__name__
    return f"{name}: {first_line} (at {where})" if first_line else f"{name} (at {where})"


def outputs_and_loss(forward_module, loss_sum_fn, inputs, labels, extras):
    """One forward without gradient and the loss of the whole micro-batch, or StepZeroFailed saying which of the two
    raised, with the shapes it was given and where the fault is."""
    with torch.no_grad():
        try:
            outputs = forward_module(inputs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            raise StepZeroFailed(
                f"step 0: the model's forward raised on the first micro-batch (inputs {shapes_text(inputs)}): "
                f"{fault_text(error)}; the model does not fit this data (model.name, data.source)"
            ) from None
        try:
            whole = float(loss_sum_fn(outputs, labels, **extras))
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            raise StepZeroFailed(
                f"step 0: the loss raised on the model's outputs {shapes_text(outputs)} and the labels "
                f"{shapes_text(labels)}: {fault_text(error)}; the model's outputs do not fit the loss (model.name, "
                f"model.objective)"
            ) from None
    return outputs, whole


def ignored_outputs_change_the_loss(loss_sum_fn, outputs, labels, extras: dict) -> tuple[float, float] | None:
    """How far each row's own loss moves, relative (summed over the rows), when noise is added to its outputs at
    its positions labelled -100 only: (at those away from every target, at those beside one: j ± 1 of a supervised
    j). Both 0 for a loss that leaves them out of its sum; a clamp(min=0) of the labels trains them all as token 0,
    a loss that shifts labels again reads those beside its targets. Row by row, so that a loss coupling the rows
    (through a mean over them) is left to the split of the rows. None when no label is -100 or the outputs are not
    one per label position."""
    ignored = labels == IGNORE_INDEX
    if not ignored.any() or not isinstance(outputs, torch.Tensor) or outputs.shape[: labels.dim()] != labels.shape:
        return None
    beside = torch.zeros_like(ignored)
    if labels.dim() >= 2:  # along the positions of a row
        beside[:, 1:] |= ~ignored[:, :-1]
        beside[:, :-1] |= ~ignored[:, 1:]
    noise = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = noise.to(outputs.device, outputs.dtype) * (1 + outputs.abs())
    size, moved = 0.0, [0.0, 0.0]
    with torch.no_grad():
        for row in range(len(labels)):
            one = slice(row, row + 1)
            row_labels, row_extras = labels[one], {name: value[one] for name, value in extras.items()}
            as_it_is = float(loss_sum_fn(outputs[one], row_labels, **row_extras))
            size += abs(as_it_is)
            for k, positions in enumerate((ignored[one] & ~beside[one], ignored[one] & beside[one])):
                where = positions.reshape(*positions.shape, *[1] * (outputs.dim() - labels.dim())).to(outputs.device)
                noisy = torch.where(where, outputs[one] + noise[one], outputs[one])
                moved[k] += abs(float(loss_sum_fn(noisy, row_labels, **row_extras)) - as_it_is)
    return moved[0] / max(size, 1e-30), moved[1] / max(size, 1e-30)


def ignored_targets_line(away: float, beside: float, tolerance: float) -> str | None:
    """What a loss that moves with the outputs labelled -100 does wrong (ignored_outputs_change_the_loss), or None."""
    if away > tolerance:
        return (
            f"the loss reads the outputs at positions whose label is -100 (padding, prompt): moving only those away "
            f"from every target moves it by {away:.2e} relative: it trains them as targets (labels.clamp(min=0) makes "
            "each a target 0) or reads them in another term; leave them out of the SUM (ignore_index=-100)"
        )
    if beside > tolerance:
        return (
            f"the loss reads the outputs labelled -100 next to its targets (moving them moves it by {beside:.2e}): "
            "label j read off output j ± 1; labels arrive shifted: shifted twice (HF's loss_function)? Pair label j "
            "with output j"
        )
    return None


def shapes_text(value) -> str:
    """ "float32 [2, 3, 16, 16]" for a tensor, each one's for a tuple, the type's name for anything else."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, tuple):
        return f"({', '.join(shapes_text(item) for item in value)})"
    return type(value).__name__


def coupling_modules(model: torch.nn.Module) -> list[str]:
    """The names of the modules that normalise over the rows of a batch in train mode (BatchNorm and its kin)."""
    return [
        f"{name or 'the model'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training
    ]


def _relative_difference(whole: float, parts: float) -> float:
    return abs(whole - parts) / max(abs(whole), abs(parts), 1e-30)


def probe_loss_and_model(forward_module, model, loss_sum_fn, micro_batch: MicroBatch, device, on_inexact: str) -> list:
    """The warnings for what is no longer exact (a list of lines); raises InexactStep for a mean, and for the
    warnings too when on_inexact is "error". `micro_batch` is this rank's first of step 0."""
    batch = micro_batch.to(device)
    labels, extras = batch.labels, batch.extras
    supervised = (labels != IGNORE_INDEX).nonzero()
    warnings = []
    model.train()  # the mode every step runs it in (train.py's loop), whatever mode the build left it in
    coupled = coupling_modules(model)
    if coupled:
        warnings.append(
            f"{', '.join(coupled)} normalise each row with the statistics of its micro-batch in train mode (under DDP "
            f"of this rank's only), so the step's gradient depends on batch.micro_batch_size and the ranks and is no "
            f"longer the full batch's; use GroupNorm or LayerNorm, or evaluation-mode statistics, to make it exact"
        )
    model.eval()  # fixed outputs: no dropout drawn, no BatchNorm statistics updated (the run is not changed)
    try:
        outputs, whole = outputs_and_loss(forward_module, loss_sum_fn, batch.inputs, labels, extras)
    finally:
        model.train()
    if len(supervised) and isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
        with torch.enable_grad():  # the loss of the outputs as a leaf: its own graph alone, not the model's
            loss = loss_sum_fn(outputs.detach().requires_grad_(True), labels, **extras)
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            raise StepZeroFailed(
                f"step 0: the loss returned a {type(loss).__name__} without gradient, so no backward can train the "
                f"model: it was computed outside autograd (.detach(), .item(), torch.no_grad(), a tensor made anew "
                f"from numbers); return the sum built from the outputs with torch operations (docs/forking.md)"
            )
    # Before the tests below: a loss that reads the positions labelled -100 fails them too, as a mean or a coupling.
    moved = ignored_outputs_change_the_loss(loss_sum_fn, outputs, labels, extras)
    if moved and ignored_targets_line(*moved, ADDITIVE_TOLERANCE):
        raise InexactStep(f"step 0: {ignored_targets_line(*moved, ADDITIVE_TOLERANCE)}")
    if len(supervised) >= 2:
        with torch.no_grad():
            first_targets = torch.zeros_like(labels, dtype=torch.bool)
            first_targets[tuple(supervised[: len(supervised) // 2].T)] = True  # the first half of the targets
            first = float(loss_sum_fn(outputs, labels.masked_fill(~first_targets, IGNORE_INDEX), **extras))
            second = float(loss_sum_fn(outputs, labels.masked_fill(first_targets, IGNORE_INDEX), **extras))
            rows, half = len(labels), len(labels) // 2
            by_rows = None
            if rows >= 2 and isinstance(outputs, torch.Tensor) and outputs.shape[0] == rows:
                by_rows = 0.0
                for piece in (slice(0, half), slice(half, rows)):  # each half of the rows with its own extras
                    part = batch.rows(piece)
                    by_rows += float(loss_sum_fn(outputs[piece], part.labels, **part.extras))
        count, count_first = len(supervised), len(supervised) // 2
        if _relative_difference(whole, first + second) > ADDITIVE_TOLERANCE:
            # A mean of per-target losses: whole = (S_1 + S_2) / n with first = S_1 / n_1, second = S_2 / n_2.
            weighted = (count_first * first + (count - count_first) * second) / count
            if _relative_difference(whole, weighted) <= ADDITIVE_TOLERANCE:
                raise InexactStep(
                    f"step 0: the loss is a mean, not a sum over its targets: {whole:.6g} for this micro-batch's "
                    f"targets, {first + second:.6g} for the sum over two halves of them; a mean makes every "
                    f"micro-batch weigh the same: return the SUM of the supervised targets' losses, the step "
                    f"divides by the global N itself (docs/forking.md)"
                )
        if _relative_difference(whole, first + second) > ADDITIVE_TOLERANCE or (
            by_rows is not None and _relative_difference(whole, by_rows) > ADDITIVE_TOLERANCE
        ):
            warnings.append(
                f"the loss couples the examples of a micro-batch ({whole:.6g} for the micro-batch, "
                f"{first + second:.6g} summed over two halves of its targets), e.g. in-batch negatives: no "
                f"accumulation reproduces the full batch's loss; only A·D = 1 or a technique such as GradCache does"
            )
    if warnings and on_inexact == "error":
        raise InexactStep(f"step 0 (batch.on_inexact=error): {warnings[0]}")
    return warnings
