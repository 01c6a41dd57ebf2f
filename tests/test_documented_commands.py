"""Every command README.md and docs/tools.md show runs, in the order a new user meets them (README first), each a
test of its own named after the command: a README command once ended in a KeyError that no test ran into.

The commands are read from the docs' text, never listed here: each line of a ```bash block (split at `&&`) and each
inline `python ...`, `torchrun ...` or `pip ...` span, their optional parts ([...]) left out. So a command added to
the docs is run by the next integration run, and one this file cannot run fails until SHORTER says how. Each runs
in a copy of the repository's tracked files (what it writes stays there), shortened where the documented command
takes minutes (SHORTER, every entry saying why). Integration tier: each is a real process, as a user launches it.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/tools.md"]  # the order a new user reads them in

# The arguments a documented command is shortened with, appended (train.py and argparse take a key's last value), and
# why: each keeps the command's code path (the same script, the same kind of run) and cuts its size or length.
# "{tmp}" is a folder of the test's own.
TINY_RUN = "run.max_steps=3 run.eval_every=2 run.sample_bytes=8 run.out_dir={tmp}/runs"  # 600 steps: ~10 minutes
CHAOS = "--steps 50 --faults 3"  # 300 steps and 12 faults take minutes; its least: 3 faults, 10 x (3 + 2) steps
LOSS_SIZES = "--positions 256 --vocab 512 --repeats 1"  # a CPU times the default sizes 5 times over
SHORTER = {
    "python train.py": TINY_RUN,
    # the whole tiers, from inside one of their own tests: collected instead (every test module is imported)
    "python -m pytest": "--collect-only -q -p no:cacheprovider",
    "python -m pytest -m integration": "--collect-only -q -p no:cacheprovider",
    "torchrun --standalone --nproc_per_node=2 train.py run.name=two_ranks": TINY_RUN,
    "torchrun --standalone --nproc_per_node=4 train.py dist.pipeline_stages=2 run.name=pipeline": TINY_RUN,
    # 300 SFT steps, then GRPO rounds: 2 SFT steps and one round of 16 trajectories
    "python train.py --config configs/grpo.toml": (
        f"{TINY_RUN} batch.global_batch_size=16 batch.micro_batch_size=4 data.mini_batch_size=16 data.sft_steps=2 "
        "data.prompts_per_round=4 data.group_size=4 data.held_out=8"
    ),
    "python scripts/teaching/loss_curves.py": "--steps 4 --seeds 1 --png {tmp}/curves.png",  # 3 x 300 steps x 4
    "python scripts/teaching/cadence.py": "--steps 4 --png {tmp}/cadence.png",  # 120 steps per curve
    "python scripts/teaching/noise_scale.py": "--steps 8 --window 4",  # 300 steps of the default run
    "python scripts/benchmarks/bench.py": "--quick",  # every measurement once
    "python scripts/benchmarks/bench.py --config configs/default.toml": "--quick",
    "python scripts/benchmarks/bench.py --config FILE": "--quick",
    "python scripts/benchmarks/bench_loss.py": LOSS_SIZES,
    "python scripts/benchmarks/bench_loss.py --chunk 256": f"{LOSS_SIZES} --chunk 64",
    "python scripts/benchmarks/bench_data.py": "--gigabytes 0.01 --seconds 1",  # a 1 GB file, 10 s of feeding
    # the default model at every m: a 1-layer one
    "python scripts/benchmarks/sweep_microbatch.py": "model.n_layer=1 model.d_model=32 data.seq_len=32",
    "python scripts/checks/plant_bugs.py": "--only val-loss-one-rank",  # every plant's tests take an hour: one
    "python scripts/checks/chaos_soak.py": CHAOS,
    "python scripts/checks/chaos_soak.py --steps 300 --faults 12 --seed 0": CHAOS,
}

# What a synopsis's placeholders stand for.
PLACEHOLDERS = {
    "FILE": "configs/default.toml",
    "INPUT": "data/sft_arithmetic.jsonl",
    "OUT_DIR": "{tmp}/tokens",
    "RUN_DIR": "{tmp}/runs/default",  # trained first by the test (TINY_RUN), as a new user has trained one
}

# Inline spans that are not commands a user runs: a flag named in prose.
NOT_COMMANDS = {"torchrun --max-restarts"}  # docs/tools.md: chaos_soak.py runs "under `torchrun --max-restarts`"

# The documented exit status where it is not 0: the exercises fail until a reader fixes them (README says so).
EXIT_STATUS = {"python -m pytest scripts/teaching/exercises": 1}

INLINE = re.compile(r"`((?:python|torchrun|pip) [^`]+)`")


def without_optional_parts(command: str) -> str:
    """`python x.py [--json] [--out DIR]` -> `python x.py`: a synopsis's optional parts left out, its `\\|` (a
    table's escaped bar) read as `|`."""
    command = command.replace("\\|", "|")
    while re.search(r"\[[^\[\]]*\]", command):
        command = re.sub(r"\s*\[[^\[\]]*\]", "", command)
    return " ".join(command.split())


def documented_commands() -> list[str]:
    """Every command of DOCS, in order of first appearance."""
    found = []
    for doc in DOCS:
        in_bash = False
        for line in (REPO / doc).read_text().splitlines():
            if line.startswith("```"):
                in_bash = line.strip() == "```bash"
                continue
            if in_bash:
                found += [part.strip() for part in line.split("&&") if part.strip()]
            else:
                found += INLINE.findall(line)
    commands = dict.fromkeys(without_optional_parts(command) for command in found)
    return [command for command in commands if command not in NOT_COMMANDS]


def what_runs(command: str) -> str:
    """The command line a documented command runs as: shortened (SHORTER), its placeholders filled in."""
    return " ".join(PLACEHOLDERS.get(word, word) for word in f"{command} {SHORTER.get(command, '')}".split())


COMMANDS = documented_commands()
# Two documented commands that run as the same command line (bench.py --config FILE, FILE being configs/default.toml)
# run once, under the first one's name.
RUNS = list({what_runs(command): command for command in reversed(COMMANDS)}.values())[::-1]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files, tracked in a repository of its own: what the commands write (runs/,
    figures, data) stays in it."""
    copy = tmp_path_factory.mktemp("checkout")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    # a repository of its own: plant_bugs.py copies the files git tracks
    for git in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *git], cwd=copy, capture_output=True, check=True)
    return copy


def test_the_docs_show_the_commands_a_new_user_starts_with():
    """The parsing itself: README's two commands first, the torchrun launches and --help after, and every entry of
    SHORTER still a documented command (a renamed one would otherwise run unshortened)."""
    assert COMMANDS[:3] == ["pip install -r requirements.txt", "python train.py", "python -m pytest"]
    assert "python train.py --help" in COMMANDS and "python scripts/benchmarks/bench_fsdp.py" in COMMANDS
    assert sorted(set(SHORTER) - set(COMMANDS)) == []
    assert sorted(set(EXIT_STATUS) - set(COMMANDS)) == []
    assert all(command.split()[0] in ("python", "torchrun", "pip") for command in COMMANDS), COMMANDS


@pytest.mark.integration
@pytest.mark.parametrize("command", RUNS)
def test_every_documented_command_runs(command, checkout, tmp_path):
    words = what_runs(command).split()
    program, arguments = words[0], " ".join(words[1:]).format(tmp=tmp_path)
    launcher = {
        "python": sys.executable,
        "torchrun": f"{sys.executable} -m torch.distributed.run",
        # every pin resolved against the installed packages, offline, nothing installed (requirements.txt's
        # `-e .` would install this copy over the project)
        "pip": f"{sys.executable} -m pip --no-input",
    }[program]
    if program == "pip":
        arguments = arguments.replace("install ", "install --dry-run --no-index --no-build-isolation ", 1)
    shell = f"{launcher} {arguments}"
    environment = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    if "RUN_DIR" in command.split():  # sample.py and export.py read a run: train the tiny one RUN_DIR names first
        train = f"{sys.executable} train.py {TINY_RUN.format(tmp=tmp_path)}"
        trained = subprocess.run(train, shell=True, cwd=checkout, env=environment, capture_output=True, text=True)
        assert trained.returncode == 0, f"{train}\n{trained.stderr[-3000:]}"
    completed = subprocess.run(
        shell, shell=True, cwd=checkout, env=environment, capture_output=True, text=True, timeout=600
    )
    expected = EXIT_STATUS.get(command, 0)
    assert completed.returncode == expected, f"{shell}\nexit {completed.returncode}\n{completed.stderr[-3000:]}"
