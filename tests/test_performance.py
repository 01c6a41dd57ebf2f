"""Performance invariants, measured with the benchmark's own functions (scripts/benchmarks/bench.py).

Timings live in the benchmark only; what is asserted here holds on any machine. Already asserted and not
repeated: one gradient all-reduce per step, counted in bytes (tests/test_step_two_ranks.py), and no read of a
tensor value into Python during the micro-batches of the plain (single-process) step (tests/test_step.py).
"""

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.config.config import load_config
from accumulation.data.rows import BYTE_VOCAB_SIZE, make_rows
from accumulation.data.sources import build_data
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.run.optimizer_state import load_optimizer_state
from scripts.benchmarks import bench, invariants, measuring, nanogpt_peer
from testkit.memory import peak_memory_bytes_of
from testkit.reference import capture_gradients, max_relative_error

CPU = torch.device("cpu")
TINY = GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=16, vocab_size=BYTE_VOCAB_SIZE)
ACCUMULATION = 4  # A on each of the two ranks
MICRO_BATCH_SIZE = 2


def tiny_gpt() -> GPT:
    return GPT(TINY, seed=0)


def compiled_tiny_gpt() -> torch.nn.Module:
    """What train.py builds with model.compile = true: torch.compile first, DDP around it."""
    return torch.compile(tiny_gpt())


class ChattyGPT(torch.nn.Module):
    """A GPT whose forward makes the mistakes the counters must see: it reads a value back into Python and
    calls one more collective, in every micro-batch."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens)
        logits[0, 0, 0].item()
        dist.all_reduce(torch.zeros(()))
        return logits


def two_rank_steps(steps: int = 2) -> list[list]:
    """Per rank, the micro-batches of `steps` optimizer steps, cut from this file's own text."""
    rows = make_rows([Path(__file__).read_bytes()], TINY.seq_len)
    return [
        [measuring.step_micro_batches(rows, step, MICRO_BATCH_SIZE, ACCUMULATION, 2, rank) for step in range(steps)]
        for rank in range(2)
    ]


def test_peak_memory_is_flat_under_accumulation():
    """The benchmark's own case: default model, m = 4, real rows.

    Accumulating keeps the activations of one micro-batch of m rows alive, never those of A of them. What it
    adds over A = 1 is the accumulated gradient, held while micro-batches 2..A run (with A = 1 the gradient
    only appears as the backward frees the activations): at most grad_bytes, whatever A is. In this small
    model that is 3.5 MB against 19.5 MB of activations at m = 4, so the issue's m_A8 <= 1.05 · m_A1 is
    asserted with grad_bytes added.
    """
    rows = build_data(
        measuring.DEFAULTS.data, model_vocab_size=measuring.DEFAULTS.model.vocab_size, seed=measuring.DEFAULTS.run.seed
    ).train
    cpu = torch.device("cpu")
    m = 4

    def peak_bytes(micro_batch_size: int, accumulation: int) -> int:
        model = GPT(invariants.default_model_config(), seed=0)
        return invariants.peak_update_memory_bytes(
            model, measuring.step_micro_batches(rows, 0, micro_batch_size, accumulation, 1, 0), cpu
        )

    m_a1, m_a2, m_a8, eight_m_a1 = peak_bytes(m, 1), peak_bytes(m, 2), peak_bytes(m, 8), peak_bytes(8 * m, 1)
    grad_bytes = invariants.gradient_bytes(GPT(invariants.default_model_config(), seed=0))
    assert m_a8 <= invariants.TARGET_MEMORY_RATIO * m_a2  # flat in A: micro-batches 3..8 cost nothing more
    assert m_a8 <= invariants.TARGET_MEMORY_RATIO * m_a1 + grad_bytes
    # The same 8m rows in one micro-batch: the measurement does see activations grow.
    assert eight_m_a1 > invariants.MIN_8M_OVER_M_A8 * m_a8


def test_a_step_makes_one_scalar_collective_and_no_host_read_in_its_micro_batches():
    steps = two_rank_steps()
    honest = invariants.step_traffic(tiny_gpt, steps)
    chatty = invariants.step_traffic(ChattyGPT, steps, bypass_no_sync=True)
    for rank in (0, 1):
        grad_bytes = honest[rank]["grad_bytes"]
        for step in honest[rank]["steps"]:
            assert step["scalar_collectives"] == invariants.TARGET_SCALAR_COLLECTIVES == 1  # the boundary's only
            assert step["host_reads_by_call"].get("tolist") == 1  # (loss, flags, grad norm), read back together
            assert step["host_reads_in_micro_batches"] == 0
            assert step["grad_allreduce_bytes"] == grad_bytes
        # The counters see each mistake in every micro-batch: one more collective and one host read per
        # forward, and, with no_sync bypassed, a gradient all-reduce after every backward.
        for honest_step, chatty_step in zip(honest[rank]["steps"], chatty[rank]["steps"], strict=True):
            assert chatty_step["scalar_collectives"] == honest_step["scalar_collectives"] + ACCUMULATION
            assert chatty_step["host_reads_in_micro_batches"] == ACCUMULATION
            assert (
                chatty_step["host_reads_by_call"]["item"]
                == honest_step["host_reads_by_call"].get("item", 0) + ACCUMULATION
            )
            assert chatty_step["grad_allreduce_bytes"] == ACCUMULATION * grad_bytes


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_model_inside_ddp_all_reduces_its_gradients_once_per_step():
    """model.compile = true keeps the no_sync semantics: A = 4 micro-batches, one gradient's bytes per step."""
    # Compiling takes about a minute on 2 busy cores; the timeout only guards against a hang.
    traffic = invariants.step_traffic(compiled_tiny_gpt, two_rank_steps(), timeout_s=600.0)
    for rank in (0, 1):
        grad_bytes = traffic[rank]["grad_bytes"]
        assert [step["grad_allreduce_bytes"] for step in traffic[rank]["steps"]] == [grad_bytes, grad_bytes]


def adamw_after_one_step(fused: bool) -> tuple[GPT, torch.optim.AdamW]:
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    return model, optimizer


def test_a_checkpointed_optimizer_state_loads_with_this_runs_flags_on_the_parameters_device(tmp_path):
    """A run saved without fused AdamW (as on a CPU) resumed by an optimizer built fused (as on CUDA): the fused
    flag survives the load, the step counters sit where fused AdamW wants them (float32, on the parameters'
    device: here the CPU, on a GPU the GPU), and the next update equals the one the saved optimizer makes."""
    saved_model, saved_optimizer = adamw_after_one_step(fused=False)
    path = tmp_path / "optimizer.pt"
    torch.save(saved_optimizer.state_dict(), path)

    model = tiny_gpt()
    model.load_state_dict(saved_model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    plain.load_state_dict(torch.load(path, weights_only=True))
    assert plain.param_groups[0]["fused"] is not True  # what load_state_dict alone does: the checkpoint's flag wins

    load_optimizer_state(optimizer, torch.load(path, weights_only=True))
    assert all(group["fused"] is True for group in optimizer.param_groups)
    for parameter, state in optimizer.state.items():
        assert state["step"].dtype == torch.float32 and state["step"].device == parameter.device
        assert state["exp_avg"].device == parameter.device and state["exp_avg"].dtype == parameter.dtype
    for model_, optimizer_ in ((model, optimizer), (saved_model, saved_optimizer)):
        for p in model_.parameters():
            p.grad = torch.full_like(p, -0.02)
        optimizer_.step()
    # fused and foreach AdamW evaluate the same formula with different kernels: equal to fp32 rounding.
    for after, reference in zip(model.parameters(), saved_model.parameters(), strict=True):
        torch.testing.assert_close(after, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("device_name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),  # the more specific name wins
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_the_peak_is_looked_up_by_the_gpus_name(device_name, precision, expected):
    assert measuring.peak_tflops(device_name, precision) == expected


def test_bench_config_measures_any_config_on_the_cpu(tmp_path, capsys):
    """--config runs the config's own model; on a CPU there is no peak unless one is given."""
    (tmp_path / "text.txt").write_bytes(Path(__file__).read_bytes())
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'device = "cpu"\n[data]\nsource = "{tmp_path / "text.txt"}"\nseq_len = 16\nval_fraction = 0.0\n'
        "[model]\nn_layer = 1\nn_head = 2\nd_model = 16\n[batch]\nglobal_batch_size = 4\nmicro_batch_size = 2\n"
    )
    assert bench.main(["--config", str(config), "--quick", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert (results["device"], results["mfu"], results["micro_batch_size"], results["seq_len"]) == ("cpu", None, 2, 16)
    assert results["flops_per_token"] > 6 * 16 * 16  # at least the 6 FLOPs of each weight of one d x d matrix
    # The peer: nanoGPT's loop ran beside ours, both rows reported, the ratio is ours over theirs.
    [comparison] = results["nanogpt"]
    loops = comparison["loops"]
    assert set(loops) == {"optimizer_step", "nanogpt"} and comparison["compiled"] is False  # auto: off on a CPU
    assert comparison["ratio_vs_nanogpt"] == pytest.approx(
        loops["optimizer_step"]["seconds_per_step"] / loops["nanogpt"]["seconds_per_step"]
    )
    assert all(row["peak_mem_bytes"] > 0 for row in loops.values())
    assert bench.main(["--config", str(config), "--quick", "--json", "--peak-tflops", "1"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["mfu"] == pytest.approx(results["positions_per_s"] * results["flops_per_token"] / 1e12)
    assert results["nanogpt"][0]["loops"]["nanogpt"]["mfu"] > 0
    assert bench.main(["--config", str(config), "--quick"]) == 0
    table = capsys.readouterr().out
    assert "eager, nanogpt " in table and "eager, optimizer_step " in table
    assert bench.main(["--config", str(tmp_path / "missing.toml")]) == 2


def peer_gradients(config_arguments: list[str], supervised_positions: list[int]) -> list[list[torch.Tensor]]:
    """The gradient each loop (optimizer_step, nanoGPT's) hands its optimizer in one step of A = 2 micro-batches of
    2 rows; micro-batch k supervises the first supervised_positions[k] targets of each row."""
    tiny = ["device=cpu", "data.seq_len=16", "model.n_layer=1", "model.n_head=2", "model.d_model=16"]
    config = load_config(tiny + config_arguments)
    generator = torch.Generator().manual_seed(0)
    micro_batches = []
    for supervised in supervised_positions:
        inputs = torch.randint(0, BYTE_VOCAB_SIZE, (2, 16), generator=generator)
        labels = torch.randint(0, BYTE_VOCAB_SIZE, (2, 16), generator=generator)
        labels[:, supervised:] = IGNORE_INDEX
        micro_batches.append(MicroBatch(inputs, labels, num_examples=2))
    counts = measuring.global_counts_of([micro_batches])
    gradients = []
    for build_loop in (nanogpt_peer.project_loop, nanogpt_peer.nanogpt_loop):
        loop = build_loop(config, BYTE_VOCAB_SIZE, torch.device("cpu"), compiled=False)
        captured = capture_gradients(loop.optimizer)
        loop.step(micro_batches, counts)
        gradients.append(captured[0])
    return gradients


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_the_project_and_nanogpt_loops_make_the_same_update_when_every_target_is_supervised(loss):
    """Every micro-batch holds the same number of targets, so nanoGPT's mean per micro-batch divided by A is the
    token mean, and both loops hand the optimizer the same clipped gradient. They add the same fp32 terms in
    another order (sums, then means, versus one global division): 1e-5 of the largest entry bounds that."""
    ours, theirs = peer_gradients([f"model.loss={loss}"], supervised_positions=[16, 16])
    assert max_relative_error(ours, theirs) < 1e-5


def test_with_uneven_targets_nanogpts_loop_weights_tokens_differently():
    """The contrast that makes the test above able to fail: 16 and 2 targets per row, and nanoGPT's mean of means
    gives each of the 2 eight times the weight of each of the 16."""
    ours, theirs = peer_gradients(["model.loss=plain"], supervised_positions=[16, 2])
    assert max_relative_error(ours, theirs) > 1e-2


def test_a_step_holds_no_more_memory_than_nanogpts_loop():
    """The issue's memory target, on the CPU: the peak of one optimizer_step is that of nanoGPT's loop on the same
    micro-batches. Here the logits are the largest activations (vocabulary 256, d_model 16), so a step
    that kept them through the backward (as a name bound to the outputs did) would exceed it by their size."""
    tiny = ["device=cpu", "data.seq_len=16", "model.n_layer=1", "model.n_head=2", "model.d_model=16"]
    config = load_config([*tiny, "model.loss=plain"])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 8, 17), generator=generator)
    micro_batches = [MicroBatch(rows[:, :-1], rows[:, 1:], num_examples=8) for rows in tokens]
    counts = measuring.global_counts_of([micro_batches])
    peaks = {}
    for build_loop in (nanogpt_peer.project_loop, nanogpt_peer.nanogpt_loop):
        loop = build_loop(config, BYTE_VOCAB_SIZE, CPU, compiled=False)
        loop.step(micro_batches, counts)  # the optimizer's state, so both measure one step above it
        _, peaks[loop.name] = peak_memory_bytes_of(functools.partial(loop.step, micro_batches, counts), CPU)
    # 1 KiB for the step's own scalars (the float64 loss sum, the flags read back at the boundary: tens of bytes),
    # far below the 128 KiB of logits (8 rows x 16 positions x 256 x 4 bytes) a step keeping them would add.
    assert peaks["optimizer_step"] <= peaks["nanogpt"] + 1024, peaks
