"""Dropout and random masks under accumulation: what changes with m, A and D, and what can be made exact.

    python scripts/teaching/dropout_masks.py [--json]

One optimizer step of G = 8 rows on a tiny float64 model with two dropouts (p = 0.1, after its embedding and
after its tanh, as a transformer has one per sublayer), the
step's gradient (the token mean over every supervised target) accumulated in four layouts: (m, A, D) =
(8, 1, 1), the whole batch at once, (2, 4, 1), (4, 1, 2) and (2, 2, 2). D ranks are simulated in one process,
one after the other, each rank's rows with its own dropout stream (DDP's average of S · D / N over the ranks is
the sum of S / N, which is what is accumulated here). Three ways to draw the masks:

- "per rank": torch's global generator, seeded per rank as train.py seeds it (`seed_dropout` in
  accumulation/run/checkpoint.py), and nn.Dropout drawing from it forward after forward. A row's mask then
  depends on which rank holds it and on what was drawn before it: with two dropouts the draws alternate
  between them micro-batch by micro-batch, so on m and A as well as on D. (With a single dropout layer and
  D = 1, torch's CPU generator was measured to give the rows of A micro-batches the draws of one whole batch;
  nothing promises that, and another device's generator was not tried.)
- "row-keyed": the mask of (row, position, feature) is a pure function of (seed, step, row id) drawn with
  `step_uniforms` (accumulation/data/uniforms.py), the function the project's masked-LM data and RL rollouts
  draw their randomness from. The project's model dropout does not do this; this script shows that it could.
- "off": p = 0, what the equivalence checker does (`switch_off_dropout` in accumulation/checker/reference.py).

Printed: each layout's relative gradient difference from the whole batch's (largest entry), for each way; the
difference between two seeds of the whole-batch layout (what "another mask" costs); and, over SEEDS seeds,
the difference between the mean gradients of two layouts: the per-rank masks agree in expectation only.
tests/test_teaching_lessons.py checks the printed figures and the guide's quotes of them.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accumulation.data.uniforms import step_uniforms  # noqa: E402
from accumulation.run.checkpoint import seed_dropout  # noqa: E402
from scripts.teaching.lesson import lesson_main  # noqa: E402

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 12, 16
ROWS = 8  # G
DROPOUT = 0.1
SEED, STEP = 3, 5  # run.seed and the optimizer step the masks belong to
DROPOUT_STREAMS = (7, 8)  # step_uniforms' streams for the two dropouts, apart from any data draw of the rows
LAYOUTS = ((8, 1, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2))  # (m, A, D), m · A · D = G
SEEDS = 400  # seeds averaged for the expectation


class TinyModel(nn.Module):
    """Embedding, dropout, tanh, dropout, linear head: a token model whose rows do not interact."""

    def __init__(self, masks: str):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embedding = nn.Embedding(VOCAB_SIZE, WIDTH).double()
        self.head = nn.Linear(WIDTH, VOCAB_SIZE).double()
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.5)
        self.masks, self.dropout = masks, nn.Dropout(DROPOUT if masks != "off" else 0.0)

    def drop(self, x: torch.Tensor, row_ids: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
        if self.masks == "row-keyed":  # keep (row, position, feature) with probability 1 - p, from its row id only
            uniforms = step_uniforms(seed, STEP, row_ids, SEQ_LEN * WIDTH, stream=stream)
            keep = torch.from_numpy(uniforms).view(len(row_ids), SEQ_LEN, WIDTH) >= DROPOUT
            return x * keep / (1 - DROPOUT)  # the same scaling as nn.Dropout in training
        return self.dropout(x)  # the global generator's next draws (nothing when off)

    def forward(self, inputs: torch.Tensor, row_ids: torch.Tensor, seed: int) -> torch.Tensor:
        first, second = DROPOUT_STREAMS
        x = self.drop(self.embedding(inputs), row_ids, seed, first)
        return self.head(self.drop(torch.tanh(x), row_ids, seed, second))


def step_rows() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(VOCAB_SIZE, (ROWS, SEQ_LEN), generator=generator)
    targets = torch.randint(VOCAB_SIZE, (ROWS, SEQ_LEN), generator=generator)
    lengths = torch.randint(1, SEQ_LEN + 1, (ROWS, 1), generator=generator)
    return inputs, torch.where(torch.arange(SEQ_LEN) < lengths, targets, IGNORE_INDEX)


def step_gradient(masks: str, layout: tuple[int, int, int], seed: int) -> torch.Tensor:
    """The step's accumulated gradient, flat: each rank's A micro-batches of m rows, S / N each."""
    m, accumulation_steps, ranks = layout
    model = TinyModel(masks)
    inputs, labels = step_rows()
    tokens = int((labels != IGNORE_INDEX).sum())  # N over the whole step, before any backward
    rows_per_rank = m * accumulation_steps
    for rank in range(ranks):
        seed_dropout(seed, rank)  # this rank's dropout stream, as train.py seeds it
        for k in range(accumulation_steps):
            first = rank * rows_per_rank + k * m
            row_ids = torch.arange(first, first + m)
            logits = model(inputs[row_ids], row_ids, seed)
            loss_sum = F.cross_entropy(logits.flatten(0, 1), labels[row_ids].flatten(), reduction="sum")
            (loss_sum / tokens).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def measure(seeds: int = SEEDS) -> dict:
    results = {}
    for masks in ("per rank", "row-keyed", "off"):
        whole = step_gradient(masks, LAYOUTS[0], SEED)
        results[masks] = {
            f"m={m} A={a} D={d}": relative(step_gradient(masks, (m, a, d), SEED), whole) for m, a, d in LAYOUTS[1:]
        }
        results[masks]["another seed, m=8 A=1 D=1"] = relative(step_gradient(masks, LAYOUTS[0], SEED + 1), whole)
    # In expectation over the masks every layout has the same gradient: the mean over seeds of two layouts'
    # gradients approaches one vector, about as 1 / sqrt(seeds).
    state = torch.random.get_rng_state()
    means = [sum(step_gradient("per rank", layout, seed) for seed in range(seeds)) / seeds for layout in LAYOUTS]
    torch.random.set_rng_state(state)
    results["per rank, mean over seeds"] = {"seeds": seeds} | {
        f"m={m} A={a} D={d}": relative(mean, means[0]) for (m, a, d), mean in zip(LAYOUTS[1:], means[1:], strict=True)
    }
    return results


def shown(value: float) -> str:
    return "< 1e-14" if value < 1e-14 else f"{value:.3g}"  # float64 rounding prints as its bound (guide, section 9)


def report(results: dict) -> list[str]:
    """The lines main prints (the guide quotes them)."""
    lines = []
    layouts = [name for name in results["per rank"]]
    lines.append("| masks | " + " | ".join(layouts) + " |")
    lines.append("|---|" + "---|" * len(layouts))
    for masks in ("per rank", "row-keyed", "off"):
        lines.append(f"| {masks} | " + " | ".join(shown(results[masks][name]) for name in layouts) + " |")
    expectation = dict(results["per rank, mean over seeds"])
    seeds = expectation.pop("seeds")
    lines.append(
        f"| per rank, mean over {seeds} seeds | " + " | ".join(shown(v) for v in expectation.values()) + " | |"
    )
    return lines


def main(argv: list[str]) -> int:
    return lesson_main(argv, __doc__.splitlines()[0], measure, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
