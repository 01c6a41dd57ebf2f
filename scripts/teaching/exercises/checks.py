"""The checker of the coding exercises: each check runs the student's function on a tiny float64 model and
raises AssertionError, with what went wrong, unless it matches an independent reference.

    python -m pytest scripts/teaching/exercises    # fails until every exercise is fixed

The reference knows nothing of micro-batches: PyTorch's own token-mean cross-entropy over the whole step as
one batch. Float64 makes the tolerance small: the same terms summed in another order differ by a few ulps
(1e-16 relative) each, far below the 1e-10 the checks allow and the 1e-2 every bug in the exercises costs.
"""

import torch
from torch import nn
from torch.nn import functional as F

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 16, 8, 8
MICRO_BATCH_SIZE, ACCUMULATION_STEPS = 2, 4  # m, A
RTOL = 1e-10


def make_model() -> nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)).double()
    torch.random.set_rng_state(generator_state)
    return model


def make_step(seed: int, supervised: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's A micro-batches of (inputs, labels); rows supervise 1 to SEQ_LEN tokens, or none at all."""
    generator = torch.Generator().manual_seed(seed)
    micro_batches = []
    for _ in range(ACCUMULATION_STEPS):
        inputs = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        targets = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        lengths = torch.randint(1, SEQ_LEN + 1, (MICRO_BATCH_SIZE, 1), generator=generator) * supervised
        micro_batches.append((inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)))
    return micro_batches


def reference_gradient(model: nn.Module, micro_batches: list) -> list[torch.Tensor]:
    """∇ of the mean loss over every supervised token of the step, as one batch (model left untouched)."""
    inputs = torch.cat([inputs for inputs, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    parameters = list(model.parameters())
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    return list(torch.autograd.grad(loss, parameters))


def relative_error(vectors: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    largest = max(float(r.abs().max()) for r in reference)
    return max(float((v - r).abs().max()) for v, r in zip(vectors, reference, strict=True)) / largest


def check_token_mean(accumulate) -> None:
    """Exercise 11: accumulate(model, micro_batches) leaves .grad = ∇ of the step's token-mean loss."""
    model = make_model()
    micro_batches = make_step(seed=1)
    reference = reference_gradient(model, micro_batches)
    accumulate(model, micro_batches)
    error = relative_error([p.grad for p in model.parameters()], reference)
    assert error <= RTOL, f"gradient off by {error:.3g} of its largest entry (allowed {RTOL:g})"


def inject_inf_once(model: nn.Module):
    """A hook that turns one entry of the last layer's weight gradient into inf in the next backward, as an
    fp16 overflow does; removed after that backward. Returns the hook's handle."""
    weight = model[-1].weight
    handle = None

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    handle = weight.register_hook(overflow)
    return handle


def check_scaler_order(update) -> None:
    """Exercise 12: update(model, micro_batches, optimizer, scaler, scheduler, max_norm) applies one SGD update
    with the true gradient clipped once to max_norm, whatever the loss scale, and steps the scheduler only
    when the update was applied. Two updates: in the first an inf appears in one micro-batch's gradient (an
    fp16 overflow), so the update must be skipped, the scale halved once and the schedule left where it is;
    the second is clean and must be the clipped true gradient at the warm-up's first learning rate."""
    lr, scale, warmup_updates = 0.1, 2.0**10, 4
    model = make_model()
    micro_batches = make_step(seed=2)
    reference = reference_gradient(model, micro_batches)
    true_norm = float(torch.cat([g.flatten() for g in reference]).norm())
    max_norm = true_norm / 2  # clipping bites: the update must have half the true gradient's length
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup_updates + 1)))
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)

    inject_inf_once(model)
    try:
        update(model, micro_batches, optimizer, scaler, scheduler, max_norm)
    except Exception as error:  # an exception is a failed check too, with what raised it
        raise AssertionError(f"update 1 (with an inf in the gradient) raised {error!r}") from error
    changed = any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    assert not changed, "update 1 had an inf in its gradient and must be skipped, but the weights changed"
    assert scaler.get_scale() == scale / 2, (
        f"after the skipped update the scale is {scaler.get_scale():g}, expected {scale / 2:g} "
        "(scaler.update() once per update halves it after an inf)"
    )
    assert scheduler.last_epoch == 0, (
        f"the scheduler advanced {scheduler.last_epoch} times over a skipped update; it counts applied updates"
    )

    try:
        update(model, micro_batches, optimizer, scaler, scheduler, max_norm)
    except Exception as error:
        raise AssertionError(f"update 2 (clean) raised {error!r}") from error
    first_lr = lr * 1 / (warmup_updates + 1)  # the warm-up's factor after 0 applied updates
    expected = [-first_lr * g * max_norm / (true_norm + 1e-6) for g in reference]  # clip_grad_norm_'s formula
    applied = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    error = relative_error(applied, expected)
    assert error <= RTOL, f"update 2 off by {error:.3g} of its largest entry (allowed {RTOL:g})"
    assert scaler.get_scale() == scale / 2, f"after a clean update the scale is {scaler.get_scale():g}"
    assert scheduler.last_epoch == 1, f"the scheduler advanced {scheduler.last_epoch} times over one applied update"


def check_schedule_clock(train) -> None:
    """Exercise 13: train(model, steps, optimizer, scheduler) returns the learning rate each step used; the
    warm-up counts applied updates only: lr · (k + 1) / (W + 1) after k applied updates, then lr. Step 2 has
    no supervised token, so it applies nothing and must not advance the schedule."""
    lr, warmup_updates = 0.1, 4
    steps = [make_step(seed=3), make_step(seed=4), make_step(seed=5, supervised=False), make_step(seed=6)]
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup_updates + 1)))
    used = train(model, steps, optimizer, scheduler)
    applied_before = [0, 1, 2, 2]  # step 2 applies nothing
    expected = [lr * (k + 1) / (warmup_updates + 1) for k in applied_before]
    assert len(used) == len(steps), f"{len(used)} learning rates for {len(steps)} steps"
    for step, (got, want) in enumerate(zip(used, expected, strict=True)):
        assert abs(got - want) <= RTOL * want, f"step {step} used lr {got:.6g}, expected {want:.6g}"
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a weight is inf or NaN"
