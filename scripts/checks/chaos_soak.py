"""Chaos soak: a 2-rank run under `torchrun --max-restarts`, interrupted again and again by random faults,
must end with the bits of the same run left alone.

    python scripts/checks/chaos_soak.py [--steps 300] [--faults 12] [--seed 0] [--json] [--keep DIR]

Faults, at random moments of the run (each only after the run has made progress since the last one):
    kill9-rank    SIGKILL of a random rank; torchrun's agent restarts both ranks (--max-restarts)
    sigterm-agent SIGTERM to torchrun's agent, as a scheduler's preemption sends it: the ranks finish their
                  step, checkpoint and exit 143, the agent exits; the soak launches torchrun again, as a
                  requeued job would
    kill-in-save  SIGKILL of rank 0 while it saves a checkpoint: the temporary file is complete and the
                  rename that publishes it has not happened (planned at random checkpoint steps through
                  tests/faulty_train.py, the program every attempt runs, because a save takes milliseconds)
At the end: the final weights, the counters and every metrics line (timings aside) against an uninterrupted
run of the same config, bit for bit, and the TensorBoard files against metrics.jsonl. Printed: the faults,
the steps that had to be run again, the wall time lost to the faults, and PASS or FAIL (exit 1).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TIMING_KEYS = {"tokens_per_s", "peak_mem_bytes", "time_s"}  # measured, so never bit-identical between runs


def settings(out_dir: Path, corpus: Path, steps: int) -> list[str]:
    """A small model that still exercises everything a resume must restore: dropout (per-rank random
    streams), AdamW's moments, the cosine schedule, validation, 3 kept checkpoints."""
    values = {
        "run.out_dir": out_dir,
        "run.max_steps": steps,
        "run.checkpoint_every": 10,
        "run.keep_checkpoints": 3,
        "run.eval_every": 20,
        "run.log_every": 50,
        "run.sample_bytes": 0,
        "data.source": corpus,
        "data.seq_len": 16,
        "data.val_fraction": 0.1,
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 16,
        "model.dropout": 0.1,
        "batch.global_batch_size": 8,
        "batch.micro_batch_size": 2,
        "schedule.warmup_updates": 5,
        "dist.timeout_s": 30,
    }
    return [f"{key}={value}" for key, value in values.items()]


def write_corpus(folder: Path) -> Path:
    """Documents from 3 bytes to several rows long (uneven token counts per row, micro-batch and rank)."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for index, length in enumerate([3, 5, 9, 17, 40, 70, 150, 300, 700, 1500, 2500, 4000]):
        (folder / f"doc{index:02d}.txt").write_bytes(
            bytes(torch.randint(97, 123, (length,), generator=generator).tolist())
        )
    return folder


def launch(arguments: list[str], environment: dict, log) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=100",
    ]
    return subprocess.Popen(
        command + ["-m", "tests.faulty_train", *arguments],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environment,
        cwd=REPO,
    )


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers are its agent's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def last_step(metrics_path: Path) -> int:
    try:
        lines = [line for line in metrics_path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["steps"] if lines else 0


def run_dir_summary(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    latest = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return latest["model"], latest["counters"], [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics]


def soak(steps: int, faults: int, seed: int, work: Path, say=print) -> dict:
    """The uninterrupted run, the same run under faults, and the report comparing their run directories."""
    rng = random.Random(seed)
    corpus = write_corpus(work / "corpus")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    environment.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    reference_s = run_uninterrupted(steps, corpus, work, environment, say)
    injected, launches, chaos_s = run_under_faults(steps, faults, rng, corpus, work, environment)
    return compare_with_reference(steps, faults, work, injected, launches, reference_s, chaos_s)


def run_uninterrupted(steps: int, corpus: Path, work: Path, environment: dict, say) -> float:
    """The reference: the run with no fault, in work/reference. Returns its seconds."""
    started = time.monotonic()
    with open(work / "reference.log", "w") as log:
        status = launch(
            settings(work / "reference", corpus, steps), {**environment, "ACCUMULATION_FAULTS": "[]"}, log
        ).wait()
    reference_s = time.monotonic() - started
    if status != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {status}); see {work / 'reference.log'}")
    say(f"uninterrupted run: {steps} steps in {reference_s:.1f} s")
    return reference_s


def run_under_faults(
    steps: int, faults: int, rng: random.Random, corpus: Path, work: Path, environment: dict
) -> tuple[list[dict], int, float]:
    """The same run in work/chaos, under torchrun, with `faults` faults injected; a job whose agent was sent
    SIGTERM is launched again, as a requeue. Returns (the faults injected, torchrun launches, seconds)."""
    # The faults: about a quarter are kills during a save, planned at random checkpoint steps; the rest are
    # drawn at random moments from the other two kinds.
    checkpoint_steps = list(range(10, steps, 10))
    in_save = sorted(rng.sample(checkpoint_steps, max(1, faults // 4)))
    planned = [{"attempt": "any", "rank": 0, "kill_before_rename": step} for step in in_save]
    timed_kinds = [rng.choice(["kill9-rank", "sigterm-agent"]) for _ in range(faults - len(in_save))]
    chaos = work / "chaos"
    arguments = settings(chaos, corpus, steps)
    metrics_path = chaos / "default" / "metrics.jsonl"
    environment.update(
        ACCUMULATION_FAULTS=json.dumps(planned),
        ACCUMULATION_FAULT_LOG=str(work / "faults.jsonl"),
        ACCUMULATION_STEP_LOG=str(work / "steps.log"),  # rank 0 appends each step it completes
    )
    # Spread the timed faults over the run: each strikes once `spacing` more steps have run since the
    # previous fault (in any attempt), plus a random fraction of a second.
    spacing = max(1, steps // (len(timed_kinds) + 2))
    step_log = work / "steps.log"
    injected, launches = [], 0
    started = time.monotonic()
    with open(work / "chaos.log", "w") as log:
        job = launch(arguments, environment, log)
        launches += 1
        mark = 0
        while True:
            status = job.poll()
            if status is not None:
                if status == 0:
                    break
                # The agent exited: after its own SIGTERM (exit 1), the job is launched again, as a requeue.
                if not injected or injected[-1]["kind"] != "sigterm-agent" or injected[-1].get("relaunched"):
                    raise SystemExit(f"torchrun failed unexpectedly (exit {status}); see {work / 'chaos.log'}")
                injected[-1]["relaunched"] = True
                job = launch(arguments, environment, log)
                launches += 1
                continue
            progress = len(step_log.read_text().split()) if step_log.exists() else 0  # steps run, all attempts
            if timed_kinds and progress >= mark + spacing and last_step(metrics_path) < steps - 5:
                time.sleep(rng.uniform(0.0, 0.5))
                kind = timed_kinds.pop(0)
                at_step = last_step(metrics_path)
                workers = children(job.pid)
                if kind == "kill9-rank" and workers:
                    os.kill(rng.choice(workers), signal.SIGKILL)
                elif kind == "sigterm-agent":
                    job.send_signal(signal.SIGTERM)
                else:
                    timed_kinds.insert(0, kind)  # the agent is between attempts: try again shortly
                    continue
                injected.append({"kind": kind, "after_step": at_step, "at_s": round(time.monotonic() - started, 2)})
                mark = progress
            time.sleep(0.05)
    chaos_s = time.monotonic() - started
    return injected, launches, chaos_s


def compare_with_reference(
    steps: int, faults: int, work: Path, injected: list[dict], launches: int, reference_s: float, chaos_s: float
) -> dict:
    """The report: the faults, the time lost, and whether the run under faults ended exactly as the reference."""
    step_log = work / "steps.log"
    chaos = work / "chaos"
    fired_in_save = [json.loads(line) for line in (work / "faults.jsonl").read_text().splitlines()]
    for entry in fired_in_save:
        injected.append({"kind": "kill-in-save", "after_step": entry["kill_before_rename"], "at_s": None})
    executed = step_log.read_text().split()
    weights, counters, metrics = run_dir_summary(chaos / "default")
    expected_weights, expected_counters, expected_metrics = run_dir_summary(work / "reference" / "default")
    same_weights = weights.keys() == expected_weights.keys() and all(
        torch.equal(weights[key], expected_weights[key]) for key in expected_weights
    )
    sys.path.insert(0, str(REPO))
    import logging

    from tests.test_logs import assert_tensorboard_matches_metrics

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # its notes on the purged points of each resume

    try:
        assert_tensorboard_matches_metrics(chaos / "default")
        tensorboard_ok = True
    except AssertionError:
        tensorboard_ok = False
    leftovers = [p.name for p in (chaos / "default" / "checkpoints").iterdir() if p.name.startswith(".")]
    report = {
        "steps": steps,
        "faults_injected": len(injected),
        "faults": injected,
        "torchrun_launches": launches,
        "resumes": (work / "chaos.log").read_text().count("resuming from"),  # by the agent or after a launch
        "steps_run": len(executed),
        "steps_redone": len(executed) - steps,
        "uninterrupted_s": round(reference_s, 1),
        "chaos_s": round(chaos_s, 1),
        "time_lost_s": round(chaos_s - reference_s, 1),
        "same_weights": same_weights,
        "same_counters": counters == expected_counters,
        "same_metrics": metrics == expected_metrics,
        "tensorboard_equals_metrics": tensorboard_ok,
        "no_temporary_files": not leftovers,
    }
    checks = ("same_weights", "same_counters", "same_metrics", "tensorboard_equals_metrics", "no_temporary_files")
    report["pass"] = all(report[name] for name in checks) and len(injected) >= faults
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the run")
    parser.add_argument("--faults", type=int, default=12, help="faults to inject (at least 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", type=Path, help="work in this (new) folder and keep it, instead of a temporary one")
    args = parser.parse_args()
    if args.faults < 3 or args.steps < 10 * (args.faults + 2):
        parser.error("--faults must be at least 3 and --steps at least 10 x (faults + 2)")
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        report = soak(args.steps, args.faults, args.seed, work, say=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for fault in report["faults"]:
            print(f"  {fault['kind']:<14} after step {fault['after_step']}")
        for key, value in report.items():
            if key != "faults":
                print(f"{key:<28} {value}")
        print("PASS" if report["pass"] else "FAIL")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
