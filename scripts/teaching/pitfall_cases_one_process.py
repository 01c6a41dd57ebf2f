"""The pitfalls that run in one process, each a pair of twins: the bug written out plainly, as people write
it, then the correct twin (this project's `optimizer_step` or its data order). scripts/teaching/pitfalls.py
runs them, with the two-rank pitfalls of pitfall_cases_two_ranks.py."""

import contextlib
import math
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX, MicroBatch, count_supervised_tokens
from accumulation.data.sources import step_row_ids, steps_per_epoch
from accumulation.data.step_tools import epoch_permutation
from accumulation.schedule import build_scheduler
from accumulation.step import StepSetup, optimizer_step
from scripts.teaching.pitfall_setup import (
    ACCUMULATION_STEPS,
    ADAM_LR,
    BUG_MIN,
    CPU,
    GRADIENT_RTOL,
    LOSS_ERROR,
    LR,
    LR_ERROR,
    LR_RTOL,
    NEXT_STEP_IDS,
    PARTIAL_STEP_IDS,
    ROWS_NOT_ONCE,
    SAVED_BYTES,
    STEP_IDS,
    UPDATE_ERROR,
    UPDATE_RTOL,
    Measurement,
    against_one_step,
    clip_like_pytorch,
    correct_step,
    direction_and_scale,
    gpt,
    gradient_measurement,
    gradients,
    loss_scaler,
    loss_sum,
    norm_model,
    rows,
    sgd,
    step_batches,
    tokens_in,
)
from testkit.reference import (
    capture_gradients,
    float64_reference_gradient,
    full_batch_mean_loss,
    max_relative_error,
)

# ---------------------------------------------------------------------------------------------------------
# Single-process pitfalls. Each function: the buggy twin, written out, then the correct twin.
# ---------------------------------------------------------------------------------------------------------


def mean_of_micro_batch_means() -> Measurement:
    """1. Each micro-batch's mean loss, averaged over the A micro-batches. A token of the 3-token micro-batch
    then weighs 32/3 times a token of the 32-token one; the token-mean objective is the mean over all N
    tokens. The Hugging Face Trainer did this until October 2024, and still does for a model whose forward
    takes no count of items (https://github.com/huggingface/transformers/issues/37766)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    for mb in batches:
        micro_mean = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
        (micro_mean / len(batches)).backward()
    return against_one_step("1. mean of micro-batch means", model, batches)


def divided_by_accumulation_twice() -> Measurement:
    """3. The global token denominator N is right, but the habit of dividing by A stays: the gradient is A times
    too small (an lr silently divided by A)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        (loss_sum(model, mb) / tokens / len(batches)).backward()
    return against_one_step("3. divided by A on top of N", model, batches)


def zero_grad_inside_the_group() -> Measurement:
    """4. zero_grad at the top of the micro-batch loop: only the last micro-batch's gradient reaches the update."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    optimizer = sgd(model)
    tokens = tokens_in(batches)
    for mb in batches:
        optimizer.zero_grad()
        (loss_sum(model, mb) / tokens).backward()
    return against_one_step("4. zero_grad inside the group", model, batches)


def missing_zero_grad_between_groups() -> Measurement:
    """5. No zero_grad after the update: the second step's update uses the first step's gradient plus its own.

    Each twin's reference is the gradient of the second step's batch at that twin's weights after step one."""
    groups = [step_batches(STEP_IDS), step_batches(NEXT_STEP_IDS)]
    model = gpt()
    optimizer = sgd(model)
    for batches in groups:
        buggy_reference = float64_reference_gradient(model, batches)
        tokens = tokens_in(batches)
        for mb in batches:
            (loss_sum(model, mb) / tokens).backward()
        optimizer.step()
        # The mistake: no optimizer.zero_grad() here.
    buggy = gradients(model)

    model = gpt()
    for batches in groups:
        reference = float64_reference_gradient(model, batches)
        used = correct_step(model, batches)
    return gradient_measurement(
        "5. no zero_grad between groups", buggy, used, reference, buggy_reference, "float64 full batch of step 2"
    )


def scheduler_stepped_per_micro_batch() -> Measurement:
    """6. scheduler.step() inside the micro-batch loop: the schedule advances A times per update, so an 8-update
    warm-up is over after 2 updates. Expected after k updates of a linear warm-up over W: lr·(k + 1)/(W + 1).
    Accelerate's scheduler wrapper stepped on accumulation steps that applied no update
    (https://github.com/huggingface/accelerate/issues/963, fixed in 2023)."""
    warmup_updates, updates = 8, 2
    expected_lr = LR * (updates + 1) / (warmup_updates + 1)
    groups = [step_batches(STEP_IDS), step_batches(NEXT_STEP_IDS)]

    model = gpt()
    optimizer = sgd(model)
    scheduler = build_scheduler(optimizer, "constant", warmup_updates, 0, 1.0)
    with warnings.catch_warnings():
        # PyTorch warns when a scheduler steps before the first optimizer.step(): the very mistake shown here.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
        for batches in groups:
            tokens = tokens_in(batches)
            for mb in batches:
                (loss_sum(model, mb) / tokens).backward()
                scheduler.step()  # the mistake
            optimizer.step()
            optimizer.zero_grad()
    buggy_lr = optimizer.param_groups[0]["lr"]

    model = gpt()
    optimizer = sgd(model)
    scheduler = build_scheduler(optimizer, "constant", warmup_updates, 0, 1.0)
    for batches in groups:
        result = optimizer_step(StepSetup(model, CPU), batches, optimizer)
        if result.applied:
            scheduler.step()  # as train.py does: the schedule's unit is applied updates
    correct_lr = optimizer.param_groups[0]["lr"]

    buggy, correct = (abs(lr - expected_lr) / expected_lr for lr in (buggy_lr, correct_lr))
    return Measurement(
        "6. scheduler stepped per micro-batch",
        LR_ERROR,
        buggy,
        correct,
        correct <= LR_RTOL,
        buggy >= BUG_MIN,
        "lr · (k + 1) / (W + 1), the warm-up's formula",
    )


def clip_threshold(batches: list[MicroBatch]) -> float:
    """A clipping threshold that bites: a tenth of the norm of the step's true gradient."""
    reference = float64_reference_gradient(gpt(), batches)
    return 0.1 * math.sqrt(sum(float((g**2).sum()) for g in reference))


def clipped_per_micro_batch() -> Measurement:
    """7. clip_grad_norm_ after every backward: the running sum is shrunk again and again, so early
    micro-batches count less than late ones, and the direction of the update changes."""
    batches = step_batches(STEP_IDS)
    max_norm = clip_threshold(batches)
    clipped_reference = clip_like_pytorch(float64_reference_gradient(gpt(), batches), max_norm)
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        (loss_sum(model, mb) / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the mistake: inside the loop
    correct = correct_step(gpt(), batches, grad_clip=max_norm)
    return gradient_measurement(
        "7. clipped per micro-batch",
        gradients(model),
        correct,
        clipped_reference,
        described="float64 full batch, clipped",
    )


def clipped_before_unscale() -> Measurement:
    """8. With a GradScaler, clipping before scaler.unscale_: the gradients still carry the loss scale s, so
    clipping s·g at max_norm clips the true gradient g at max_norm / s. Once it clips (here the threshold is a
    tenth of the true norm, so it always does), the update is s times smaller than the correctly clipped one
    (s = 1024): the right direction, a norm ratio of 1/s."""
    batches = step_batches(STEP_IDS)
    max_norm = clip_threshold(batches)
    clipped_reference = clip_like_pytorch(float64_reference_gradient(gpt(), batches), max_norm)
    model = gpt()
    optimizer = sgd(model)
    scaler = loss_scaler()
    tokens = tokens_in(batches)
    for mb in batches:
        scaler.scale(loss_sum(model, mb) / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the mistake: no scaler.unscale_ before
    scaler.step(optimizer)  # unscales now, after the clip
    scaler.update()
    correct = correct_step(gpt(), batches, grad_clip=max_norm, scaler=loss_scaler())
    return gradient_measurement(
        "8. clipped before unscale_",
        gradients(model),
        correct,
        clipped_reference,
        described="float64 full batch, clipped",
    )


def denominator_counts_unshifted_tokens() -> Measurement:
    """11. N counted from the inputs (an attention mask's sum) instead of the shifted labels: a row of L real
    tokens has L inputs but L - 1 targets, so every short row adds one token that has no loss."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = sum(int((mb.inputs != 0).sum()) for mb in batches)  # the mistake; byte 0 is the padding
    for mb in batches:
        (loss_sum(model, mb) / tokens).backward()
    return against_one_step("11. denominator counts unshifted tokens", model, batches)


def batch_norm_under_micro_batching() -> Measurement:
    """12. BatchNorm normalises with the statistics of the batch it sees: m rows per micro-batch instead of all
    m·A rows of the step, so no accumulation can give the full-batch gradient (and its running statistics
    take A momentum updates per step, each from m rows). Both twins run optimizer_step on the same BatchNorm
    model; the buggy twin accumulates A = 4 micro-batches of m = 2, the correct twin runs the step's 8 rows
    as one micro-batch (A = 1), the only layout whose statistics are the full batch's."""
    micro_batches = step_batches(STEP_IDS)
    whole_batch = step_batches(STEP_IDS, micro_batch_size=len(STEP_IDS))
    reference = float64_reference_gradient(norm_model(nn.BatchNorm1d), micro_batches)
    buggy = correct_step(norm_model(nn.BatchNorm1d), micro_batches)
    correct = correct_step(norm_model(nn.BatchNorm1d), whole_batch)
    return gradient_measurement(
        "12. BatchNorm under micro-batching", buggy, correct, reference, described="float64 full batch (same model)"
    )


def leaky_data_order(num_rows: int, global_batch_size: int, seed: int, epochs: int) -> list[list[torch.Tensor]]:
    """The row ids of every step, by epoch, when an epoch's incomplete last batch is not run but kept in a
    buffer and put in front of the next epoch's rows."""
    steps_by_epoch = []
    carried = torch.empty(0, dtype=torch.long)
    for epoch in range(epochs):
        ids = torch.cat([carried, epoch_permutation(num_rows, seed, epoch)])
        full_steps = len(ids) // global_batch_size
        steps_by_epoch.append(list(ids[: full_steps * global_batch_size].split(global_batch_size)))
        carried = ids[full_steps * global_batch_size :]  # the mistake: the remainder leaks into the next epoch
    return steps_by_epoch


def rows_not_seen_once(step_ids: list[torch.Tensor], num_rows: int) -> int:
    seen = torch.bincount(torch.cat(step_ids), minlength=num_rows)
    return int((seen != 1).sum())


def tail_leaking_into_next_epoch() -> Measurement:
    """13. 18 rows in steps of 8: each epoch leaves 2. Leaked into the next epoch, they are seen twice there
    while as many of that epoch's own rows wait for the epoch after. The project's data order with
    batch.tail="partial" runs a short last step instead: every row exactly once per epoch, the number in the
    correct column. With the default batch.tail="drop" the 2 rows are left out of each epoch (a different 2
    each epoch, as each epoch draws its own permutation): no row twice, 2 never, by design; the check asserts
    that too. The correct twin is the data order (step_row_ids of epoch 1 = steps steps_per_epoch .. 2 ·
    steps_per_epoch - 1): no optimizer step is involved."""
    num_rows, global_batch_size, seed = rows().num_rows, len(STEP_IDS), 0
    buggy = rows_not_seen_once(leaky_data_order(num_rows, global_batch_size, seed, epochs=2)[1], num_rows)
    epoch_1 = {}
    for tail in ("partial", "drop"):
        steps_in_epoch = steps_per_epoch(num_rows, global_batch_size, tail)
        steps = range(steps_in_epoch, 2 * steps_in_epoch)
        epoch_1[tail] = torch.cat([step_row_ids(num_rows, global_batch_size, seed, step, tail) for step in steps])
    correct = rows_not_seen_once(list(epoch_1["partial"].split(1)), num_rows)
    drop_seen = torch.bincount(epoch_1["drop"], minlength=num_rows)
    drop_as_designed = int((drop_seen > 1).sum()) == 0 and int((drop_seen == 0).sum()) == num_rows % global_batch_size
    return Measurement(
        "13. tail group leaking into next epoch",
        ROWS_NOT_ONCE,
        buggy,
        correct,
        correct == 0 and drop_as_designed,
        buggy > 0,
        'every row once with tail "partial" (the data order, step_row_ids; no step runs)',
    )


@contextlib.contextmanager
def saved_tensor_bytes():
    """Track the bytes autograd saves for backward: `live` now, and the `peak` while the context is open.

    Every saved tensor is wrapped in a small object; autograd drops the wrapper when it frees the tensor
    (after backward, or when the graph is garbage), and a finalizer then subtracts its bytes."""
    counts = {"live": 0, "peak": 0}

    class Saved:
        def __init__(self, tensor: torch.Tensor):
            self.tensor = tensor

    def forget(num_bytes: int) -> None:
        counts["live"] -= num_bytes

    def pack(tensor: torch.Tensor) -> Saved:
        num_bytes = tensor.numel() * tensor.element_size()
        counts["live"] += num_bytes
        counts["peak"] = max(counts["peak"], counts["live"])
        saved = Saved(tensor)
        weakref.finalize(saved, forget, num_bytes)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        yield counts


def loss_summed_with_its_graph() -> Measurement:
    """14. `total_loss += loss` with the graph attached, and one backward at the end: the gradient is right, but
    the activations of all A micro-batches are alive at once, the memory accumulation exists to save. The
    correct loop backpropagates each micro-batch at once and keeps only `loss.detach()` for the log.

    torchtune's first fix of its normalization did this and restored a backward per micro-batch in
    https://github.com/meta-pytorch/torchtune/pull/1917.

    (Summing the attached loss only for the log, with a backward per micro-batch, leaks less: backward frees
    the saved tensors, and what the sum keeps is the chain of graph nodes, growing over the run.)"""
    batches = step_batches(STEP_IDS)
    model = gpt()
    tokens = tokens_in(batches)
    with saved_tensor_bytes() as buggy:
        total_loss = torch.zeros((), dtype=torch.float64)
        for mb in batches:
            total_loss += loss_sum(model, mb) / tokens  # the mistake: the sum holds every micro-batch's graph
        total_loss.backward()

    with saved_tensor_bytes() as one_micro_batch:  # the reference: one micro-batch's forward and loss
        loss_sum(gpt(), batches[0])
    with saved_tensor_bytes() as correct:
        correct_step(gpt(), batches)
    return Measurement(
        "14. loss summed with its graph",
        SAVED_BYTES,
        buggy["peak"],
        correct["peak"],
        correct["peak"] == one_micro_batch["peak"],
        buggy["peak"] >= 2 * correct["peak"],
        "one micro-batch's forward",
    )


def partial_group_divided_by_a() -> Measurement:
    """16. The classic loop divides each micro-batch's loss by A. The last group of an epoch may hold fewer
    micro-batches (here 2 of A = 4, full rows only, so the mean-of-means weighting plays no part): its
    gradient is 2/4 of the right one, a silently halved learning rate on that step. Lightning was reported
    to do this (https://github.com/Lightning-AI/pytorch-lightning/issues/19987). The project pads the partial
    step with fully masked rows and divides by its true token count."""
    batches = step_batches(PARTIAL_STEP_IDS, global_batch_size=len(STEP_IDS))  # 2 real micro-batches, 2 padding
    real_batches = [mb for mb in batches if mb.num_examples > 0]
    model = gpt()
    for mb in real_batches:
        micro_mean = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
        (micro_mean / ACCUMULATION_STEPS).backward()  # the mistake: A, though only 2 micro-batches ran
    return against_one_step("16. partial last group divided by A", model, batches)


def adam(model: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR)


def update_of(model: nn.Module, run) -> list[torch.Tensor]:
    """Weights after `run(model)` minus the weights before: the update that was applied."""
    before = [p.detach().clone() for p in model.parameters()]
    run(model)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def optimizer_step_per_micro_batch() -> Measurement:
    """18. optimizer.step() and zero_grad() after every backward (the `if (k + 1) % A == 0` forgotten): A updates
    per step, each from one micro-batch. With Adam each update has about lr per weight whatever the
    gradient's size, so the step moves about A times as far, in a direction no single batch asked for.
    Judged on the update (weights after minus before) against one Adam update with the float64 full-batch
    gradient."""
    batches = step_batches(STEP_IDS)
    tokens = tokens_in(batches)

    def apply_reference(model: nn.Module) -> None:
        for parameter, gradient in zip(model.parameters(), float64_reference_gradient(model, batches), strict=True):
            parameter.grad = gradient
        adam(model).step()

    def buggy_loop(model: nn.Module) -> None:
        optimizer = adam(model)
        for mb in batches:
            (loss_sum(model, mb) / tokens).backward()
            optimizer.step()  # the mistake: inside the loop
            optimizer.zero_grad()

    reference = update_of(gpt(), apply_reference)
    buggy = update_of(gpt(), buggy_loop)
    correct = update_of(gpt(), lambda model: optimizer_step(StepSetup(model, CPU), batches, adam(model)))
    buggy_error, correct_error = (max_relative_error(u, reference) for u in (buggy, correct))
    return Measurement(
        "18. optimizer.step per micro-batch",
        UPDATE_ERROR,
        buggy_error,
        correct_error,
        correct_error <= UPDATE_RTOL,
        buggy_error >= BUG_MIN,
        "one Adam update from the float64 full batch",
        *direction_and_scale(buggy, reference),
    )


def scaler_update_per_micro_batch() -> Measurement:
    """19. scaler.update() inside the micro-batch loop. On its own it raises at the first micro-batch
    (AssertionError "No inf checks were recorded prior to update": only unscale_ or step record them). With
    unscale_ per micro-batch too (to log or clip each micro-batch's gradient) it runs silently: update()
    clears the "already unscaled" mark, so each later unscale_ divides the whole running sum by the scale s
    again, and scaler.step divides once more. Micro-batch k ends up divided by s^(A - k + 1) on top of its
    own unscaling: the update is all but zero."""
    batches = step_batches(STEP_IDS)
    reference = float64_reference_gradient(gpt(), batches)
    model = gpt()
    optimizer = sgd(model)
    handed = capture_gradients(optimizer)
    scaler = loss_scaler()
    tokens = tokens_in(batches)
    for mb in batches:
        scaler.scale(loss_sum(model, mb) / tokens).backward()
        scaler.unscale_(optimizer)  # e.g. to log each micro-batch's gradient norm
        scaler.update()  # the mistake: once per step, after scaler.step
    scaler.step(optimizer)
    scaler.update()
    correct = correct_step(gpt(), batches, scaler=loss_scaler())
    return gradient_measurement("19. scaler.update per micro-batch", handed[0], correct, reference)


def logged_loss_of_last_micro_batch() -> Measurement:
    """20. The gradient is right (S_k / N per micro-batch), but the loop logs the last micro-batch's mean loss
    (nanoGPT logs `loss.item() * A` of the last micro-batch, an estimate its author chose to avoid a host
    read: https://github.com/karpathy/nanoGPT/pull/207). The logged curve then follows whichever
    micro-batch came last. The project logs the exact global token mean (loss sums all-reduced once)."""
    batches = step_batches(STEP_IDS)
    inputs, labels = torch.cat([mb.inputs for mb in batches]), torch.cat([mb.labels for mb in batches])
    with torch.no_grad():
        reference_loss = float(full_batch_mean_loss(gpt()(inputs), labels))
    model = gpt()
    tokens = tokens_in(batches)
    for mb in batches:
        loss = loss_sum(model, mb)
        (loss / tokens).backward()
        logged = float(loss.detach()) / count_supervised_tokens(mb.labels)  # the mistake: the last one wins
    result = optimizer_step(StepSetup(gpt(), CPU), batches, sgd(gpt()))
    buggy, correct = (abs(value - reference_loss) / reference_loss for value in (logged, result.loss))
    return Measurement(
        "20. logged loss of the last micro-batch",
        LOSS_ERROR,
        buggy,
        correct,
        correct <= GRADIENT_RTOL,
        buggy >= BUG_MIN,
        "float64 full-batch mean loss",
    )


def micro_batch_means_summed() -> Measurement:
    """21. Each micro-batch's mean loss backpropagated as it is, neither divided by A nor weighted by tokens:
    the gradient is about A times too large, and short micro-batches still weigh too much (both errors at
    once). Reported against nanoGPT in https://github.com/karpathy/nanoGPT/issues/206 (a false alarm there:
    nanoGPT does divide by A); met for real inside the Hugging Face Trainer by heads that take **kwargs but drop
    num_items_in_batch, so that the Trainer skips its division by A and the head its division by the count
    (https://github.com/huggingface/transformers/issues/47688)."""
    batches = step_batches(STEP_IDS)
    model = gpt()
    for mb in batches:
        F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    return against_one_step("21. micro-batch means summed, not divided by A", model, batches)


SINGLE_PROCESS_PITFALLS = [
    mean_of_micro_batch_means,
    divided_by_accumulation_twice,
    zero_grad_inside_the_group,
    missing_zero_grad_between_groups,
    scheduler_stepped_per_micro_batch,
    clipped_per_micro_batch,
    clipped_before_unscale,
    denominator_counts_unshifted_tokens,
    batch_norm_under_micro_batching,
    tail_leaking_into_next_epoch,
    loss_summed_with_its_graph,
    partial_group_divided_by_a,
    optimizer_step_per_micro_batch,
    scaler_update_per_micro_batch,
    logged_loss_of_last_micro_batch,
    micro_batch_means_summed,
]
