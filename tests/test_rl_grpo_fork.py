"""The GRPO fork (scripts/rl/grpo.py), run in-process at a toy size: bad sizes and keys are one line and exit 2 with
nothing written, a round logs RL's units, and a run stopped after a round and continued is the uninterrupted run
bit for bit."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testkit.ranks import pretend_launched, run_on_ranks

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rl" / "grpo.py"
TOY = [
    "task.max_operand=8",
    "task.held_out=8",
    "sft.steps=4",
    "sft.global_batch_size=8",
    "sft.micro_batch_size=4",
    "rl.batch_size=2",
    "rl.group_size=4",
    "rl.micro_batch_size=2",
    "rl.mini_batch_size=4",
    "model.n_layer=1",
    "model.d_model=16",
    "model.n_head=2",
]


def grpo():
    spec = importlib.util.spec_from_file_location("grpo_fork", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digit_count_reward(prompt: str, completion: str) -> float:
    """A dense reward for the toy runs, whose policy after 4 SFT steps is rarely right: completions of one prompt
    differ in it, so the advantages, the gradients and the updates are not zero, and a resume has work to redo."""
    return sum(character.isdigit() for character in completion) / 6


def run(tmp_path, name, *overrides) -> int:
    fork = grpo()
    fork.reward = digit_count_reward
    return fork.main(
        ["--config", "scripts/rl/grpo.toml", f'run.out_dir="{tmp_path}"', f'run.name="{name}"', *TOY, *overrides]
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rl.batch_size=2", "rl.group_size=5", "rl.micro_batch_size=1", "rl.mini_batch_size=3"],
            "10 trajectories do not divide into mini-batches of 3",
        ),
        (['rl.loss_aggregation="mean"'], "rl.loss_aggregation must be one of"),
        (["rl.clip=0.3"], "unknown key rl.clip"),
        (["rl.group_size=2.5"], "rl.group_size must be an integer"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.chdir(SCRIPT.parent.parent.parent)
    assert run(tmp_path, "bad", *overrides) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_worked_example_on_two_ranks_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(SCRIPT.parent.parent.parent)
    pretend_launched(monkeypatch, world_size=2)
    sizes = ["rl.batch_size=2", "rl.group_size=5", "rl.micro_batch_size=1", "rl.mini_batch_size=3"]
    assert run(tmp_path, "bad", *sizes) == 2
    assert capsys.readouterr().err == "error: 5 trajectories do not divide into mini-batches of 3\n"
    assert list(tmp_path.iterdir()) == []


def test_a_round_logs_rl_units_and_a_continued_run_is_the_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.chdir(SCRIPT.parent.parent.parent)
    assert run(tmp_path, "whole", "run.rounds=2", "run.eval_every=2") == 0
    assert run(tmp_path, "halves", "run.rounds=1", "run.eval_every=2") == 0
    assert run(tmp_path, "halves", "run.rounds=2", "run.eval_every=2") == 0  # resumes after round 1

    whole = torch.load(tmp_path / "whole" / "checkpoints" / "latest.pt", weights_only=True)
    halves = torch.load(tmp_path / "halves" / "checkpoints" / "latest.pt", weights_only=True)
    supervised = torch.load(tmp_path / "whole" / "sft.pt", weights_only=True)
    assert any(not torch.equal(tensor, supervised[name]) for name, tensor in whole["model"].items())  # GRPO moved it
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, halves["model"][name]), name
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (tmp_path / "halves" / "metrics.jsonl").read_text().splitlines()]
    assert len(resumed) == 2
    for line, other in zip(lines, resumed, strict=True):
        assert {k: v for k, v in line.items() if k != "time_s"} == {k: v for k, v in other.items() if k != "time_s"}
    last = lines[-1]
    # 2 prompts x 4 completions per round; 8 trajectories / (mini-batch 4 x 1 rank) = 2 optimizer steps per round
    assert (last["rounds"], last["trajectories"], last["optimizer_steps"], last["optimizer_steps_this_round"]) == (
        2,
        16,
        4,
        2,
    )
    assert 0 < last["completion_tokens"] <= 16 * 6  # at most max_new_tokens per completion
    assert "tokens" not in last  # completions are never called tokens
    for key in ("mean_reward", "clip_fraction", "held_out_reward"):
        assert 0.0 <= last[key] <= 1.0, key
    assert last["approx_kl"] > 0  # the policy moved away from the one that sampled
    before = json.loads((tmp_path / "whole" / "sft.json").read_text())
    assert before["sft_steps"] == 4 and 0.0 <= before["held_out_reward"] <= 1.0


def run_on_this_rank(rank: int, ranks: int, tmp_path, runs: list[tuple[str, int]]) -> dict:
    for name, rounds in runs:
        assert run(tmp_path, name, f"run.rounds={rounds}", "run.eval_every=2") == 0
        dist.barrier()  # rank 0 wrote the round's checkpoint: the next run reads it
    return {}


def test_two_ranks_continued_run_is_the_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.chdir(SCRIPT.parent.parent.parent)
    run_on_ranks(run_on_this_rank, 2, (tmp_path, [("whole", 2), ("halves", 1), ("halves", 2)]), timeout_s=300)
    whole = torch.load(tmp_path / "whole" / "checkpoints" / "latest.pt", weights_only=True)
    halves = torch.load(tmp_path / "halves" / "checkpoints" / "latest.pt", weights_only=True)
    assert (
        whole["counters"]
        == halves["counters"]
        == {
            "rounds": 2,
            "trajectories": 16,
            "completion_tokens": whole["counters"]["completion_tokens"],
            "optimizer_steps": 2,
        }
    )
    supervised = torch.load(tmp_path / "whole" / "sft.pt", weights_only=True)
    assert any(not torch.equal(tensor, supervised[name]) for name, tensor in whole["model"].items())  # GRPO moved it
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, halves["model"][name]), name


def test_the_forks_objective_check_passes_and_its_wrong_normaliser_fails_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(SCRIPT.parent.parent.parent)
    spec = importlib.util.spec_from_file_location("check_objectives", SCRIPT.with_name("check_objectives.py"))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    settings = ["--config", "scripts/rl/grpo.toml", f'run.out_dir="{tmp_path}"', *TOY]
    assert check.main(settings) == 0
    assert "PASS seq-mean-token-mean" in capsys.readouterr().out
    assert check.main([*settings, "--inject-bug", "wrong-normaliser"]) == 1
    assert "normaliser declared: targets = " in capsys.readouterr().out
