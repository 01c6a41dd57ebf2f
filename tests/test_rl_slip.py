"""configs/grpo_slip.toml, the GRPO run that learns (docs/rl.md, "A run that learns"): its task file is what
scripts/rl/make_slip_addition.py writes, the reward tells its slipped answers from its clean ones, its sizes are the
ones the docs measured, and it runs through train.py. The run itself (600 SFT steps, 100 rounds) takes minutes, and
a shortened one does not reach the policy the measurement starts from, so the gain is measured in docs/rl.md, not
asserted here."""

import json
import sys
from pathlib import Path

import train
from accumulation.config.config import load_config
from accumulation.rl.task import addition_problems, reward, split_problems
from tests.test_train import read_metrics

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "rl"))
from make_slip_addition import SLIP, slipped_addition  # noqa: E402  (a script, not a package)


def test_the_task_file_is_the_scripts_output_and_the_reward_scores_only_its_clean_answers():
    config = load_config(["--config", str(ROOT / "configs" / "grpo_slip.toml")])
    task = config.data.own
    lines = (ROOT / task.prompts).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows == slipped_addition(task.max_operand, 0.8, 0)
    # The same problems, in the same order, as the arithmetic of configs/grpo.toml: the same 160 held out.
    problems = addition_problems(task.max_operand)
    assert [row["prompt"] for row in rows] == [prompt for prompt, _ in problems]
    held_out = [prompt for prompt, _ in split_problems(task.max_operand, task.held_out)[1]]
    assert [row["prompt"] for row in rows[::10][: task.held_out]] == held_out
    slipped = [row["response"] != clean for row, (_, clean) in zip(rows, problems, strict=True)]
    # 1,600 seeded draws at 0.8: the share is within 3 standard errors (sqrt(0.8 x 0.2 / 1,600) = 0.01) of 0.8.
    assert abs(sum(slipped) / len(rows) - 0.8) < 0.03
    for row, (prompt, clean), slip in zip(rows, problems, slipped, strict=True):
        assert reward(prompt, clean) == 1.0
        assert row["response"] == (clean.removesuffix("\n") + SLIP + "\n" if slip else clean)
        # "Q: 0 + 0 =" is the one problem whose slip (" 0 0") still ends in its sum.
        assert reward(prompt, row["response"]) == float(not slip or prompt == "Q: 0 + 0 =")


def test_the_sizes_are_the_documented_ones():
    config = load_config(["--config", str(ROOT / "configs" / "grpo_slip.toml")])
    data, batch = config.data.own, config.batch
    assert (data.sft_steps, config.run.max_steps, config.run.eval_every) == (600, 800, 25)
    rounds = (
        (config.run.max_steps - data.sft_steps) * batch.global_batch_size // (data.prompts_per_round * data.group_size)
    )
    assert (rounds, data.prompts_per_round, data.group_size, batch.global_batch_size) == (100, 64, 8, 256)
    assert (config.model.n_layer, config.model.d_model) == (2, 128)
    # GRPO at the schedule's floor, 3e-3 x 0.1 (float rounding only: 1e-12).
    assert abs(config.optim.lr * config.schedule.min_lr_ratio - 3e-4) < 1e-12
    assert config.schedule.decay_updates == data.sft_steps


def test_it_runs_through_train_py(tmp_path, monkeypatch):
    """The shipped config at a toy size: 2 SFT steps on the slipped answers, then 2 rounds of GRPO on its prompts."""
    monkeypatch.chdir(ROOT)
    toy = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.held_out=4", "data.sft_steps=2"]
    rounds = ["data.prompts_per_round=4", "data.group_size=4", "data.mini_batch_size=16", "batch.global_batch_size=16"]
    steps = ["batch.micro_batch_size=8", "schedule.warmup_updates=0", "schedule.decay_updates=2", "run.max_steps=4"]
    argv = [
        "--config",
        "configs/grpo_slip.toml",
        f'run.out_dir="{tmp_path}"',
        *toy,
        *rounds,
        *steps,
        "run.eval_every=2",
    ]
    assert train.main(argv) == 0
    lines = read_metrics(tmp_path / "grpo-slip")
    assert [line["phase"] for line in lines] == ["sft"] * 2 + ["grpo"] * 2
    assert "held_out_reward" in lines[-1]
