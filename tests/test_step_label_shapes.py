"""The step for other label shapes on one process: a per-example classifier (with the default and a custom
loss_sum_fn) and prompt-masked language-model rows, against the float64 full-batch reference of
tests/test_step.py."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX, MicroBatch, count_supervised_tokens
from accumulation.step import token_cross_entropy_sum
from testkit.reference import float64_reference_gradient, max_relative_error
from tests.test_step import FLOAT64_RTOL, SEQ_LEN, VOCAB_SIZE, new_model, one_step_gradient

# ----------------------------------------------------------------------------------------------------------
# Other label shapes on one process: a per-example classifier and prompt-masked language-model rows.

FEATURES, HIDDEN, CLASSES = 6, 12, 5
LABEL_SMOOTHING = 0.1


def classifier() -> nn.Sequential:
    """A per-example classifier in float64: features [rows, FEATURES] -> logits [rows, CLASSES]. The same
    weights at every call, without touching the caller's random state."""
    with torch.random.fork_rng():
        torch.manual_seed(11)
        model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    return model.double()


def classifier_micro_batches(labelled_per_micro_batch: list[list[int]], seed: int) -> list[MicroBatch]:
    """One micro-batch per list, one example per entry: random float64 features, and a random class where
    the entry is 1 or -100 (an unsupervised example, still a real one) where it is 0. Labels: [rows]."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for labelled in labelled_per_micro_batch:
        features = torch.randn(len(labelled), FEATURES, generator=generator, dtype=torch.float64)
        classes = torch.randint(0, CLASSES, (len(labelled),), generator=generator)
        labels = torch.where(torch.tensor(labelled, dtype=torch.bool), classes, IGNORE_INDEX)
        batches.append(MicroBatch(features, labels, num_examples=len(labelled)))
    return batches


def label_smoothed_cross_entropy_sum(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A custom loss_sum_fn, written by hand: the SUM over supervised examples of label-smoothed
    cross-entropy, (1 - ε)·(-log p_label) + ε·(mean over the classes of -log p_class)."""
    supervised = labels != IGNORE_INDEX
    log_probabilities = F.log_softmax(outputs[supervised], dim=-1)
    label_term = -log_probabilities.gather(1, labels[supervised].unsqueeze(1)).squeeze(1)
    uniform_term = -log_probabilities.mean(dim=-1)
    return ((1 - LABEL_SMOOTHING) * label_term + LABEL_SMOOTHING * uniform_term).sum()


def label_smoothed_reference_gradient(model: nn.Module, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """∇ of PyTorch's own label-smoothed mean cross-entropy over every supervised example, as one float64
    batch: the reference of the hand-written sum above, sharing no code with it."""
    model = copy.deepcopy(model).double()
    features = torch.cat([mb.inputs for mb in batches])
    labels = torch.cat([mb.labels for mb in batches])
    mean_loss = F.cross_entropy(model(features), labels, ignore_index=IGNORE_INDEX, label_smoothing=LABEL_SMOOTHING)
    mean_loss.backward()
    return [p.grad.clone() for p in model.parameters()]


# loss name -> (the loss_sum_fn the step is given, the float64 reference gradient of the same loss's mean)
CLASSIFIER_LOSSES = {
    "cross-entropy (the default)": (token_cross_entropy_sum, float64_reference_gradient),
    "label-smoothed, written by hand": (label_smoothed_cross_entropy_sum, label_smoothed_reference_gradient),
}

# Per micro-batch of m = 4 examples, 1 for a labelled example and 0 for an unsupervised one: 4, 1, 0 and 3
# supervised examples.
CLASSIFIER_MICRO_BATCHES = [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]]


def prompt_masked_micro_batches(shapes_per_micro_batch: list[list[tuple[int, int]]], seed: int) -> list[MicroBatch]:
    """Instruction-tuning rows for the GPT. A row (prompt, length) holds `length` real tokens and is trained
    on its targets after the first `prompt`: the prompt's targets and the padding after `length` are -100.
    (0, 0) is a padding row; (P, P) a real row whose targets are all prompt."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for shapes in shapes_per_micro_batch:
        inputs = torch.randint(0, VOCAB_SIZE, (len(shapes), SEQ_LEN), generator=generator)
        labels = torch.randint(0, VOCAB_SIZE, (len(shapes), SEQ_LEN), generator=generator)
        for row, (prompt, length) in enumerate(shapes):
            inputs[row, length:] = 0  # byte 0 is the padding, as in accumulation/data/sources.py
            labels[row, :prompt] = IGNORE_INDEX
            labels[row, length:] = IGNORE_INDEX
        batches.append(MicroBatch(inputs, labels, num_examples=sum(1 for _, length in shapes if length > 0)))
    return batches


# (prompt, length) per row, two rows per micro-batch: 6 + 3, 2 + 0, 0 + 6 and 1 + 0 supervised targets.
PROMPT_MASKED_MICRO_BATCHES = [
    [(2, 8), (5, 8)],
    [(1, 3), (0, 0)],  # a padding row
    [(4, 4), (0, 6)],  # a row that is all prompt; a row without prompt
    [(7, 8), (0, 0)],
]


def supervised_and_real(batches: list[MicroBatch]) -> tuple[int, int]:
    """(supervised targets, counted here from the labels; real examples) of the given micro-batches."""
    supervised = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batches)
    return supervised, sum(mb.num_examples for mb in batches)


@pytest.mark.parametrize("loss", CLASSIFIER_LOSSES)
def test_per_example_classifier_equals_full_batch_float64_reference(loss):
    loss_sum_fn, reference_gradient = CLASSIFIER_LOSSES[loss]
    batches = classifier_micro_batches(CLASSIFIER_MICRO_BATCHES, seed=20)
    model = classifier()
    reference = reference_gradient(model, batches)
    gradient, result = one_step_gradient(model, batches, loss_sum_fn=loss_sum_fn)
    assert max_relative_error(gradient, reference) < FLOAT64_RTOL
    assert (result.tokens, result.examples) == supervised_and_real(batches) == (8, 16)


def test_prompt_masked_rows_equal_full_batch_float64_reference():
    batches = prompt_masked_micro_batches(PROMPT_MASKED_MICRO_BATCHES, seed=21)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    gradient, result = one_step_gradient(model, batches)
    assert max_relative_error(gradient, reference) < FLOAT64_RTOL
    assert (result.tokens, result.examples) == supervised_and_real(batches) == (18, 6)


def test_a_mean_of_means_loss_fails_the_prompt_masked_comparison():
    """The same comparison catches the classic weighting given to the step as its loss_sum_fn: each
    micro-batch's MEAN, times the average targets per micro-batch N / A so that the gradient keeps its overall
    size. The step's 1 / N then leaves the mean of the A micro-batch means (an empty micro-batch adds 0)."""
    batches = prompt_masked_micro_batches(PROMPT_MASKED_MICRO_BATCHES, seed=21)
    targets_per_micro_batch = supervised_and_real(batches)[0] / len(batches)

    def micro_batch_mean_times_average_count(outputs, labels):
        targets = max(count_supervised_tokens(labels), 1)
        return token_cross_entropy_sum(outputs, labels) / targets * targets_per_micro_batch

    model = new_model()
    reference = float64_reference_gradient(model, batches)
    wrong, _ = one_step_gradient(copy.deepcopy(model), batches, loss_sum_fn=micro_batch_mean_times_average_count)
    assert max_relative_error(wrong, reference) > 1e-3 > FLOAT64_RTOL
    right, _ = one_step_gradient(model, batches)
    assert max_relative_error(right, reference) < FLOAT64_RTOL
