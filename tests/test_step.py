"""The accumulation core: one optimizer step equals the full-batch update.

The reference in every equivalence test is computed independently of `accumulation.step`: one forward and
backward of PyTorch's own mean loss over the supervised targets (`reduction="mean"` with `ignore_index`) of
the concatenation of every micro-batch of every rank, in float64, on one process (testkit/reference.py).
The step's own loss sums and its weighting by D / N never enter it.

Three label shapes are checked: byte-level language-model rows (the project's GPT, targets masked by
length), prompt-masked language-model rows (the first P targets of a row are -100), and a per-example
classifier (one label per row, -100 for an unsupervised example), the last also with a custom loss_sum_fn.

This file holds the byte-level rows on one process and the helpers the other step tests share; the other
label shapes, two gloo ranks, and the counts and stop flag are in tests/test_step_label_shapes.py,
tests/test_step_two_ranks.py and tests/test_step_counts_and_stop.py.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from accumulation.batching import (
    IGNORE_INDEX,
    MicroBatch,
    accumulation_steps,
    collective_device,
    describe_batch,
    micro_batch_slices,
)
from accumulation.config.config_keys import ScheduleConfig
from accumulation.counters import Counters
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.schedule import build_scheduler, run_scheduler
from accumulation.step import (
    StepResult,
    StepSetup,
    optimizer_step,
    token_cross_entropy_sum,
)
from testkit.reference import (
    capture_gradients,
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
    result = optimizer_step(StepSetup(model, CPU, loss_sum_fn=loss_sum_fn, grad_clip=grad_clip), batches, optimizer)
    return captured[0], result


def training_step(model, batches, optimizer, scheduler, counters, **options) -> StepResult:
    """What train.py does with one accumulation group: the step, then the scheduler, whose unit is applied
    updates, and the run's counters."""
    result = optimizer_step(StepSetup(model, CPU, **options), batches, optimizer)
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
    result = optimizer_step(StepSetup(model, CPU, grad_clip=1.0), batches, optimizer)
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
    optimizer_step(StepSetup(model, CPU, scaler=scaler, grad_clip=1.0), batches, optimizer)
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
    optimizer_step(StepSetup(model, CPU, scaler=scaler, grad_clip=1.0), batches, optimizer)
    assert reads == []


def test_bf16_autocast_gradients_are_fp32_and_close_to_fp32():
    batches = micro_batches([[8, 3], [5, 5], [2, 1]], seed=10)
    model = new_model(torch.float32)
    fp32_grads, _ = one_step_gradient(copy.deepcopy(model), batches)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    optimizer_step(StepSetup(model, CPU, autocast_dtype=torch.bfloat16), batches, optimizer)
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


@pytest.mark.parametrize(("decay_updates", "max_steps", "horizon"), [(0, 10, 10), (4, 10, 4)])
def test_the_runs_cosine_horizon_is_decay_updates_or_else_run_max_steps(decay_updates, max_steps, horizon):
    """run_scheduler, the one place the horizon is decided (train.py's build and the resume check use it): the
    learning rate reaches min_lr_ratio after exactly `horizon` updates and is halfway down at horizon / 2."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = ScheduleConfig(name="cosine", warmup_updates=0, decay_updates=decay_updates, min_lr_ratio=0.1)
    scheduler = run_scheduler(optimizer, schedule, max_steps)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(horizon):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates[horizon // 2] == pytest.approx(0.55)  # 0.1 + 0.9 · (1 + cos(π/2)) / 2
    assert rates[horizon - 1] > 0.1 and rates[horizon] == pytest.approx(0.1)


@pytest.mark.parametrize(("backend", "expected"), [("nccl", "cuda"), ("gloo", "cpu")])
def test_a_collective_runs_on_the_device_under_nccl_and_on_the_host_under_gloo(backend, expected, monkeypatch):
    """batching.collective_device: the one copy of the rule (the counts' all-reduce, the chunked loss's free-memory
    minimum, GRPO's exchange and the micro-batch sweep's peak use it)."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: backend)
    assert collective_device(torch.device("cuda", 0)).type == expected
