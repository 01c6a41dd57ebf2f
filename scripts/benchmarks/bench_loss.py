"""Benchmark: the output head and cross-entropy of one micro-batch, three ways, in time and peak memory.

    python scripts/benchmarks/bench_loss.py                  # a table, about a minute on a quiet 2-core CPU
    python scripts/benchmarks/bench_loss.py --positions 4096 --d-model 768 --vocab 50304 --repeats 5  # GPT-2's head

The forward and backward of S = Σ cross_entropy(H Wᵀ, y) over P positions (hidden states H [P, d], output weight
W [V, d]), with H and W requiring gradients, as they do in training:

    plain       logits = H Wᵀ, then the token cross-entropy (accumulation.step.token_cross_entropy_sum)
    chunked     model.loss = "chunked": chunk by chunk, each chunk's ∂S/∂H and ∂S/∂W computed in the forward
                (accumulation/chunked_loss.py), nothing recomputed
    recompute   the alternative: chunk by chunk under activation checkpointing, so the backward computes each
                chunk's logits a second time (one more P x d x V product: about a third more head FLOPs)

Timings are medians over --repeats, the three taking turns; peak memory is measured as
scripts/benchmarks/bench.py measures it (testkit/memory.py: the CUDA allocator's peak, or on the CPU the
profiler's allocations), above what was allocated before. On a GPU pass --device cuda (bf16 autocast there with
--bf16).
"""

import argparse
import functools
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

from accumulation.chunked_loss import ChunkedCrossEntropySum, positions_per_chunk
from accumulation.step import token_cross_entropy_sum
from testkit.memory import peak_memory_bytes_of


def plain(hidden, head, labels, chunk_positions):
    return token_cross_entropy_sum(head(hidden), labels)


def chunked(hidden, head, labels, chunk_positions):
    return ChunkedCrossEntropySum(head, chunk_positions)(hidden, labels)


def recompute(hidden, head, labels, chunk_positions):
    """Each chunk's logits and loss under torch.utils.checkpoint: kept for the backward are H and y only."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_positions):
        chunk = slice(start, start + chunk_positions)
        total = total + checkpoint(
            lambda h, y: token_cross_entropy_sum(head(h), y), hidden[chunk], labels[chunk], use_reentrant=False
        )
    return total


VARIANTS = {"plain": plain, "chunked": chunked, "recompute": recompute}


def forward_and_backward(variant, hidden, head, labels, chunk_positions, autocast_dtype, device) -> None:
    hidden.grad, head.weight.grad = None, None
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss_sum = variant(hidden, head, labels, chunk_positions)
    loss_sum.backward()
    hidden.grad, head.weight.grad = None, None  # freed inside the measured region, as the step's zero_grad does


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=2048, help="P, positions of one micro-batch (rows x seq_len)")
    parser.add_argument("--d-model", type=int, default=256, help="d, width of the hidden states")
    parser.add_argument("--vocab", type=int, default=8192, help="V, the vocabulary")
    parser.add_argument("--chunk", type=int, default=0, help="positions per chunk (default: the project's choice)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions of each variant")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as configs/gpu_8x.toml trains")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    autocast_dtype = torch.bfloat16 if args.bf16 else None
    chunk_positions = args.chunk or positions_per_chunk(args.vocab)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.positions, args.d_model, generator=generator).to(device).requires_grad_()
    head = torch.nn.Linear(args.d_model, args.vocab, bias=False).to(device)
    labels = torch.randint(0, args.vocab, (args.positions,), generator=generator).to(device)
    runs = {
        name: functools.partial(forward_and_backward, variant, hidden, head, labels, chunk_positions, autocast_dtype)
        for name, variant in VARIANTS.items()
    }
    for run in runs.values():  # warm-up: allocator, kernels
        run(device)
    seconds = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
            seconds[name].append(timed(functools.partial(runs[name], device), device))
    peak_bytes = {name: peak_memory_bytes_of(functools.partial(run, device), device)[1] for name, run in runs.items()}
    logits_bytes = args.positions * args.vocab * 4
    print(
        f"P = {args.positions} positions, d = {args.d_model}, V = {args.vocab}, chunks of {chunk_positions} positions, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; fp32 logits of all positions: {logits_bytes / 2**20:.1f} MiB"
    )
    print(f"{'variant':<12}{'seconds':>10}{'vs plain':>10}{'peak MiB':>12}{'vs plain':>10}")
    for name in runs:
        median = statistics.median(seconds[name])
        print(
            f"{name:<12}{median:>10.4f}{median / statistics.median(seconds['plain']):>10.3f}"
            f"{peak_bytes[name] / 2**20:>12.1f}{peak_bytes[name] / peak_bytes['plain']:>10.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
