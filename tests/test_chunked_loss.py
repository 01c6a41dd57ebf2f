"""model.loss = "chunked": the output head and the cross-entropy a chunk of positions at a time, gradients
computed in the forward. The same SUM and the same gradients as the plain loss, and through optimizer_step the
same update as the independent float64 reference (testkit/reference.py), on one process and on 2 gloo ranks."""

import copy
import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import train
from accumulation import chunked_loss as chunked_loss_module
from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch, count_supervised_tokens
from accumulation.chunked_loss import (
    ChunkedCrossEntropySum,
    FinalHiddenStates,
    chunk_loss_and_gradients,
    chunked_loss_pays,
    plain_loss_bytes,
)
from accumulation.config.config import ConfigError, load_config
from accumulation.models.factory import build_model, decided_model_config, training_forward_and_loss
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import (
    capture_gradients,
    float64_reference_gradient,
    full_batch_mean_loss,
    max_relative_error,
)

CPU = torch.device("cpu")
MODEL = GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16, vocab_size=64)
# 5 positions per chunk: 3 rows of 8 cut into 5 chunks, the last one shorter, chunks spanning two rows.
CHUNK_POSITIONS = 5
# float64: the chunked and plain sums add the same terms in another order, a few ulps (2.2e-16) each over
# at most a few hundred terms; 1e-12 relative is far above that and far below any real difference.
FLOAT64_RTOL = 1e-12
# fp32: each logit and gradient entry is a d = 16 term dot product (about 1e-7 relative error each), the sums
# run over a few hundred positions in another order: 1e-5 relative to the largest entry leaves room for both.
FLOAT32_RTOL = 1e-5


def hidden_and_labels(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [3, 8, 16] and labels with masked positions: a padded row end and a wholly masked row."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 8, 16, generator=generator, dtype=dtype)
    labels = torch.randint(0, MODEL.vocab_size, (3, 8), generator=generator)
    labels[0, 5:] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX  # with 5-position chunks, chunk [20, 24) holds no target at all
    return hidden, labels


def sum_and_gradients(loss_sum_fn, outputs_of, hidden, head) -> tuple[torch.Tensor, list[torch.Tensor]]:
    hidden = hidden.clone().requires_grad_()
    head.weight.grad = None
    loss_sum = loss_sum_fn(outputs_of(hidden), LABELS)
    loss_sum.backward()
    return loss_sum.detach(), [hidden.grad, head.weight.grad]


_, LABELS = hidden_and_labels(torch.float64)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, FLOAT64_RTOL), (torch.float32, FLOAT32_RTOL)])
def test_the_chunked_sum_and_its_gradients_equal_the_plain_loss(dtype, rtol):
    hidden, _ = hidden_and_labels(dtype)
    head = torch.nn.Linear(16, MODEL.vocab_size, bias=False).to(dtype)
    chunked_sum, chunked = sum_and_gradients(ChunkedCrossEntropySum(head, CHUNK_POSITIONS), lambda h: h, hidden, head)
    plain_sum, plain = sum_and_gradients(token_cross_entropy_sum, head, hidden, head)
    assert chunked_sum.dtype == plain_sum.dtype == dtype
    torch.testing.assert_close(chunked_sum, plain_sum, rtol=rtol, atol=0)
    assert max_relative_error(chunked, plain) < rtol
    with torch.no_grad():  # validation: the sum alone, no gradient kept
        assert torch.allclose(ChunkedCrossEntropySum(head, CHUNK_POSITIONS)(hidden, LABELS), plain_sum, rtol=rtol)


def test_under_bf16_autocast_the_chunked_loss_matches_the_plain_loss_under_autocast():
    """The logits are a bf16 product in both (autocast's rule for a Linear), the cross-entropy fp32 in both. The
    two differ only in how bf16 products are blocked and in fp32 summation order: 1e-3 relative on a sum of
    ~4 per target is 100 times bf16's rounding of the sum's terms averaged out, and a loss computed in fp32
    logits instead would differ by about bf16's 4e-3 per logit."""
    hidden, _ = hidden_and_labels(torch.float32)
    head = torch.nn.Linear(16, MODEL.vocab_size, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_sum, chunked = sum_and_gradients(
            ChunkedCrossEntropySum(head, CHUNK_POSITIONS), lambda h: h, hidden, head
        )
        plain_sum, plain = sum_and_gradients(token_cross_entropy_sum, head, hidden, head)
    assert chunked_sum.dtype == torch.float32
    torch.testing.assert_close(chunked_sum, plain_sum, rtol=1e-3, atol=0)
    # bf16 gradients: each entry rounds to 2^-9 relative; 2e-2 of the largest entry bounds a sum of a few.
    assert max_relative_error(chunked, plain) < 2e-2


def micro_batches_of(seed: int, count: int) -> list[MicroBatch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(count):
        inputs = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels[k % 2, 3 + k :] = IGNORE_INDEX  # uneven supervised counts across micro-batches
        batches.append(MicroBatch(inputs, labels, num_examples=2))
    return batches


def chunked_step_gradient(model, micro_batches, global_counts=None) -> list[torch.Tensor]:
    """One optimizer_step of the chunked pair (hidden states + chunked loss) with SGD: the gradient it applies."""
    forward_module = FinalHiddenStates(model)
    if torch.distributed.is_initialized():
        forward_module = DistributedDataParallel(forward_module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    loss_sum_fn = ChunkedCrossEntropySum(model.output_head, CHUNK_POSITIONS)
    optimizer_step(
        StepSetup(forward_module, CPU, loss_sum_fn=loss_sum_fn), micro_batches, optimizer, global_counts=global_counts
    )
    return captured[0]


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, FLOAT32_RTOL)])
def test_one_process_step_with_the_chunked_loss_equals_the_float64_reference(dtype, rtol):
    """1e-10 in float64 as tests/test_step.py bounds the plain step (only the order of additions differs)."""
    model = GPT(MODEL, seed=3)
    batches = micro_batches_of(seed=1, count=3)
    reference = float64_reference_gradient(model, batches)
    assert max_relative_error(chunked_step_gradient(model.to(dtype), batches), reference) < rtol


def bf16_step(model, micro_batches, chunked: bool) -> tuple[float, list[torch.Tensor]]:
    """(the logged loss, the gradient applied) of one optimizer_step under CPU bf16 autocast (precision.dtype =
    "bf16"), with the chunked pair (model.loss = "chunked") or the plain one."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    forward_module = FinalHiddenStates(model) if chunked else model
    loss_sum_fn = ChunkedCrossEntropySum(model.output_head, CHUNK_POSITIONS) if chunked else token_cross_entropy_sum
    result = optimizer_step(
        StepSetup(forward_module, CPU, loss_sum_fn=loss_sum_fn, autocast_dtype=torch.bfloat16), micro_batches, optimizer
    )
    return result.loss, captured[0]


def test_a_bf16_autocast_step_with_the_chunked_loss_equals_the_plain_one_and_the_float64_reference(monkeypatch):
    """Under CPU bf16 autocast both pairs run the same body in bf16 and the output product in bf16; the loss is
    fp32 in both. The loss: the same bf16 logits summed in fp32 in another order, about 1e-7 relative (a bf16
    product blocked differently flips a logit of about 0.1 by 2^-9, 2e-4, about 1e-6 of a mean loss of
    log 64 = 4.2 over ~40 targets); 1e-5 against the plain loss. Against float64 every logit carries bf16's
    rounding, ~2e-4 absolute, about 5e-5 of one target's loss, averaged over the targets: 1e-4. A softmax or a
    loss sum kept in bf16 is off by 2^-9 per chunk sum of ~20: 1e-4..1e-3. The gradient: each entry rounds to
    bf16 (2^-9 ≈ 2e-3) in both pairs, a few roundings apart: 2e-2 of the largest entry against the plain pair,
    and against float64 the checker's bf16 tolerance, 5e-2 (accumulation/checker/run.py). The chunks' products
    must run in bf16 as the plain head's do: fp32 products would be closer to float64 than bf16's rounding, so no
    tolerance sees them; the dtypes the chunks are handed do."""
    model = GPT(MODEL, seed=3)
    batches = micro_batches_of(seed=1, count=3)
    chunk_dtypes = set()
    real_chunk = chunked_loss_module.chunk_loss_and_gradients

    def chunk_noting_dtypes(hidden, weight, *args):
        chunk_dtypes.update((hidden.dtype, weight.dtype))
        return real_chunk(hidden, weight, *args)

    monkeypatch.setattr(chunked_loss_module, "chunk_loss_and_gradients", chunk_noting_dtypes)
    chunked_loss, chunked = bf16_step(model, batches, chunked=True)
    assert chunk_dtypes == {torch.bfloat16}
    plain_loss, plain = bf16_step(model, batches, chunked=False)
    reference = float64_reference_gradient(model, batches)
    with torch.no_grad():
        inputs, labels = (torch.cat([getattr(mb, name) for mb in batches]) for name in ("inputs", "labels"))
        reference_loss = float(full_batch_mean_loss(copy.deepcopy(model).double()(inputs), labels))
    assert abs(chunked_loss - plain_loss) <= 1e-5 * abs(plain_loss)
    assert abs(chunked_loss - reference_loss) <= 1e-4 * abs(reference_loss)
    assert max_relative_error(chunked, plain) < 2e-2
    assert max_relative_error(chunked, reference) < 5e-2
    assert max_relative_error(plain, reference) < 5e-2  # the plain pair itself: the reference is the right one


def two_rank_chunked_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    every = micro_batches_of(seed=2, count=4)
    counts = GlobalCounts(sum(count_supervised_tokens(mb.labels) for mb in every), 8)
    return chunked_step_gradient(GPT(MODEL, seed=3).double(), every[rank * 2 : rank * 2 + 2], counts)


def test_two_ranks_with_the_chunked_loss_equal_the_float64_reference():
    """DDP wraps the hidden-states module; the output head's weight, used only in the loss, still gets its
    gradient in the backward and is all-reduced with the rest (a missing all-reduce would leave the ranks
    apart, a missing gradient would fail DDP)."""
    gradients = run_on_ranks(two_rank_chunked_worker, world_size=2)
    reference = float64_reference_gradient(GPT(MODEL, seed=3), micro_batches_of(seed=2, count=4))
    assert all(torch.equal(a, b) for a, b in zip(gradients[0], gradients[1], strict=True))
    assert max_relative_error(gradients[0], reference) < 1e-10


def test_model_loss_chooses_the_pair_the_step_runs():
    def pair(overrides, model):
        config = load_config(overrides)
        return training_forward_and_loss(decided_model_config(config, model, CPU), model)

    def build(overrides):
        config = load_config(overrides)
        return build_model(config.model, 256, seq_len=config.data.seq_len, seed=config.run.seed)

    gpt = build(["model.loss=chunked"])
    module, loss_sum_fn = pair(["model.loss=chunked"], gpt)
    assert isinstance(module, FinalHiddenStates) and isinstance(loss_sum_fn, ChunkedCrossEntropySum)
    # auto on the CPU: plain, the model and the token cross-entropy
    assert pair([], gpt) == (gpt, token_cross_entropy_sum)
    assert pair(["model.loss=plain"], gpt)[0] is gpt
    # A model without hidden_states() and output_head keeps the plain loss under auto, and is refused for chunked.
    with pytest.raises(ConfigError, match='model.loss: "chunked" needs a model with hidden_states'):
        pair(["model.name=gru", "model.loss=chunked"], build(["model.name=gru", "model.loss=chunked"]))
    gru = build(["model.name=gru"])
    assert pair(["model.name=gru"], gru)[0] is gru


def test_model_loss_auto_chooses_chunked_on_cuda_when_the_plain_logits_would_take_over_a_quarter_of_free_memory(
    monkeypatch,
):
    """The rule docs/performance.md states, with given numbers: 3 fp32 copies of the logits [m·T, V] against a
    quarter of the GPU's free memory; on the CPU auto is plain whatever the memory."""
    # configs/gpu_8x.toml's shape at m = 16: 16 x 1024 positions, V = 50,304: 9.9 GB of logit buffers.
    positions, vocab = 16 * 1024, 50_304
    assert plain_loss_bytes(positions, vocab) == 3 * 4 * positions * vocab == 9_890_168_832
    assert chunked_loss_pays(positions, vocab, free_bytes=39 * 10**9)  # a 40 GB GPU: over a quarter of it
    assert not chunked_loss_pays(positions, vocab, free_bytes=79 * 10**9)  # an 80 GB one: under a quarter
    assert not chunked_loss_pays(positions, vocab, free_bytes=4 * 9_890_168_832)  # exactly a quarter: plain

    def auto(overrides, model, free_bytes, device_type="cuda"):
        # The GPU's free memory as given; the decision reads nothing else of the device.
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 2 * free_bytes))
        shape = ["batch.global_batch_size=16", "batch.micro_batch_size=16", "data.seq_len=1024"]  # m·T = positions
        config = load_config([*shape, *overrides])
        return decided_model_config(config, model, torch.device(device_type)).loss == "chunked"

    gpt = build_model(load_config([]).model, vocab, seq_len=8, seed=0)
    assert auto([], gpt, free_bytes=10**9) is True
    assert auto([], gpt, free_bytes=10**12) is False
    assert auto([], gpt, free_bytes=10**9, device_type="cpu") is False
    assert auto([], gpt, free_bytes=10**9, device_type="meta") is False  # train.py's first check: not decided yet
    # The other conditions stay: FSDP2, pipeline stages and a model without an output head keep the plain loss; an
    # explicit choice is never overruled by the memory.
    assert auto(["dist.strategy=fsdp2"], gpt, free_bytes=10**9) is False
    assert auto(["dist.pipeline_stages=2"], gpt, free_bytes=10**9) is False
    gru = build_model(load_config(["model.name=gru"]).model, vocab, seq_len=8, seed=0)
    assert auto(["model.name=gru"], gru, free_bytes=10**9) is False
    assert auto(["model.loss=plain"], gpt, free_bytes=10**9) is False
    assert auto(["model.loss=chunked"], gpt, free_bytes=10**15) is True


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_with_model_compile_the_model_and_the_loss_compile_and_the_step_stays_exact(loss):
    """What train.py runs with model.compile = true: the forward and the loss in one module (training_forward_and_loss),
    compiled as one region (wrap_for_training). Compiled kernels fuse and reorder fp32 operations; FLOAT32_RTOL
    still bounds that, and a wrong weighting would be off by far more (tests/test_step.py)."""
    model = GPT(MODEL, seed=3)
    batches = micro_batches_of(seed=1, count=3)
    reference = float64_reference_gradient(model, batches)
    config = load_config([f"model.loss={loss}", "model.compile=true"])
    forward_module, loss_sum_fn = training_forward_and_loss(config.model, model, compile=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    assert loss_sum_fn is None  # the module computes S itself
    optimizer_step(StepSetup(torch.compile(forward_module), CPU, loss_sum_fn=loss_sum_fn), batches, optimizer)
    assert max_relative_error(captured[0], reference) < FLOAT32_RTOL


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_compiled_and_the_eager_form_of_a_chunks_gradient_give_the_same_bits(monkeypatch, dtype):
    """Under torch.compile the chunk's ∂S/∂Z is the pointwise where(j == y, p - 1, p) · mask (one fused kernel);
    eagerly a scatter of -1 at the targets (a pass over P entries, not [P, V]). Both compute p - 1 at the target
    and p elsewhere, so S, ∂S/∂H and ∂S/∂W agree bit for bit; here the compiled form runs eagerly."""
    hidden, _ = hidden_and_labels(dtype)
    hidden = hidden.reshape(-1, 16)
    weight = torch.nn.Linear(16, MODEL.vocab_size, bias=False).weight.detach().to(dtype)
    labels = LABELS.reshape(-1)

    def chunk():
        grad_weight = torch.zeros_like(weight)
        loss_sum, grad_hidden = chunk_loss_and_gradients(hidden, weight, labels, grad_weight, True)
        return loss_sum, grad_hidden, grad_weight

    eager = chunk()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    pointwise = chunk()
    assert all(torch.equal(a, b) for a, b in zip(eager, pointwise, strict=True))


@pytest.mark.compile
def test_inductor_computes_a_chunks_gradient_without_an_fp32_logits_sized_buffer(tmp_path, monkeypatch):
    """One bf16 chunk compiled by Inductor on the CPU: the only [P, V] buffers its generated code allocates are in
    the compute dtype (the logits' product, and its gradient written over it), none in fp32. The scatter the
    gradient used before made Inductor write the fp32 probabilities whole (a [P, V] float32 buffer) and pass
    over them twice more; this test found that buffer in the code of the old chunk_loss_and_gradients."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor.utils import run_and_get_code

    positions, vocab, width = 40, 96, 16
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, width, generator=generator).bfloat16()
    weight = torch.randn(vocab, width, generator=generator).bfloat16()
    labels = torch.randint(0, vocab, (positions,), generator=generator)
    labels[:5] = IGNORE_INDEX
    grad_weight = torch.zeros(vocab, width)

    def chunk(hidden, weight, labels, grad_weight):
        return chunk_loss_and_gradients(hidden, weight, labels, grad_weight, True)

    (loss_sum, grad_hidden), codes = run_and_get_code(torch.compile(chunk), hidden, weight, labels, grad_weight.clone())
    allocations = re.findall(r"empty_strided_cpu\(\((\d+), (\d+)\), \(\d+, \d+\), torch\.(\w+)\)", "\n".join(codes))
    logits_sized = [dtype for rows, columns, dtype in allocations if (int(rows), int(columns)) == (positions, vocab)]
    assert logits_sized and set(logits_sized) == {"bfloat16"}, allocations
    # And the compiled chunk computes what the eager one does: bf16 products, fp32 sums (2e-2: bf16's rounding).
    eager_sum, eager_grad_hidden = chunk(hidden, weight, labels, grad_weight)
    torch.testing.assert_close(loss_sum, eager_sum, rtol=1e-3, atol=0)
    assert max_relative_error([grad_hidden.float()], [eager_grad_hidden.float()]) < 2e-2


def model_line_of_a_run(tmp_path, capsys, arguments: list[str]) -> str:
    """The run header's model line of train.main with run.max_steps = 0 (everything built, no step run, so a
    compiled module is never called and never compiles)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(parents=True)
    for index in range(8):
        (corpus / f"doc{index}.txt").write_text(f"document {index}: " + "some words to predict " * 20)
    common = [f"data.source={corpus}", f"run.out_dir={tmp_path / 'runs'}", "data.seq_len=32", "run.max_steps=0"]
    assert train.main([*common, "model.n_layer=1", "model.d_model=32", "model.n_head=2", *arguments]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))


@pytest.mark.parametrize("compiled", ["false", "true"])
def test_the_run_header_names_the_loss_that_runs_compiled_or_not(tmp_path, capsys, compiled):
    """With model.compile on, the step runs ForwardAndLoss around the model (the plain loss) or around its hidden
    states (the chunked one): the header names model.loss as decided ("auto" is plain on the CPU), not what the
    module looks like."""
    plain = model_line_of_a_run(tmp_path / "plain", capsys, [f"model.compile={compiled}"])
    assert f"; loss plain; compile {'on' if compiled == 'true' else 'off'}" in plain
    chunked = model_line_of_a_run(tmp_path / "chunked", capsys, [f"model.compile={compiled}", "model.loss=chunked"])
    assert f"; loss chunked; compile {'on' if compiled == 'true' else 'off'}" in chunked
