"""The data path at scale: how fast one core feeds micro-batches from a memory-mapped token file of at least
1 GB, against what one rank of an 8-GPU node consumes for GPT-2-small, and whether a run's peak memory
grows with the file.

    python scripts/benchmarks/bench_data.py [--gigabytes 1.0] [--seconds 10]

It writes, under a temporary folder of /tmp (deleted at the end), a nanoGPT folder whose train.bin holds
--gigabytes GB of random uint16 tokens below 50,257, and a 10 MB one, then prints:

1. Feeding speed: the micro-batches of rank 0 of 8 (configs/gpu_8x.toml's shape: G = 512, m = 32, A = 2,
   seq_len 1024), step after step, one thread, as train.py builds them (step_row_ids, build_micro_batches),
   in micro-batches/s and tokens/s. The file was just written, so its pages are likely in the page cache:
   this is the loader's own cost, not the disk's (a cold disk adds its random-read time).
2. Consumption of one rank, estimated: FLOPs per trained token of GPT-2-small (12 layers, d_model 768,
   seq_len 1024) as 6·N for the weights plus 12·n_layer·d_model·seq_len for attention (the PaLM paper's
   accounting), with N = 124M, the weights that multiply: 12 blocks of 7.1M and the lm_head's 38.6M (an
   embedding lookup costs no FLOPs, so configs/gpu_8x.toml's model, 163M parameters with an untied
   embedding, costs the same). At an assumed 50 % MFU of an H100 SXM's 989 TFLOP/s dense bf16 peak; more
   than 50 % is rare at this model size, so this is an upper bound on what a rank consumes.
3. Peak resident memory (VmHWM, Linux) of a short train.py run on each file; the target is that the 1 GB
   file costs at most 200 MB more than the 10 MB one.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_batch

REPO = Path(__file__).resolve().parents[2]
GPT2_VOCAB = 50_257
GPT2_PARAMETERS = 124_000_000
GPT2_LAYERS, GPT2_WIDTH, SEQ_LEN = 12, 768, 1024
H100_BF16_PEAK_FLOPS = 989e12
ASSUMED_MFU = 0.5
GLOBAL_BATCH, MICRO_BATCH, RANKS = 512, 32, 8
CHUNK_TOKENS = 32 * 2**20  # tokens written at a time: 64 MB of uint16


def write_nanogpt_folder(folder: Path, train_bytes: int, seed: int) -> None:
    """train.bin of train_bytes (rounded down to whole tokens), val.bin of 1 MB, meta.json."""
    folder.mkdir(parents=True)
    generator = np.random.default_rng(seed)
    tokens_left = train_bytes // 2
    with open(folder / "train.bin", "wb") as file:
        while tokens_left:
            chunk = min(CHUNK_TOKENS, tokens_left)
            file.write(generator.integers(0, GPT2_VOCAB, chunk, dtype=np.uint16).tobytes())
            tokens_left -= chunk
    (folder / "val.bin").write_bytes(generator.integers(0, GPT2_VOCAB, 2**19, dtype=np.uint16).tobytes())
    (folder / "meta.json").write_text(json.dumps({"vocab_size": GPT2_VOCAB}))


def feeding_speed(folder: Path, seconds: float) -> tuple[float, float, float]:
    """(micro-batches/s, tokens/s, start-up s) of rank 0 of RANKS building its micro-batches, one thread."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    config = load_config([f"data.source={folder}", f"data.seq_len={SEQ_LEN}", "model.vocab_size=50304"])
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    startup_s = time.perf_counter() - start
    micro_batches = tokens = step = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = step_batch(
            data.train,
            step,
            seed=config.run.seed,
            global_batch_size=GLOBAL_BATCH,
            tail="drop",
            micro_batch_size=MICRO_BATCH,
            world_size=RANKS,
            rank=0,
        )
        for micro_batch in batch.micro_batches:
            micro_batches += 1
            tokens += micro_batch.inputs.numel()
        step += 1
    elapsed = time.perf_counter() - start
    return micro_batches / elapsed, tokens / elapsed, startup_s


def one_rank_consumption() -> tuple[float, float]:
    """(FLOPs per token, tokens/s) of one GPU training GPT-2-small, as the module docstring derives them."""
    flops_per_token = 6 * GPT2_PARAMETERS + 12 * GPT2_LAYERS * GPT2_WIDTH * SEQ_LEN
    return flops_per_token, ASSUMED_MFU * H100_BF16_PEAK_FLOPS / flops_per_token


def peak_rss_of_a_short_run(folder: Path, runs: Path) -> int:
    """Peak resident bytes of a 4-step train.py run with a validation pass, on one process: a small model
    and batch (the vocabulary must hold GPT-2's ids), so that what could grow is the data's share."""
    arguments = [
        f"data.source={folder}",
        f"run.out_dir={runs}",
        f"run.name={folder.name}",
        "run.max_steps=4",
        "run.eval_every=4",
        "run.log_every=4",
        "run.sample_bytes=0",
        "data.seq_len=64",
        "data.val_rows=8",
        "model.vocab_size=50304",
        "model.n_layer=1",
        "model.d_model=64",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "device=cpu",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # The child's own peak: VmHWM of /proc/<pid>/status, polled while it runs (it only grows, so the last
    # reading is the peak, give or take the last 20 ms). Not metrics.jsonl's peak_mem_bytes: getrusage's
    # maxrss survives exec, so a child launched from this large process would report this process's peak.
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *arguments],
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env=environment,
        )
        peak_kb = 0
        while child.poll() is None:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError):  # the child is starting or has just ended
                pass
            time.sleep(0.02)
        if child.returncode != 0:
            errors.seek(0)
            raise RuntimeError(errors.read().decode())
    return peak_kb * 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="size of the large train.bin (GB, 10**9 bytes)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to measure the feeding speed")
    arguments = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-data-", dir="/tmp"))
    try:
        large, small = root / "large", root / "small"
        start = time.perf_counter()
        write_nanogpt_folder(large, int(arguments.gigabytes * 1e9), seed=1)
        write_nanogpt_folder(small, 10_000_000, seed=2)
        print(
            f"wrote {large / 'train.bin'} ({(large / 'train.bin').stat().st_size / 1e9:.2f} GB) and a 10 MB one "
            f"in {time.perf_counter() - start:.0f} s"
        )

        micro_batches_per_s, tokens_per_s, startup_s = feeding_speed(large, arguments.seconds)
        flops_per_token, consumed_per_s = one_rank_consumption()
        print(
            f"feeding, one thread, rank 0 of {RANKS} (G {GLOBAL_BATCH}, m {MICRO_BATCH}, seq_len {SEQ_LEN}): "
            f"{micro_batches_per_s:,.1f} micro-batches/s = {tokens_per_s / 1e6:,.2f} M tokens/s; "
            f"build_data on the {arguments.gigabytes:g} GB file took {startup_s:.2f} s"
        )
        print(
            f"one rank's consumption, estimated: GPT-2-small at {flops_per_token / 1e9:.2f} GFLOP per token "
            f"(6 x 124M + 12 x {GPT2_LAYERS} x {GPT2_WIDTH} x {SEQ_LEN}), {ASSUMED_MFU:.0%} MFU of "
            f"{H100_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s (H100 SXM bf16): {consumed_per_s / 1e6:.2f} M tokens/s"
        )
        ratio = tokens_per_s / consumed_per_s
        print(f"ratio feeding / consumption: {ratio:.1f}x (target >= 10x): {'PASS' if ratio >= 10 else 'FAIL'}")

        runs = root / "runs"
        rss_large = peak_rss_of_a_short_run(large, runs)
        rss_small = peak_rss_of_a_short_run(small, runs)
        growth_mb = (rss_large - rss_small) / 1e6
        print(
            f"peak RSS of a 4-step run: {rss_large / 1e6:,.0f} MB on the {arguments.gigabytes:g} GB file, "
            f"{rss_small / 1e6:,.0f} MB on the 10 MB one: {growth_mb:+,.0f} MB (target <= +200 MB): "
            f"{'PASS' if growth_mb <= 200 else 'FAIL'}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
