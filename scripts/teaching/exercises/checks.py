"""The checker of the coding exercises: each check runs the student's function on a tiny float64 model and
raises AssertionError, with what went wrong, unless it matches an independent reference.

    python -m pytest scripts/teaching/exercises    # fails until every exercise is fixed

The reference knows nothing of micro-batches: PyTorch's own token-mean cross-entropy over the whole step as
one batch. Float64 makes the tolerance small: the same terms summed in another order differ by a few ulps
(1e-16 relative) each, far below the 1e-10 the checks allow and the 1e-2 every bug in the exercises costs.
"""

import os
import tempfile
import traceback

import torch
from torch import distributed as dist
from torch import multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 16, 8, 8
MICRO_BATCH_SIZE, ACCUMULATION_STEPS = 2, 4  # m, A
RTOL = 1e-10
CLIP_EPS = 1e-6  # what clip_grad_norm_ adds to the norm it divides by


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
    expected = [-first_lr * g * max_norm / (true_norm + CLIP_EPS) for g in reference]  # clip_grad_norm_'s formula
    applied = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    error = relative_error(applied, expected)
    # Clipping the still-scaled gradient at s · max_norm is the same clip, but for where clip_grad_norm_'s eps
    # meets the norm: its factor s · max_norm / (s · |g| + eps) = max_norm / (|g| + eps / s) differs from
    # max_norm / (|g| + eps) by less than eps / |g| (relative), on every entry alike. Every bug costs 1e-2.
    allowed = RTOL + CLIP_EPS / true_norm
    assert error <= allowed, f"update 2 off by {error:.3g} of its largest entry (allowed {allowed:.3g})"
    assert scaler.get_scale() == scale / 2, f"after a clean update the scale is {scaler.get_scale():g}"
    assert scheduler.last_epoch == 1, f"the scheduler advanced {scheduler.last_epoch} times over one applied update"


def check_schedule_clock(train) -> None:
    """Exercise 13: train(model, steps, optimizer, scheduler) returns the learning rate each step used; the
    warm-up counts applied updates only: lr · (k + 1) / (W + 1) after k applied updates, then lr. Step 2 has
    no supervised token, so it must not advance the schedule, and must not move the weights either. AdamW,
    not SGD: an AdamW step on a zero gradient still moves every weight (its momentum and its weight decay),
    so an update on the empty step shows, where SGD would hide it."""
    lr, warmup_updates = 0.1, 4
    steps = [make_step(seed=3), make_step(seed=4), make_step(seed=5, supervised=False), make_step(seed=6)]

    def run(steps_run: list) -> tuple[nn.Module, list[float]]:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup_updates + 1)))
        return model, train(model, steps_run, optimizer, scheduler)

    model, used = run(steps)
    applied_before = [0, 1, 2, 2]  # step 2 applies nothing
    expected = [lr * (k + 1) / (warmup_updates + 1) for k in applied_before]
    assert len(used) == len(steps), f"{len(used)} learning rates for {len(steps)} steps"
    for step, (got, want) in enumerate(zip(used, expected, strict=True)):
        assert abs(got - want) <= RTOL * want, f"step {step} used lr {got:.6g}, expected {want:.6g}"
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a weight is inf or NaN"
    # The same operations in the same order give the same bits: the weights after steps 0 to 2 must be
    # exactly those after steps 0 and 1.
    after_two, _ = run(steps[:2])
    after_empty, _ = run(steps[:3])
    moved = [
        n
        for (n, a), b in zip(after_empty.named_parameters(), after_two.parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert not moved, (
        f"the empty step (step 2) moved the weights {moved}: it has nothing to learn, so no optimizer.step()"
    )


RANKS = 2  # two gloo ranks: D of exercise 14, the pipeline's two stages or FSDP2's two shards (checks_frontier)


def on_two_ranks(worker, *arguments) -> list:
    """Runs worker(rank, *arguments) on 2 forked gloo ranks and returns what each returned; a rank that raised
    fails the check with its traceback, and a rank that hangs fails it after 120 s."""
    with tempfile.TemporaryDirectory(prefix="exercise-ranks-") as scratch:

        def run(rank: int) -> None:
            torch.set_num_threads(1)  # the ranks share the machine's cores
            try:
                store = f"file://{os.path.join(scratch, 'store')}"
                dist.init_process_group("gloo", init_method=store, rank=rank, world_size=RANKS)
                result = {"value": worker(rank, *arguments)}
                dist.destroy_process_group()
            except Exception:
                result = {"error": traceback.format_exc(limit=4)}
            torch.save(result, os.path.join(scratch, f"rank{rank}.pt"))
            os._exit(0)  # skips the interpreter's exit, which can abort a finished gloo rank

        # fork: the student's function reaches the ranks as it is, without pickling (it may come from exec).
        ranks = [mp.get_context("fork").Process(target=run, args=(rank,)) for rank in range(RANKS)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(120)
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        for process in ranks:
            if process.is_alive():
                process.kill()
        assert not hung, f"ranks {hung} did not finish in 120 s: does every rank run the same collectives?"
        results = [torch.load(os.path.join(scratch, f"rank{r}.pt"), weights_only=False) for r in range(RANKS)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} raised:\n{result['error']}"
    return [result["value"] for result in results]


def two_rank_worker(rank: int, accumulate, micro_batches_per_rank: list, tokens: int) -> dict:
    """One of exercise 14's ranks: a DDP model, a communication hook that counts the gradient entries each
    all-reduce sends, the student's accumulate(); returns .grad and the entries sent."""
    model = DistributedDataParallel(make_model())
    entries_sent = []

    def counting_allreduce(process_group, bucket):
        entries_sent.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(process_group, bucket)  # DDP's own: the mean over ranks

    model.register_comm_hook(None, counting_allreduce)
    accumulate(model, micro_batches_per_rank[rank], tokens, RANKS)
    return {"grads": [p.grad.clone() for p in model.parameters()], "entries_sent": sum(entries_sent)}


def check_two_ranks(accumulate) -> None:
    """Exercise 14: on D = 2 DDP ranks, accumulate(model, micro_batches, tokens, ranks) leaves in .grad, on
    both ranks, the gradient of the token mean over all N supervised tokens of both ranks' micro-batches,
    and all-reduces one gradient's worth of entries per step (only the last micro-batch synchronises)."""
    micro_batches_per_rank = [make_step(seed=7), make_step(seed=8)]
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for step in micro_batches_per_rank for _, labels in step)
    model = make_model()
    reference = reference_gradient(model, micro_batches_per_rank[0] + micro_batches_per_rank[1])
    gradient_entries = sum(p.numel() for p in model.parameters())
    results = on_two_ranks(two_rank_worker, accumulate, micro_batches_per_rank, tokens)
    for rank, result in enumerate(results):
        error = relative_error(result["grads"], reference)
        assert error <= RTOL, f"rank {rank}: gradient off by {error:.3g} of its largest entry (allowed {RTOL:g})"
    for rank, result in enumerate(results):
        sent = result["entries_sent"]
        assert sent == gradient_entries, (
            f"rank {rank} all-reduced {sent} gradient entries in the step, {sent / gradient_entries:g} times the "
            f"gradient's {gradient_entries}: only the last micro-batch's backward should synchronise"
        )


def check_adam_eps(update) -> None:
    """Exercise 15: update(model, micro_batches, optimizer, loss_scale) backpropagates the token-mean loss
    times loss_scale, and applies one Adam update from the true gradient. Adam divides by the gradient's own
    size, so a scale left in the gradient cancels but for eps: s·g / (s·√v + eps) = g / (√v + eps / s), the eps
    in effect divided by s. That shows only where eps is not far below the entries: here eps is the gradient's
    median entry. The loss must stay scaled (in fp16 the scale is what keeps small gradients from flushing to
    zero): a hook reads .grad after every backward, and after the last one it must hold loss_scale times the
    true gradient, so dropping the scale, which in float64 gives the right update, fails too."""
    lr, loss_scale = 1e-2, 2.0**16
    model = make_model()
    micro_batches = make_step(seed=9)
    reference = reference_gradient(model, micro_batches)
    after_backward = {}  # parameter index -> .grad as the last backward left it, before any unscaling

    def record(index):
        return lambda parameter: after_backward.__setitem__(index, parameter.grad.detach().clone())

    for index, parameter in enumerate(model.parameters()):
        parameter.register_post_accumulate_grad_hook(record(index))
    eps = float(torch.cat([g.flatten() for g in reference]).abs().median())
    expected_model = make_model()  # the same weights: one Adam update from the float64 reference gradient
    for parameter, gradient in zip(expected_model.parameters(), reference, strict=True):
        parameter.grad = gradient.clone()
    torch.optim.Adam(expected_model.parameters(), lr=lr, eps=eps).step()
    before = [p.detach().clone() for p in model.parameters()]
    expected = [e.detach() - b for e, b in zip(expected_model.parameters(), before, strict=True)]
    update(model, micro_batches, torch.optim.Adam(model.parameters(), lr=lr, eps=eps), loss_scale)
    assert len(after_backward) == len(reference), "no backward reached every parameter"
    scaled = relative_error([after_backward[i] for i in range(len(reference))], [loss_scale * g for g in reference])
    assert scaled <= RTOL, (
        f".grad after the backwards is off by {scaled:.3g} from loss_scale times the true gradient (allowed "
        f"{RTOL:g}): the loss must be scaled by loss_scale before each backward, and the scale divided out after"
    )
    applied = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    error = relative_error(applied, expected)
    assert error <= RTOL, (
        f"Adam update off by {error:.3g} of its largest entry (allowed {RTOL:g}; eps = {eps:.2g}, the median "
        f"gradient entry, and loss_scale = {loss_scale:g})"
    )
