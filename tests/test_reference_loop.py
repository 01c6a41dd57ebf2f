"""docs/reference_loop.md, the printable page: its code block, run as printed, matches the project's
optimizer_step on 2 gloo ranks (same weights, micro-batches, scaler, clipping and schedule), and skips an
update with an inf in the gradient as optimizer_step does, and one whose finite entries' squares overflow."""

import re
from pathlib import Path

import pytest
import torch

from accumulation.batching import MicroBatch
from accumulation.step import StepSetup, optimizer_step
from testkit.ranks import run_on_ranks

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 12, 16
MICRO_BATCH_SIZE, ACCUMULATION_STEPS, STEPS = 2, 4, 3
LR, WARMUP_UPDATES, LOSS_SCALE = 0.5, 5, 2.0**10
# float32 on both sides, the same terms in nearly the same order (S · D / N here, S · (D / N) there):
# rounding of about 1e-7 relative per operation, grown over three updates to well under 1e-5 of the
# largest weight; a wrong normalisation or order moves the weights by 1e-3 or more.
TOLERANCE = 1e-5


def page_code() -> str:
    [source] = re.findall(
        r"```python\n(# reference loop.*?)```", (REPO / "docs" / "reference_loop.md").read_text(), flags=re.DOTALL
    )
    return source


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB_SIZE, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, VOCAB_SIZE)
    )


def rank_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's A micro-batches of step `step`; rows supervise 1 to SEQ_LEN tokens."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    batches = []
    for _ in range(ACCUMULATION_STEPS):
        inputs = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        targets = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        lengths = torch.randint(1, SEQ_LEN + 1, (MICRO_BATCH_SIZE, 1), generator=generator)
        batches.append((inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, -100)))
    return batches


def train_both(rank: int, world_size: int, source: str, planted: float, momentum: float) -> dict:
    """On each rank: the page's loop and optimizer_step, each on its own DDP copy of the same model. Step 1's
    gradient holds `planted` in one entry of rank 0 (after the loss scale and the two ranks' average)."""
    namespace = {}
    exec(compile(source, "reference_loop.md", "exec"), namespace)
    reference_update = namespace["reference_update"]
    runs = {}
    for name in ("page", "optimizer_step"):
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (WARMUP_UPDATES + 1)))
        scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
        max_norm = 0.27  # the first update's true gradient norm is 0.278: clipping bites there
        applied, scales = [], []
        for step in range(STEPS + 1):
            batches = rank_batches(step, rank)
            if step == 1:  # an overflow in one entry of rank 0's first micro-batch gradient
                handle = []
                weight = model.module[-1].weight

                def overflow(grad, handle=handle):
                    handle[0].remove()
                    grad = grad.clone()
                    grad[0, 0] = planted * LOSS_SCALE * world_size if rank == 0 else grad[0, 0]
                    return grad

                handle.append(weight.register_hook(overflow))
            if name == "page":
                applied.append(reference_update(model, batches, optimizer, scaler, scheduler, max_norm))
            else:
                micro_batches = [MicroBatch(inputs, labels, MICRO_BATCH_SIZE) for inputs, labels in batches]
                result = optimizer_step(
                    StepSetup(model, torch.device("cpu"), scaler=scaler, grad_clip=max_norm), micro_batches, optimizer
                )
                if result.applied:
                    scheduler.step()
                applied.append(result.applied)
            scales.append(scaler.get_scale())
        runs[name] = {
            "weights": [p.detach().clone() for p in model.module.parameters()],
            "applied": applied,
            "scales": scales,
            "lr": optimizer.param_groups[0]["lr"],
        }
    return runs


# An inf entry (fp16's overflow), and a finite entry of 1e20 whose square overflows float32: the norm is inf while
# the scaler's unscale_ finds no inf, so scaler.step would apply the (clipped to zero) gradient, and momentum would
# move the weights with it. Both must skip as optimizer_step does.
@pytest.mark.parametrize("planted, momentum", [(float("inf"), 0.0), (1e20, 0.9)], ids=["inf", "finite-1e20"])
def test_the_pages_loop_matches_optimizer_step_on_two_ranks_and_skips_an_overflow(planted, momentum):
    results = run_on_ranks(train_both, world_size=2, args=(page_code(), planted, momentum))
    for rank, runs in enumerate(results):
        page, reference = runs["page"], runs["optimizer_step"]
        # Step 1 overflows: skipped by both, the scale halved once, the schedule left where it was.
        assert page["applied"] == reference["applied"] == [True, False, True, True], rank
        assert page["scales"] == reference["scales"] == [LOSS_SCALE, LOSS_SCALE / 2, LOSS_SCALE / 2, LOSS_SCALE / 2]
        assert page["lr"] == reference["lr"] == LR * (3 + 1) / (WARMUP_UPDATES + 1), rank  # 3 applied updates
        largest = max(float(w.abs().max()) for w in reference["weights"])
        error = max(float((a - b).abs().max()) for a, b in zip(page["weights"], reference["weights"], strict=True))
        assert error / largest <= TOLERANCE, f"rank {rank}: {error / largest:.2e} of the largest weight"
    # Both ranks end with the same weights: one all-reduce per update made their gradients identical.
    for a, b in zip(results[0]["page"]["weights"], results[1]["page"]["weights"], strict=True):
        assert torch.equal(a, b)
