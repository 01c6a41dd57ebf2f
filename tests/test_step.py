"""The accumulation core: one optimizer step equals the full-batch update.

The reference in every equivalence test is computed independently of `accumulation.step`: one forward and
backward of PyTorch's own mean loss over the supervised targets (`reduction="mean"` with `ignore_index`) of
the concatenation of every micro-batch of every rank, in float64, on one process (testkit/reference.py).
The step's own loss sums and its weighting by D / N never enter it.

Three label shapes are checked: byte-level language-model rows (the project's GPT, targets masked by
length), prompt-masked language-model rows (the first P targets of a row are -100), and a per-example
classifier (one label per row, -100 for an unsupervised example), the last also with a custom loss_sum_fn.
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch, accumulation_steps, describe_batch, micro_batch_slices
from accumulation.counters import Counters
from accumulation.data import build_micro_batches, make_rows, step_counts, step_row_ids, steps_per_epoch
from accumulation.model import GPT, GPTConfig
from accumulation.schedule import build_scheduler, lr_multiplier
from accumulation.step import (
    GlobalCounts,
    StepResult,
    count_supervised_tokens,
    optimizer_step,
    token_cross_entropy_sum,
)
from testkit.ranks import run_on_ranks
from testkit.reference import (
    capture_gradients,
    counting_allreduce_hook,
    float64_reference_gradient,
    full_batch_mean_loss,
    max_relative_error,
)

CPU = torch.device("cpu")
SEQ_LEN = 8
VOCAB_SIZE = 256  # byte tokens
MODEL = GPTConfig(seq_len=SEQ_LEN, n_layer=1, n_head=2, d_model=16, vocab_size=VOCAB_SIZE)

# float64 runs of the step and of the reference differ only in the order in which the same float64 terms
# are added (per micro-batch, then across micro-batches and ranks, versus one big sum). Each reordering
# costs at most a few ulps (2.2e-16 relative) per term over a few thousand terms, far below 1e-10 relative
# to the largest gradient entry; a wrong weighting is off by 1e-3 or more (checked below).
FLOAT64_RTOL = 1e-10


def rows(supervised_counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows; row i supervises its first supervised_counts[i] positions (0: a padding row)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB_SIZE, (len(supervised_counts), SEQ_LEN), generator=generator)
    labels = torch.randint(0, VOCAB_SIZE, (len(supervised_counts), SEQ_LEN), generator=generator)
    for row, count in enumerate(supervised_counts):
        labels[row, count:] = IGNORE_INDEX
    return inputs, labels


def micro_batches(counts_per_micro_batch: list[list[int]], seed: int) -> list[MicroBatch]:
    batches = []
    for k, counts in enumerate(counts_per_micro_batch):
        inputs, labels = rows(counts, seed * 1000 + k)
        batches.append(MicroBatch(inputs, labels, num_examples=sum(1 for c in counts if c > 0)))
    return batches


def new_model(dtype=torch.float64) -> GPT:
    return GPT(MODEL, seed=7).to(dtype)


def one_step_gradient(model, batches, grad_clip=0.0, loss_sum_fn=token_cross_entropy_sum):
    """One optimizer_step with plain SGD; (the gradient the optimizer was handed, the StepResult)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    result = optimizer_step(model, batches, optimizer, device=CPU, loss_sum_fn=loss_sum_fn, grad_clip=grad_clip)
    return captured[0], result


def training_step(model, batches, optimizer, scheduler, counters, **options) -> StepResult:
    """What train.py does with one accumulation group: the step, then the scheduler, whose unit is applied
    updates, and the run's counters."""
    result = optimizer_step(model, batches, optimizer, device=CPU, **options)
    if result.applied:
        scheduler.step()
    counters.add(result)
    return result


# ----------------------------------------------------------------------------------------------------------
# Byte-level language-model rows on one process.

# Supervised-token counts per row, grouped into micro-batches. Same 8 rows in the first two cases.
EIGHT_ROWS = [8, 1, 5, 3, 8, 2, 7, 4]
SINGLE_PROCESS_CASES = {
    "m=8,A=1": [EIGHT_ROWS],
    "m=2,A=4": [EIGHT_ROWS[i : i + 2] for i in range(0, 8, 2)],
    "short last micro-batch": [[8, 1, 5], [3, 8, 2], [7, 4]],
    "token counts 1..full length": [[count] for count in range(1, SEQ_LEN + 1)],
    "zero-token micro-batch": [[8, 3], [0, 0], [2, 6]],
    "partial final group": [[5, 8], [3, 0], [0, 0]],  # 3 real rows of a 6-row group; the rest padding
}


@pytest.mark.parametrize("case", SINGLE_PROCESS_CASES)
def test_one_step_equals_full_batch_float64_reference(case):
    batches = micro_batches(SINGLE_PROCESS_CASES[case], seed=1)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    grads, result = one_step_gradient(model, batches)
    assert max_relative_error(grads, reference) < FLOAT64_RTOL
    supervised = sum(sum(counts) for counts in SINGLE_PROCESS_CASES[case])
    real_rows = sum(1 for counts in SINGLE_PROCESS_CASES[case] for c in counts if c > 0)
    assert (result.tokens, result.examples, result.micro_batches) == (supervised, real_rows, len(batches))
    assert result.applied and result.skip_reason is None


def test_logged_loss_is_the_exact_global_token_mean():
    batches = micro_batches(SINGLE_PROCESS_CASES["token counts 1..full length"], seed=2)
    model = new_model()
    inputs = torch.cat([mb.inputs for mb in batches])
    labels = torch.cat([mb.labels for mb in batches])
    with torch.no_grad():
        expected = full_batch_mean_loss(model(inputs), labels)
    _, result = one_step_gradient(model, batches)
    assert result.loss == pytest.approx(expected.item(), rel=FLOAT64_RTOL)


def test_mean_of_micro_batch_means_is_wrong_on_the_same_data():
    """The classic weighting: each micro-batch's mean loss, averaged over micro-batches. With uneven
    token counts it weights a token of a short micro-batch more, and the comparison above catches it."""
    batches = micro_batches(SINGLE_PROCESS_CASES["token counts 1..full length"], seed=1)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    wrong_model = copy.deepcopy(model)
    for mb in batches:
        (full_batch_mean_loss(wrong_model(mb.inputs), mb.labels) / len(batches)).backward()
    wrong = [p.grad for p in wrong_model.parameters()]
    assert max_relative_error(wrong, reference) > 1e-3 > FLOAT64_RTOL
    correct, _ = one_step_gradient(model, batches)
    assert max_relative_error(correct, reference) < FLOAT64_RTOL


def test_clipping_happens_once_on_the_whole_gradient():
    """Clip the accumulated gradient, not each micro-batch's share: with a small threshold the two differ."""
    batches = micro_batches([[8, 8], [1, 0], [4, 2]], seed=3)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    reference_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference]))
    grad_clip = 0.1 * reference_norm.item()
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6); the 1e-6 is its documented guard against norm 0.
    clipped_reference = [g * (grad_clip / (reference_norm + 1e-6)) for g in reference]

    # The per-micro-batch twin, computed here independently: each micro-batch's share S_k / N clipped alone.
    total_tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batches)
    per_micro_clipped = [torch.zeros_like(g) for g in reference]
    for mb in batches:
        share_model = copy.deepcopy(model)
        loss_sum = F.cross_entropy(
            share_model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        (loss_sum / total_tokens).backward()
        torch.nn.utils.clip_grad_norm_(share_model.parameters(), grad_clip)
        for total, p in zip(per_micro_clipped, share_model.parameters(), strict=True):
            total += p.grad
    assert max_relative_error(per_micro_clipped, clipped_reference) > 1e-3

    grads, result = one_step_gradient(model, batches, grad_clip=grad_clip)
    assert max_relative_error(grads, clipped_reference) < FLOAT64_RTOL
    assert result.grad_norm == pytest.approx(reference_norm.item(), rel=FLOAT64_RTOL)  # norm before clipping


def test_step_without_supervised_tokens_is_skipped_cleanly():
    batches = micro_batches([[0, 0], [0, 0]], seed=4)
    model = new_model()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = optimizer_step(model, batches, optimizer, device=CPU, grad_clip=1.0)
    assert not result.applied and result.skip_reason == "no supervised tokens in the step"
    assert math.isnan(result.loss)  # there is no token to average over; reported, never used as a number
    assert (result.micro_batches, result.examples, result.tokens) == (2, 0, 0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    counters = Counters()
    counters.add(result)
    assert counters == Counters(micro_batches=2, steps=1, updates=0, skipped=1, examples=0, tokens=0)


def test_grad_scaler_skips_a_step_with_an_inf_gradient():
    model = new_model(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = build_scheduler(optimizer, "cosine", 2, 10, 0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    counters = Counters()
    options = {"scaler": scaler, "grad_clip": 1.0}
    training_step(model, micro_batches([[8, 3], [5, 5]], seed=5), optimizer, scheduler, counters, **options)
    assert counters.updates == 1

    weights = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    scale_before = scaler.get_scale()
    lr_before = optimizer.param_groups[0]["lr"]
    # Inject an inf into the gradient of the second (of three) micro-batches' backward only.
    backward_calls = []

    def poison(grad):
        backward_calls.append(1)
        return grad * math.inf if len(backward_calls) == 2 else grad

    handle = model.lm_head.weight.register_hook(poison)
    result = training_step(
        model, micro_batches([[8, 3], [5, 5], [2, 1]], seed=6), optimizer, scheduler, counters, **options
    )
    handle.remove()
    assert len(backward_calls) == 3
    assert not result.applied and "non-finite" in result.skip_reason
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    state_after = optimizer.state_dict()["state"]
    for index, state in optimizer_state["state"].items():
        assert all(torch.equal(state[key], state_after[index][key]) for key in state)
    assert scaler.get_scale() < scale_before
    assert result.lr == lr_before
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == lr_before
    assert (counters.steps, counters.updates, counters.skipped) == (2, 1, 1)


def test_unscale_happens_once_per_step():
    """GradScaler raises if unscale_ is called twice per update; count the calls directly as well."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    calls = []
    original = scaler.unscale_
    scaler.unscale_ = lambda opt: (calls.append(1), original(opt))[1]
    batches = micro_batches([[8], [3], [5], [1]], seed=8)
    optimizer_step(model, batches, optimizer, device=CPU, scaler=scaler, grad_clip=1.0)
    assert len(calls) == 1


def test_no_host_synchronisation_between_first_forward_and_boundary(monkeypatch):
    """Patch every way of reading a tensor back to Python and count the calls made while the micro-batches run
    (from the first forward until the step reaches its boundary, marked by scaler.unscale_)."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    inside = [False]
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if inside[0]:
                reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    model.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, True))
    original_unscale = scaler.unscale_
    scaler.unscale_ = lambda opt: (inside.__setitem__(0, False), original_unscale(opt))[1]

    # Prove the counter works: a read inside the window is seen.
    inside[0] = True
    torch.ones(()).item()
    assert reads == ["item"]
    reads.clear()
    inside[0] = False

    batches = micro_batches([[8, 3], [5, 5], [2, 1], [7, 7]], seed=9)
    optimizer_step(model, batches, optimizer, device=CPU, scaler=scaler, grad_clip=1.0)
    assert reads == []


def test_bf16_autocast_gradients_are_fp32_and_close_to_fp32():
    batches = micro_batches([[8, 3], [5, 5], [2, 1]], seed=10)
    model = new_model(torch.float32)
    fp32_grads, _ = one_step_gradient(copy.deepcopy(model), batches)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    optimizer_step(model, batches, optimizer, device=CPU, autocast_dtype=torch.bfloat16)
    bf16_grads = captured[0]
    assert all(g.dtype == torch.float32 for g in bf16_grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation); through a one-layer model
    # the errors of a few dozen roundings add up to about 1e-2 of the largest entry. 5e-2 leaves margin
    # while still catching a gradient that was, say, halved or computed on the wrong tokens.
    assert max_relative_error(bf16_grads, fp32_grads) < 5e-2


@pytest.mark.parametrize(
    "global_batch_size, micro_batch_size, world_size, expected_words",
    [
        (30, 4, 2, ["30", "15", "4", "[1, 3, 5, 15]"]),
        (30, 2, 4, ["30", "4 ranks", "28 or 32"]),
        (8, 16, 1, ["8", "16", "[1, 2, 4, 8]"]),
        (0, 1, 1, ["global_batch_size", "0"]),
        (8, 2, 0, ["world_size", "0"]),
        (8, 2.0, 1, ["micro_batch_size", "2.0"]),
    ],
)
def test_impossible_batch_arithmetic_names_the_numbers(global_batch_size, micro_batch_size, world_size, expected_words):
    with pytest.raises(ValueError) as error:
        accumulation_steps(global_batch_size, micro_batch_size, world_size)
    for word in expected_words:
        assert word in str(error.value)


def test_batch_arithmetic_and_layout():
    assert accumulation_steps(32, 4, 2) == 4
    assert describe_batch(32, 4, 2) == "global 32 = micro 4 x accum 4 x ranks 2"
    # Every position of the step is used exactly once, whatever the (m, D) split.
    for micro, world in [(8, 1), (2, 1), (4, 2), (1, 2), (2, 4)]:
        positions = [
            i
            for rank in range(world)
            for s in micro_batch_slices(8, micro, world, rank)
            for i in range(s.start, s.stop)
        ]
        assert sorted(positions) == list(range(8))


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
            inputs[row, length:] = 0  # byte 0 is the padding, as in accumulation/data.py
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


# ----------------------------------------------------------------------------------------------------------
# Two gloo ranks.

# Per-rank micro-batches (supervised-token counts per row) of each two-rank scenario.
TWO_RANK_CASES = {
    "uneven ranks, one with a single token": {0: [[8, 8], [7, 6], [8, 5]], 1: [[1, 0], [0, 0], [0, 0]]},
    "one rank without tokens": {0: [[3, 8], [2, 6], [8, 1]], 1: [[0, 0], [0, 0], [0, 0]]},
    "partial final group": {0: [[8, 2], [5, 7], [4, 0]], 1: [[0, 0], [0, 0], [0, 0]]},
    "uneven everywhere": {0: [[8, 1], [2, 2], [8, 8]], 1: [[3, 4], [6, 0], [1, 1]]},
}


def case_batches(case: str, rank: int) -> list[MicroBatch]:
    return micro_batches(TWO_RANK_CASES[case][rank], seed=100 * rank + len(case))


def two_rank_equivalence_worker(rank, world_size):
    results = {}
    for case in TWO_RANK_CASES:
        model = DistributedDataParallel(new_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        # The accumulated gradients just before the boundary micro-batch's forward.
        before_boundary = []
        forwards = []

        def snapshot(module, args, forwards=forwards, before_boundary=before_boundary):
            forwards.append(1)
            if len(forwards) == 3:
                before_boundary.append([p.grad.clone() for p in module.parameters()])

        model.module.register_forward_pre_hook(snapshot)
        result = optimizer_step(model, case_batches(case, rank), optimizer, device=CPU)
        results[case] = {"after": captured[0], "before": before_boundary[0], "result": result}
    # A step with no supervised token anywhere: skipped on both ranks, nobody hangs.
    model = DistributedDataParallel(new_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results["all empty"] = optimizer_step(
        model, micro_batches([[0, 0], [0, 0]], seed=rank), optimizer, device=CPU, grad_clip=1.0
    )
    return results


def test_two_ranks_equal_the_full_batch_and_sync_only_at_the_boundary():
    per_rank = run_on_ranks(two_rank_equivalence_worker, world_size=2)
    model = new_model()
    for case in TWO_RANK_CASES:
        reference = float64_reference_gradient(model, case_batches(case, 0) + case_batches(case, 1))
        after = [r[case]["after"] for r in per_rank]
        # Bit-identical after the boundary all-reduce, and equal to the reference.
        assert all(torch.equal(a, b) for a, b in zip(after[0], after[1], strict=True)), case
        assert max_relative_error(after[0], reference) < FLOAT64_RTOL, case
        total = sum(sum(map(sum, TWO_RANK_CASES[case][rank])) for rank in (0, 1))
        results = [r[case]["result"] for r in per_rank]
        assert results[0].tokens == results[1].tokens == total
        assert results[0].loss == results[1].loss
        assert results[0].micro_batches == 3
    # Before the boundary each rank holds only its own unsynchronised partial sums (where it has tokens).
    before = [r["uneven everywhere"]["before"] for r in per_rank]
    assert any(not torch.equal(a, b) for a, b in zip(before[0], before[1], strict=True))
    for r in per_rank:
        result = r["all empty"]
        assert result.applied is False and result.skip_reason == "no supervised tokens in the step"
        assert (result.micro_batches, result.examples, result.tokens) == (2, 0, 0)


# Per-rank micro-batches of the other label shapes, with very uneven counts: the classifier's ranks hold
# 11 and 1 supervised examples, the prompt-masked rows' ranks 40 and 2 targets.
TWO_RANK_CLASSIFIER = {0: [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], 1: [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]}
TWO_RANK_PROMPT_MASKED = {
    0: [[(0, 8), (1, 8)], [(2, 8), (0, 8)], [(3, 7), (1, 8)]],
    1: [[(6, 8), (0, 0)], [(5, 5), (0, 0)], [(0, 0), (0, 0)]],
}


def two_rank_label_shape_cases(rank: int) -> dict:
    """case -> (the model, rank `rank`'s micro-batches, the step's loss_sum_fn, the reference gradient)."""
    classifier_batches = classifier_micro_batches(TWO_RANK_CLASSIFIER[rank], seed=200 + rank)
    cases = {
        f"classifier, {loss}": (classifier(), classifier_batches, loss_sum_fn, reference_gradient)
        for loss, (loss_sum_fn, reference_gradient) in CLASSIFIER_LOSSES.items()
    }
    prompt_masked_batches = prompt_masked_micro_batches(TWO_RANK_PROMPT_MASKED[rank], seed=300 + rank)
    cases["prompt-masked GPT rows"] = (
        new_model(),
        prompt_masked_batches,
        token_cross_entropy_sum,
        float64_reference_gradient,
    )
    return cases


def two_rank_label_shapes_worker(rank, world_size):
    """One step per case on this rank; the gradient the optimizer was handed, and the StepResult."""
    results = {}
    for case, (model, batches, loss_sum_fn, _) in two_rank_label_shape_cases(rank).items():
        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        result = optimizer_step(wrapped, batches, optimizer, device=CPU, loss_sum_fn=loss_sum_fn)
        results[case] = {"gradient": captured[0], "result": result}
    return results


def test_two_ranks_equal_the_full_batch_for_a_classifier_and_prompt_masked_rows():
    per_rank = run_on_ranks(two_rank_label_shapes_worker, world_size=2)
    cases_by_rank = [two_rank_label_shape_cases(rank) for rank in (0, 1)]
    for case, (model, rank0_batches, _, reference_gradient) in cases_by_rank[0].items():
        all_batches = rank0_batches + cases_by_rank[1][case][1]
        reference = reference_gradient(model, all_batches)
        gradients = [r[case]["gradient"] for r in per_rank]
        assert all(torch.equal(a, b) for a, b in zip(gradients[0], gradients[1], strict=True)), case
        assert max_relative_error(gradients[0], reference) < FLOAT64_RTOL, case
        for r in per_rank:
            assert (r[case]["result"].tokens, r[case]["result"].examples) == supervised_and_real(all_batches), case


def communication_worker(rank, world_size, bypass_no_sync, accumulation):
    if bypass_no_sync:
        # The mistake being measured: every micro-batch synchronises.
        DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    model = DistributedDataParallel(new_model(torch.float32), bucket_cap_mb=0.01)  # several buckets
    state = {"bytes": 0}
    model.register_comm_hook(state, counting_allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, "cosine", 2, 5, 0.1)
    counters = Counters()
    bytes_per_step, lrs = [], []
    for step in range(3):  # DDP rebuilds its buckets after the first iteration: count every step
        counts = [[8 - rank * 3, 2 + step]] * accumulation
        batches = micro_batches(counts, seed=10 * step + rank)
        state["bytes"] = 0
        training_step(model, batches, optimizer, scheduler, counters, grad_clip=1.0)
        bytes_per_step.append(state["bytes"])
        lrs.append(optimizer.param_groups[0]["lr"])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "bytes_per_step": bytes_per_step,
        "grad_bytes": grad_bytes,
        "lrs": lrs,
        "last_epoch": scheduler.last_epoch,
        "counters": counters,
    }


def test_one_gradient_all_reduce_per_step_counted_in_bytes():
    accumulation = 4
    synced = run_on_ranks(communication_worker, 2, args=(False, accumulation))
    bypassed = run_on_ranks(communication_worker, 2, args=(True, accumulation))
    for rank in (0, 1):
        grad_bytes = synced[rank]["grad_bytes"]
        assert synced[rank]["bytes_per_step"] == [grad_bytes] * 3
        assert bypassed[rank]["bytes_per_step"] == [accumulation * grad_bytes] * 3
        # The scheduler advanced once per applied update (3), not per micro-batch (12), on every rank.
        assert synced[rank]["last_epoch"] == 3 == synced[rank]["counters"].updates
        assert synced[rank]["counters"].micro_batches == 3 * accumulation
    assert synced[0]["lrs"] == synced[1]["lrs"]


@pytest.mark.parametrize("accumulation", [1, 3])
def test_scheduler_counts_applied_updates_only(accumulation):
    """After k applied updates, for any A: last_epoch == k and the lr is the schedule's value at k."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = build_scheduler(optimizer, "cosine", 3, 8, 0.1)
    counters = Counters()
    for step in range(6):
        counts = [[0, 0]] * accumulation if step == 2 else [[5, 3]] * accumulation  # step 2 has no tokens
        training_step(model, micro_batches(counts, seed=step), optimizer, scheduler, counters, grad_clip=1.0)
    assert counters.updates == 5 and counters.skipped == 1
    assert scheduler.last_epoch == 5
    # Independent arithmetic of the schedule at 5 updates: cosine after 3 warm-up updates, horizon 8.
    progress = (5 - 3) / (8 - 3)
    expected = 0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert lr_multiplier(5, "cosine", 3, 8, 0.1) * 0.5 == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# The counts from the caller, the one read-back, and the stop flag.


def test_given_global_counts_give_the_same_update_as_counting_and_a_wrong_count_fails_the_reference():
    batches = micro_batches(SINGLE_PROCESS_CASES["token counts 1..full length"], seed=12)
    model = new_model()
    reference = float64_reference_gradient(model, batches)
    counted, counted_result = one_step_gradient(copy.deepcopy(model), batches)  # the fallback: counts the labels
    tokens, examples = supervised_and_real(batches)

    def step_with(counts):
        step_model = copy.deepcopy(model)
        optimizer = torch.optim.SGD(step_model.parameters(), lr=0.1)
        captured = capture_gradients(optimizer)
        result = optimizer_step(step_model, batches, optimizer, device=CPU, global_counts=counts)
        return captured[0], result

    given, given_result = step_with(GlobalCounts(tokens=tokens, examples=examples))
    assert all(torch.equal(a, b) for a, b in zip(given, counted, strict=True))  # the same bits
    assert (given_result.tokens, given_result.examples) == (counted_result.tokens, counted_result.examples)
    assert max_relative_error(given, reference) < FLOAT64_RTOL
    # A count off by one token scales the gradient by N / (N + 1): the reference comparison catches it.
    wrong, _ = step_with(GlobalCounts(tokens=tokens + 1, examples=examples))
    assert max_relative_error(wrong, reference) > 1e-3 > FLOAT64_RTOL


def test_one_read_back_per_update_when_the_counts_are_given(monkeypatch):
    """(loss sum, stop flag, OOM flag, grad norm) come back together in one tolist(); nothing else is read."""
    model = new_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD keeps no step counter to read
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    batches = micro_batches([[8, 3], [5, 5], [2, 1], [7, 7]], seed=13)
    counts = GlobalCounts(*supervised_and_real(batches))
    reads.clear()
    result = optimizer_step(model, batches, optimizer, device=CPU, grad_clip=1.0, global_counts=counts)
    assert result.applied and reads == ["tolist"]


def answers(requested: bool):
    """A stop_requested callable, as train.py passes one (it reads a signal flag at the step's boundary)."""
    return lambda: requested


def test_the_stop_flag_comes_back_on_one_process():
    batches = micro_batches([[8, 3]], seed=14)
    for requested in (False, True):
        model = new_model(torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        result = optimizer_step(model, batches, optimizer, device=CPU, stop_requested=answers(requested))
        assert result.stop_requested is requested and result.applied


def stop_flag_worker(rank, world_size):
    model = DistributedDataParallel(new_model(torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step, stopping_rank in enumerate((None, 1, 0)):  # nobody, then rank 1 alone, then rank 0 alone
        batches = micro_batches([[8, 3], [5, 2]], seed=20 * step + rank)
        result = optimizer_step(model, batches, optimizer, device=CPU, stop_requested=answers(rank == stopping_rank))
        results.append(result.stop_requested)
    empty = micro_batches([[0, 0]], seed=99)  # a step without tokens still carries the flag
    result = optimizer_step(model, empty, optimizer, device=CPU, stop_requested=answers(rank == 1))
    results.append(result.stop_requested)
    return results


def test_the_stop_flag_of_any_rank_reaches_every_rank():
    assert run_on_ranks(stop_flag_worker, 2) == [[False, True, True, True]] * 2


def test_grad_scaler_overflow_with_fused_adamw_skips_exactly_what_the_scaler_skips():
    """An injected overflow: the scaler's own inf check skips the fused AdamW step (weights and the optimizer's
    step counts unchanged), the scale halves, `applied` is False; the next step is applied."""
    model = new_model(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    first = optimizer_step(model, micro_batches([[8, 3]], seed=15), optimizer, device=CPU, scaler=scaler)
    assert first.applied
    weights = copy.deepcopy(model.state_dict())
    steps_before = [state["step"].clone() for state in optimizer.state.values()]
    handle = model.lm_head.weight.register_hook(lambda grad: grad * math.inf)
    overflow = optimizer_step(model, micro_batches([[8, 3]], seed=16), optimizer, device=CPU, scaler=scaler)
    handle.remove()
    assert not overflow.applied and overflow.skip_reason == "non-finite gradient (GradScaler lowered its scale)"
    assert not math.isfinite(overflow.grad_norm)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, state["step"]) for a, state in zip(steps_before, optimizer.state.values(), strict=True))
    assert scaler.get_scale() == 2.0**9
    after = optimizer_step(model, micro_batches([[8, 3]], seed=17), optimizer, device=CPU, scaler=scaler)
    assert after.applied and all(state["step"].item() == 2 for state in optimizer.state.values())
    assert (first.loss_scale, overflow.loss_scale, after.loss_scale) == (2.0**10, 2.0**10, 2.0**9)  # read back free


@pytest.mark.parametrize("tail", ["drop", "partial"])
def test_the_counts_train_py_takes_from_row_ids_equal_the_labels_counts_over_all_ranks(tail):
    """train.py passes GlobalCounts from rows.supervised_counts(row_ids); the fallback counts the labels of every
    rank's micro-batches. Both must agree for every step and layout, the partial last step included."""
    documents = [bytes(range(3 + i % 11, 20 + 5 * i)) for i in range(30)]  # rows of many supervised lengths
    rows_of_corpus = make_rows(documents, SEQ_LEN)
    global_batch_size = 12
    for step in range(steps_per_epoch(rows_of_corpus.num_rows, global_batch_size, tail) + 1):
        row_ids = step_row_ids(rows_of_corpus.num_rows, global_batch_size, 3, step, tail)
        given = step_counts(rows_of_corpus, row_ids, step)
        for micro_batch_size, world_size in ((2, 2), (3, 1), (6, 2)):
            every = [
                mb
                for rank in range(world_size)
                for mb in build_micro_batches(
                    rows_of_corpus, row_ids, global_batch_size, micro_batch_size, world_size, rank, step=step
                )
            ]
            assert given == GlobalCounts(*supervised_and_real(every)), (step, micro_batch_size, world_size)
