"""Per-document means under sequence packing: one weight per token, from counts over the whole step.

    python scripts/teaching/packed_documents.py [--json]

Packing puts documents end to end in rows of SEQ_LEN tokens, so a row holds several documents and a document
can run across rows, micro-batches and ranks. The token mean weighs every target alike (long documents count
more); the per-document mean weighs every document alike: (1/n) Σ_d (1/T_d) Σ_{t in d} ℓ_t over the n documents
of the step, T_d the targets of document d in the step. Like every mean of this guide it accumulates exactly
when each token's weight 1 / (n · T_d) comes from counts over the whole step, made before the first backward
(from the document ids, on the host), and each micro-batch backpropagates Σ_t w_t ℓ_t.

One step of ROWS packed rows (a document's first label, predicted from the previous document, is masked), a
tiny float64 token model whose positions do not interact (attention masks per document are another matter:
guide, section 19), each variant's gradient against the float64 per-document mean from its definition
(relative error, largest entry):

- correct, weights from the step's counts, in several layouts (m, A); D ranks are more micro-batches here;
- rows as documents: each row's own token mean, averaged over rows (section 2's per-sequence mean);
- documents counted per micro-batch: n and T_d from the micro-batch alone, times its share 1/A;
- a split document counted twice: T_d and n counted row by row, so each piece weighs as a whole document;
- the token mean: not a bug, another objective; how far it is from the per-document mean on these rows.
tests/test_teaching_lessons.py checks the figures and the guide's quotes of them.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# Run as a script, Python puts only this file's folder on sys.path: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.lesson import lesson_main  # noqa: E402

IGNORE_INDEX = -100
VOCAB_SIZE, SEQ_LEN, WIDTH = 32, 16, 16
ROWS = 8
LAYOUTS = ((8, 1), (2, 4), (1, 8))  # (m, A)


def packed_step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs, labels (shifted: the target of each position), doc ids [ROWS, SEQ_LEN]: documents of 2 to 40
    tokens end to end; a position whose target is another document's first token has no target."""
    generator = torch.Generator().manual_seed(4)
    tokens, documents, document = [], [], 0
    while len(tokens) < ROWS * SEQ_LEN + 1:
        length = int(torch.randint(2, 41, (1,), generator=generator))
        tokens += torch.randint(VOCAB_SIZE, (length,), generator=generator).tolist()
        documents += [document] * length
        document += 1
    stream, ids = torch.tensor(tokens[: ROWS * SEQ_LEN + 1]), torch.tensor(documents[: ROWS * SEQ_LEN + 1])
    same_document = ids[1:] == ids[:-1]  # the target belongs to the input's document
    labels = torch.where(same_document, stream[1:], IGNORE_INDEX)
    return stream[:-1].view(ROWS, SEQ_LEN), labels.view(ROWS, SEQ_LEN), ids[:-1].view(ROWS, SEQ_LEN)


def document_weights(labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """1 / (n · T_d) at each target of document d, 0 elsewhere: n and T_d counted over the rows given."""
    supervised = labels != IGNORE_INDEX
    documents, per_position = torch.unique(ids[supervised], return_inverse=True)
    targets_of = torch.bincount(per_position).double()  # T_d
    weights = torch.zeros(labels.shape, dtype=torch.float64)
    weights[supervised] = 1 / (len(documents) * targets_of[per_position])
    return weights


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB_SIZE, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB_SIZE)).double()


def token_losses(net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = net(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def accumulated(weights_of_micro_batch, m: int) -> torch.Tensor:
    """The gradient accumulated over micro-batches of m rows; each backpropagates Σ_t w_t ℓ_t with its weights."""
    net, (inputs, labels, ids) = model(), packed_step()
    for first in range(0, ROWS, m):
        rows = slice(first, first + m)
        (weights_of_micro_batch(rows, labels, ids) * token_losses(net, inputs[rows], labels[rows])).sum().backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def reference() -> torch.Tensor:
    """The per-document mean from its definition, in one piece: the mean over documents of their mean loss."""
    net, (inputs, labels, ids) = model(), packed_step()
    losses, supervised = token_losses(net, inputs, labels), labels != IGNORE_INDEX
    documents = torch.unique(ids[supervised])
    means = [losses[supervised & (ids == d)].mean() for d in documents]
    torch.autograd.backward(torch.stack(means).mean())
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def measure() -> dict:
    expected = reference()
    _, labels, ids = packed_step()
    step_weights = document_weights(labels, ids)
    results = {
        "documents in the step": len(torch.unique(ids[labels != IGNORE_INDEX])),
        "row boundaries inside a document": int((ids[1:, 0] == ids[:-1, -1]).sum()),
    }
    for m, a in LAYOUTS:
        results[f"correct, m={m} A={a}"] = relative(accumulated(lambda rows, *_: step_weights[rows], m), expected)

    def row_means(rows, labels, ids):
        supervised = (labels[rows] != IGNORE_INDEX).double()
        return supervised / (supervised.sum(-1, keepdim=True).clamp(min=1) * ROWS)

    def per_micro_batch(rows, labels, ids):
        return document_weights(labels[rows], ids[rows]) / LAYOUTS[1][1]

    def split_counted_twice(rows, labels, ids):
        # Document ids made distinct per row: a document's pieces in two rows become two documents.
        row_ids = ids + torch.arange(ROWS).unsqueeze(1) * (int(ids.max()) + 1)
        return document_weights(labels, row_ids)[rows]

    m = LAYOUTS[1][0]
    results["rows as documents"] = relative(accumulated(row_means, m), expected)
    results["documents counted per micro-batch"] = relative(accumulated(per_micro_batch, m), expected)
    results["a split document counted twice"] = relative(accumulated(split_counted_twice, m), expected)
    supervised = labels != IGNORE_INDEX
    token_mean = supervised.double() / supervised.sum()
    results["token mean (another objective)"] = relative(accumulated(lambda rows, *_: token_mean[rows], m), expected)
    return results


def shown(value) -> str:
    if isinstance(value, int):
        return str(value)
    return "< 1e-14" if value < 1e-14 else f"{value:.3g}"  # float64 rounding prints as its bound


def report(results: dict) -> list[str]:
    return [f"{name}: {shown(value)}" for name, value in results.items()]


def main(argv: list[str]) -> int:
    return lesson_main(argv, __doc__.splitlines()[0], measure, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
