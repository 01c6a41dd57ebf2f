"""The DDP step on one screen: minimal_loop.py's token-weighted accumulation on D ranks, with loss scaling,
clipping and a warm-up schedule. Read it after scripts/teaching/minimal_loop.py and before accumulation/step.py.

    python scripts/teaching/ddp_loop.py [--bug NAME]

Two gloo ranks on this CPU train a tiny model for STEPS updates of A micro-batches of m rows each. Then the
parent trains the same model in float64 on each step's whole global batch in one piece (no micro-batches,
no ranks, no scaler: PyTorch's own token-mean cross-entropy) and prints how far each rank's weights end
from it: PASS (exit 0) within TOLERANCE, FAIL (exit 1) beyond it. `--bug NAME` plants one classic mistake;
the check must then fail:
  times-D-forgotten          each rank backpropagates S / N: DDP's mean over ranks halves the gradient
  sync-on-first              the first micro-batch all-reduces and the last stays local (what setting DDP's
                             require_backward_grad_sync after the forward does): the ranks drift apart
  scheduler-per-micro-batch  the warm-up advances A times per update
  clip-before-unscale        clips s·g at max_norm, so the true gradient is clipped at max_norm / s
"""

import argparse
import contextlib
import os
import sys
import tempfile

import torch
from torch import distributed as dist
from torch import multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

IGNORE_INDEX = -100  # label of a position without a target
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 12, 16
MICRO_BATCH_SIZE, ACCUMULATION_STEPS, RANKS, STEPS = 2, 4, 2, 6  # m, A, D (data-parallel ranks), updates
LR, WARMUP_UPDATES, MAX_NORM, LOSS_SCALE = 0.5, 3, 0.27, 2.0**10  # true norms 0.24 to 0.32: clipping bites on some
BUGS = ("times-D-forgotten", "sync-on-first", "scheduler-per-micro-batch", "clip-before-unscale")
# float32 ranks against a float64 reference: rounding of about 1e-7 relative per operation, grown over six
# updates to about 1e-6 of the largest weight; every planted bug moves the weights by 1e-3 or more.
TOLERANCE = 1e-5


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s inputs and labels, [D, A, m, seq_len]; rows supervise 1 to SEQ_LEN tokens."""
    generator = torch.Generator().manual_seed(step)
    shape = (RANKS, ACCUMULATION_STEPS, MICRO_BATCH_SIZE, SEQ_LEN)
    inputs, targets = (torch.randint(VOCAB_SIZE, shape, generator=generator) for _ in range(2))
    supervised = torch.randint(1, SEQ_LEN + 1, (*shape[:-1], 1), generator=generator)
    return inputs, torch.where(torch.arange(SEQ_LEN) < supervised, targets, IGNORE_INDEX)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE))


def warmup(updates: int) -> float:
    """LR factor after `updates` applied updates: (k + 1) / (W + 1) during a W-update warm-up, then 1."""
    return min(1.0, (updates + 1) / (WARMUP_UPDATES + 1))


def train_rank(rank: int, store_path: str, bug: str | None) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=RANKS)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)  # what fp16 needs; exact here (a power of 2)
    for step in range(STEPS):
        inputs, labels = global_batch(step)  # every rank knows the whole step, so it counts N without a collective
        tokens = int((labels != IGNORE_INDEX).sum())  # N: supervised tokens of all micro-batches of all ranks
        # DDP all-reduces the MEAN over the D ranks; × D undoes it, so the update is ∇ of Σ_r Σ_k S_rk / N.
        multiplier = (1 if bug == "times-D-forgotten" else RANKS) / tokens
        sync_at = 0 if bug == "sync-on-first" else ACCUMULATION_STEPS - 1
        for k in range(ACCUMULATION_STEPS):
            # Forward AND backward inside no_sync: DDP decides during the forward whether the backward all-reduces.
            with model.no_sync() if k != sync_at else contextlib.nullcontext():
                logits = model(inputs[rank, k]).flatten(0, 1)  # [m · seq_len, vocab]
                loss_sum = F.cross_entropy(logits, labels[rank, k].flatten(), reduction="sum")  # S_rk; skips -100
                scaler.scale(loss_sum * multiplier).backward()  # .grad += s · ∇(S_rk · D / N)
            if bug == "scheduler-per-micro-batch":
                scheduler.step()
        if bug == "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.unscale_(optimizer)  # .grad /= s: true gradients from here on
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # once, on the whole sum
        scaler.step(optimizer)  # skips the update if the gradient holds an inf or a NaN
        scaler.update()  # once per update: lowers s after a skip, raises it after a run of good steps
        optimizer.zero_grad()
        if torch.isfinite(grad_norm) and bug != "scheduler-per-micro-batch":  # the step's one host read
            scheduler.step()  # the schedule counts applied updates
    torch.save(model.module.state_dict(), os.path.join(os.path.dirname(store_path), f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skips the interpreter's exit, which can abort a finished gloo rank (testkit/ranks.py)


def float64_reference() -> nn.Module:
    """The same updates, each from the step's whole global batch as one float64 batch."""
    model = make_model().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        logits = model(inputs.flatten(0, 2))  # all D · A · m rows at once
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", choices=BUGS, help="plant one mistake; the check must then FAIL")
    bug = parser.parse_args(argv).bug
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(train_rank, args=(os.path.join(scratch, "store"), bug), nprocs=RANKS, start_method="fork")
        ranks = [torch.load(os.path.join(scratch, f"rank{r}.pt"), weights_only=True) for r in range(RANKS)]
    reference = float64_reference().state_dict()
    largest = max(float(w.abs().max()) for w in reference.values())
    errors = [max(float((w[k] - reference[k]).abs().max()) for k in w) / largest for w in ranks]
    for rank, error in enumerate(errors):
        print(f"rank {rank}: weights after {STEPS} updates vs float64 full batch: {error:.2e} (relative to max)")
    print("PASS" if max(errors) <= TOLERANCE else "FAIL", f"(tolerance {TOLERANCE:.0e}, bug: {bug})")
    return 0 if max(errors) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
