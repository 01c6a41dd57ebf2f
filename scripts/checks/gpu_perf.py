"""gpu_check.py --perf: this project's optimizer_step against nanoGPT's loop, the speed table (scripts/checks/
gpu_check.py's docstring says what it measures), and the text both the table and the checks run on: the package's
own source files, so nothing is downloaded.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import accumulation

REPOSITORY = Path(__file__).resolve().parents[2]


def text_folder(scratch: Path) -> Path:
    folder = scratch / "text"
    folder.mkdir()
    for path in Path(accumulation.__file__).parent.glob("*.py"):
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


# --perf: the shape, m = 16 and A = 4 on one GPU, measured by scripts/benchmarks/bench.py --config in a
# process of its own per mode (as mfu_gpt2_small runs it), so that a mode that hangs or compiles for too long loses
# its own row only.
PERF_OVERRIDES = ["batch.micro_batch_size=16", "batch.global_batch_size=64"]
PERF_ACCUMULATION = 4
# The modes, in the order they run: the loss (model.loss) and whether both loops are compiled (model.compile).
# At V = 50,304 the chunked loss runs its multi-chunk path: 16 x 1024 positions in chunks of 1,334.
PERF_MODES = {
    "eager-plain": ["model.compile=false", "model.loss=plain"],
    "eager-chunked": ["model.compile=false", "model.loss=chunked"],
    "compiled-plain": ["model.compile=true", "model.loss=plain"],
    "compiled-chunked": ["model.compile=true", "model.loss=chunked"],
}
# Seconds per mode: an eager mode is 13 timed-and-warm-up steps of each loop; a compiled one first compiles both
# loops, minutes with a cold Inductor cache (the modes share one cache, so the second compiled mode reuses
# nanoGPT's graphs). 2 + 2 + 5 + 5 minutes at most, within the 15 minutes a GPU session is lent.
PERF_TIMEOUT_S = {"eager": 120, "compiled": 300}
# --perf-toy-cpu (hidden; tests/test_cuda.py runs it): the same script on the CPU at a toy size, to test the script.
TOY_CPU_OVERRIDES = [
    "device=cpu",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "model.vocab_size=512",
    "data.seq_len=32",
    "batch.micro_batch_size=2",
    "batch.global_batch_size=8",
    "precision.dtype=fp32",
]


def perf_command(text_source: Path, overrides: list[str], quick: bool = False) -> list[str]:
    """bench.py --config configs/gpu_8x.toml at the perf shape on `text_source` (packed byte rows: every target
    supervised, so nanoGPT's mean per micro-batch weights tokens as ours does); the mode's and the user's
    overrides last (they win). `quick`: bench.py's --quick (fewer steps)."""
    return [
        sys.executable,
        str(REPOSITORY / "scripts" / "benchmarks" / "bench.py"),
        "--config",
        str(REPOSITORY / "configs" / "gpu_8x.toml"),
        "--accumulation-steps",
        str(PERF_ACCUMULATION),
        "--json",
        *(["--quick"] if quick else []),
        f"data.source={text_source}",
        *PERF_OVERRIDES,
        *overrides,
    ]


def perf_row(mode: str, command: list[str], timeout_s: float, cwd: Path, environment: dict) -> dict:
    """One mode's bench.py run: its row of the table, or why there is none (a timeout, a failure)."""
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=environment)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout_s:g} s", "seconds": time.perf_counter() - started}
    if completed.returncode != 0:
        error = f"bench.py failed (exit {completed.returncode}): {last_line(completed.stderr)}"
        return {"mode": mode, "error": error, "seconds": time.perf_counter() - started}
    results = json.loads(completed.stdout)
    [comparison] = results["nanogpt"]
    return {
        "mode": mode,
        "seconds": time.perf_counter() - started,
        "ratio": comparison["ratio_vs_nanogpt"],
        "ours": comparison["loops"]["optimizer_step"],
        "nanogpt": comparison["loops"]["nanogpt"],
    }


def perf_line(row: dict) -> str:
    mode = f"{row['mode']:<18}"
    if "error" in row:
        return f"{mode}{row['error']} ({row['seconds']:.0f} s)"

    def mfu(loop: dict) -> str:
        return "n/a" if loop["mfu"] is None else f"{loop['mfu']:.3f}"

    ours, nanogpt = row["ours"], row["nanogpt"]
    speed = f"{ours['seconds_per_step']:>10.4f}{nanogpt['seconds_per_step']:>10.4f}{row['ratio']:>8.3f}"
    memory = f"{ours['peak_mem_bytes'] / 2**20:>10.1f}{nanogpt['peak_mem_bytes'] / 2**20:>10.1f}"
    return f"{mode}{speed}{mfu(ours):>8}{mfu(nanogpt):>8}{memory}{row['seconds']:>8.0f}"


PERF_HEADER = "".join(
    f"{title:{'<' if index == 0 else '>'}{width}}"
    for index, (title, width) in enumerate(
        [("mode", 18), ("s/step", 10), ("nanoGPT", 10), ("ratio", 8), ("MFU", 8), ("nanoGPT", 8)]
        + [("MiB", 10), ("nanoGPT", 10), ("took s", 8)]
    )
)


def run_perf(overrides: list[str], modes: list[str], timeout_s: float | None, toy_cpu: bool) -> int:
    """The speed table, one row per mode as it completes (printed at once, so no row is lost to a later hang);
    a mode that times out or fails gets a line saying so and the others still run. Exit 1 if any mode has no row."""
    if not torch.cuda.is_available() and not toy_cpu:
        print(
            "gpu_check --perf: no CUDA GPU on this machine; nothing measured (run it where torch.cuda.is_available())"
        )
        return 0
    started = time.perf_counter()
    shape = "a toy model, m = 2" if toy_cpu else "configs/gpu_8x.toml's model, V = 50,304, m = 16"
    where = "the CPU" if toy_cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check --perf on {where}: optimizer_step against nanoGPT's loop, {shape}, A = {PERF_ACCUMULATION}")
    print(PERF_HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        text_source = text_folder(Path(scratch))
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch, "inductor"))}
        for mode in modes:
            mode_overrides = [*PERF_MODES[mode], *(TOY_CPU_OVERRIDES if toy_cpu else []), *overrides]
            command = perf_command(text_source, mode_overrides, quick=toy_cpu)
            limit = timeout_s if timeout_s is not None else PERF_TIMEOUT_S[mode.split("-")[0]]
            rows.append(perf_row(mode, command, limit, Path(scratch), environment))
            print(perf_line(rows[-1]), flush=True)
    print("s/step: median seconds per step (the two loops take turns); ratio: ours / nanoGPT's; MFU against the")
    print("GPU's dense bf16 peak; MiB: peak memory of one step above what lies allocated between steps")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if all("error" not in row for row in rows) else 1


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""
