"""The optimizer's side of accumulation: what one accumulated step buys, and which loss it must average.

    python scripts/teaching/optimizer_side.py [--steps 40] [--json]

Two experiments on a tiny float64 model (float64, so that "exact" means rounding of about 1e-16, not 1e-7).

1. Distance. At fixed examples (one global batch of G rows cut into A micro-batches), compare one
   accumulated step (the token-mean gradient of all G rows, one optimizer update) with A micro-steps (an
   update after every micro-batch, on its own token mean: what a loop does without accumulation). Printed:
   how far each moves the weights, ‖Δθ‖ of the A micro-steps over ‖Δθ‖ of the one step, with SGD and with
   Adam, for A = 4 and 10. SGD's micro-steps each move about as far as the one step (each micro-batch's
   gradient estimates the same gradient), so A of them go about A times as far. Adam's first updates move
   each weight by about lr whatever the gradient's size (m̂ / √v̂ is about ±1 on a fresh state), so A of
   them go up to A times as far, less where the micro-batches disagree in sign.

2. Classic against token-weighted. At one global batch, train with A = 1, 4 and 16 micro-batches, once with
   the classic `loss / A` (each micro-batch's token mean, divided by A) and once token-weighted (each loss
   sum divided by the step's N), on two kinds of rows: variable-length rows (each supervises 1 to SEQ_LEN
   tokens) and packed rows (every position supervised, as `data.layout = "packed"` makes them). Printed:
   the final training loss of each run, and the largest difference between the classic and the
   token-weighted curve of the same A. With A = 1 the two are one computation. On packed rows every
   micro-batch holds the same number of tokens, N / A, so the mean of the A micro-batch means is the mean
   over all N tokens: the classic loop is exact, and its curve equals the token-weighted one up to
   rounding. On variable-length rows the micro-batches hold different numbers of tokens, and the classic
   curve leaves the token-weighted one as soon as A > 1.

tests/test_optimizer_side.py runs both at a tiny size and checks each property above.
"""

import argparse
import json
import sys

import torch
from torch import nn
from torch.nn import functional as F

IGNORE_INDEX = -100  # label of a position without a target
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 16, 16
GLOBAL_BATCH = 80  # G: rows per optimizer update, whatever A is (divisible by every A below)
SGD_LR, ADAM_LR = 0.5, 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights for every run
    return nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)).double()


def make_rows(step: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s G rows: inputs and labels [G, SEQ_LEN]. The targets are the inputs shifted by a fixed
    map, so there is something to learn. Variable-length rows supervise a prefix of 1 to SEQ_LEN tokens."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randint(VOCAB_SIZE, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
    targets = (inputs * 7 + 3) % VOCAB_SIZE
    if packed:
        return inputs, targets
    supervised = torch.randint(1, SEQ_LEN + 1, (GLOBAL_BATCH, 1), generator=generator)
    return inputs, torch.where(torch.arange(SEQ_LEN) < supervised, targets, IGNORE_INDEX)


def loss_sum(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """S: the sum of the token losses over the supervised positions."""
    return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=SGD_LR)
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR)


def distance_moved(optimizer_name: str, accumulation: int, micro_steps: bool) -> float:
    """‖Δθ‖ after the first global batch: one accumulated update, or one update per micro-batch."""
    model = make_model()
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = make_optimizer(optimizer_name, model)
    inputs, labels = make_rows(0, packed=False)
    micro_inputs, micro_labels = inputs.chunk(accumulation), labels.chunk(accumulation)
    tokens = int((labels != IGNORE_INDEX).sum())  # N of the whole global batch
    for k in range(accumulation):
        if micro_steps:  # an update from this micro-batch's own token mean
            micro_tokens = int((micro_labels[k] != IGNORE_INDEX).sum())
            (loss_sum(model, micro_inputs[k], micro_labels[k]) / micro_tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:  # accumulate ∇(S_k / N); one update at the end
            (loss_sum(model, micro_inputs[k], micro_labels[k]) / tokens).backward()
    if not micro_steps:
        optimizer.step()
    end = torch.cat([p.detach().flatten() for p in model.parameters()])
    return float((end - start).norm())


def distances(accumulations: tuple[int, ...] = (4, 10)) -> dict:
    ratios = {}
    for optimizer_name in ("sgd", "adam"):
        for accumulation in accumulations:
            many = distance_moved(optimizer_name, accumulation, micro_steps=True)
            one = distance_moved(optimizer_name, accumulation, micro_steps=False)
            ratios[f"{optimizer_name} A={accumulation}"] = many / one
    return ratios


def train(accumulation: int, classic: bool, packed: bool, steps: int) -> list[float]:
    """SGD for `steps` updates of G rows each, cut into A micro-batches; returns each step's true token-mean
    loss (the same quantity for both losses, so that the curves compare)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    curve = []
    for step in range(steps):
        inputs, labels = make_rows(step, packed)
        tokens = int((labels != IGNORE_INDEX).sum())  # N of the step
        step_loss_sum = 0.0
        for micro_inputs, micro_labels in zip(inputs.chunk(accumulation), labels.chunk(accumulation), strict=True):
            micro_loss_sum = loss_sum(model, micro_inputs, micro_labels)
            step_loss_sum += float(micro_loss_sum.detach())
            if classic:  # the micro-batch's token mean, divided by A: the mean of micro-batch means
                (micro_loss_sum / int((micro_labels != IGNORE_INDEX).sum()) / accumulation).backward()
            else:  # token-weighted: Σ_k ∇(S_k / N) = ∇ of the mean over all N tokens
                (micro_loss_sum / tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(step_loss_sum / tokens)
    return curve


def classic_against_token_weighted(steps: int, accumulations: tuple[int, ...] = (1, 4, 16)) -> dict:
    results = {}
    for layout in ("variable-length", "packed"):
        for accumulation in accumulations:
            classic = train(accumulation, True, layout == "packed", steps)
            weighted = train(accumulation, False, layout == "packed", steps)
            results[f"{layout} A={accumulation}"] = {
                "classic_final": classic[-1],
                "token_weighted_final": weighted[-1],
                "largest_curve_difference": max(abs(c - w) for c, w in zip(classic, weighted, strict=True)),
            }
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="updates per run of experiment 2")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    arguments = parser.parse_args(argv)
    if arguments.steps < 1:
        print("--steps: expected a positive number of updates", file=sys.stderr)
        return 2
    moved = distances()
    curves = classic_against_token_weighted(arguments.steps)
    if arguments.json:
        print(json.dumps({"distance_ratio": moved, "classic_vs_token_weighted": curves}))
        return 0
    print(f"1. distance moved by A micro-steps / by one accumulated step, at the same G = {GLOBAL_BATCH} rows")
    for name, ratio in moved.items():
        print(f"   {name:<9} {ratio:.2f}")
    print(f"2. SGD for {arguments.steps} updates of G = {GLOBAL_BATCH} rows: final training loss (nats per token)")
    print(f"   {'rows, A':<20} {'classic loss/A':>15} {'token-weighted':>15} {'largest curve gap':>18}")
    for name, result in curves.items():
        print(
            f"   {name:<20} {result['classic_final']:>15.4f} {result['token_weighted_final']:>15.4f} "
            f"{result['largest_curve_difference']:>18.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
