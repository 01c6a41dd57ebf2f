"""GRPO through train.py (configs/grpo.toml, accumulation/rl/on_policy.py), at a toy size: bad sizes are one line
and exit 2 with nothing written; the metrics speak RL's units; a run stopped mid-round or at a round's boundary,
or SIGKILLed mid-round, and resumed is the uninterrupted run bit for bit, on 1 and 2 ranks; and the step's N
carries the unit its objective declares."""

import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch

import train
from accumulation.batching import IGNORE_INDEX, GlobalCounts, MicroBatch
from accumulation.rl.objective_check import RELATIVE_TOLERANCE, StepRows, reference_gradient, relative_error
from accumulation.rl.objectives import NORMALISER_UNITS, group_relative_advantages
from accumulation.rl.on_policy import Rollouts, RolloutSettings, Round, clipped_surrogate_sum
from accumulation.rl.task import addition_problems
from accumulation.run.batches import StepBatches
from accumulation.run.checkpoint import save_checkpoint
from accumulation.step import StepSetup, optimizer_step
from testkit.ranks import run_on_ranks
from tests.test_disrupted_runs import finish, read_fault_log, start_torchrun
from tests.test_rl_objectives import CONSTANT, MODES, SEQ_LEN, step_rows, tiny_policy
from tests.test_train import comparable, final_weights, read_metrics, train_forked

# 9 problems (a, b < 3), one held out; 8 SFT steps at a high learning rate leave a policy that is right on some
# samples and wrong on others, so that advantages, gradients and updates of the GRPO steps are not all zero.
# A round: 4 prompts x 4 completions = 16 trajectories, mini-batch 8: 2 optimizer steps (GRPO steps 8, 9 are
# round 0, 10 and 11 round 1, 12 and 13 round 2, counted from 0).
TOY_ROUNDS = [
    "data.max_operand=3",
    "data.held_out=1",
    "data.sft_steps=8",
    "data.prompts_per_round=4",
    "data.group_size=4",
    "data.mini_batch_size=8",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "optim.lr=3e-2",
    "schedule.warmup_updates=0",
    "schedule.decay_updates=8",
    "run.max_steps=14",
    "run.eval_every=4",
    "run.log_every=4",
    "run.checkpoint_every=1",
    "run.keep_checkpoints=20",
]
TOY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", *TOY_ROUNDS]


def arguments(out_dir, *overrides) -> list[str]:
    return ["--config", "configs/grpo.toml", f'run.out_dir="{out_dir}"', *TOY, *overrides]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.mini_batch_size=6", "batch.global_batch_size=6", "batch.micro_batch_size=3"],
            "data.mini_batch_size: 16 trajectories do not divide into mini-batches of 6",
        ),
        (["data.mini_batch_size=4"], "batch.global_batch_size=8 must equal data.mini_batch_size=4"),
        (['model.objective=""'], 'trains with model.objective="clipped-surrogate"'),
        (["data.max_new_tokens=12"], "set data.seq_len=22"),
        (["data.group_size=1", "data.prompts_per_round=8"], "data.group_size=1: every advantage is its reward minus"),
        (["data.held_out=2"], "data.held_out=2: only every tenth of the 9 problems below data.max_operand=3 is held"),
        (["data.max_operand=10000"], "data.max_operand: expected an integer >= 2 and <= 300, got 10000"),
        (['data.policy_loss="forks.cispo:torch"'], 'data.policy_loss="forks.cispo:torch" is not a subclass of'),
        (['data.policy_loss="no_such_fork:Loss"'], 'data.policy_loss="no_such_fork:Loss": cannot import no_such_fork'),
        (['data.reward="tests.test_rl_train:no_such_reward"'], "tests.test_rl_train has no function no_such_reward"),
        (['data.prompts="data/sft_arithmetic.jsonl"'], "set data.seq_len=99"),
        (['data.prompts="data/sft_arithmetic.jsonl"', "data.held_out=281", "data.seq_len=99"], "set data.held_out=280"),
        (["data.prompts_per_round=1000000000"], "a round of 4,000,000,000 trajectories (1000000000 prompts x group 4)"),
    ],
)
def test_bad_sizes_are_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.chdir(train.Path(train.__file__).parent)
    assert train.main(arguments(tmp_path / "runs", *overrides)) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert list(tmp_path.iterdir()) == []


def nan_reward(prompt, completion):
    return float("nan")


def raising_reward(prompt, completion):
    raise KeyError("no answer key")


def text_reward(prompt, completion):
    return "1.0"


@pytest.mark.parametrize(
    ("reward_fn", "message"),
    [
        (nan_reward, "test_rl_train:nan_reward returned nan on prompt 'Q: "),
        (raising_reward, "test_rl_train:raising_reward raised KeyError: 'no answer key' on prompt 'Q: "),
        (text_reward, "test_rl_train:text_reward returned '1.0' (str) on prompt 'Q: "),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_refused_naming_the_prompt_and_completion(
    tmp_path, capsys, monkeypatch, reward_fn, message
):
    """A fork's reward function that returns NaN, raises or returns a str: one line at the first round naming the
    function, the prompt and the completion (not every update skipped for a "non-finite gradient")."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    named = f'data.reward="tests.test_rl_train:{reward_fn.__name__}"'  # as a config names a fork's reward
    assert train.main(arguments(tmp_path, "run.max_steps=9", "run.eval_every=0", named)) == 2
    error = capsys.readouterr().err
    assert message in error and "and completion '" in error and error.count("\n") == 1, error


def test_the_task_as_data_prompts_from_jsonl_and_a_named_reward(tmp_path, monkeypatch, capsys):
    """data.prompts (data/sft_arithmetic.jsonl: + - and * of several digits) and data.reward (the default arithmetic
    reward named as module:name): SFT on the file's responses, then GRPO rounds on its prompts, resumed bit for bit."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    task = ['data.prompts="data/sft_arithmetic.jsonl"', 'data.reward="accumulation.rl.task:reward"', "data.seq_len=99"]
    lines = run_in_sessions(tmp_path, "whole", [11], 1, *task)
    run_in_sessions(tmp_path, "sessions", [9, 11], 1, *task)
    assert_same_run(tmp_path, "sessions", "whole")
    assert [line["phase"] for line in lines] == ["sft"] * 8 + ["grpo"] * 3


def run_in_sessions(tmp_path, name: str, stops: list[int], ranks: int, *overrides, arguments_of=None) -> list[dict]:
    """train.py run to each of `stops` in turn (each session resuming the last), on `ranks` ranks; its metrics.
    `arguments_of(out_dir, *overrides)` gives the run's command line (this file's `arguments` by default)."""
    for stop in stops:
        argv = (arguments_of or arguments)(tmp_path, f'run.name="{name}"', f"run.max_steps={stop}", *overrides)
        if ranks == 1:
            assert train.main(argv) == 0
        else:
            status, _, errors = train_forked(argv, ranks, timeout_s=300)
            assert status == 0, errors
    return read_metrics(tmp_path / name)


def assert_same_run(tmp_path, name: str, reference: str) -> None:
    weights, expected = final_weights(tmp_path / name), final_weights(tmp_path / reference)
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key
    assert comparable(read_metrics(tmp_path / name)) == comparable(read_metrics(tmp_path / reference))


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stopped_mid_round_and_at_a_round_boundary_the_resumed_run_is_the_uninterrupted_one(
    tmp_path, monkeypatch, capsys, ranks
):
    monkeypatch.chdir(train.Path(train.__file__).parent)
    lines = run_in_sessions(tmp_path, "whole", [14], ranks)
    # 9: in round 0, whose rollout the checkpoint holds; 12: a round's first step, sampled after the resume
    run_in_sessions(tmp_path, "sessions", [9, 12, 14], ranks)
    assert_same_run(tmp_path, "sessions", "whole")

    assert [line["phase"] for line in lines] == ["sft"] * 8 + ["grpo"] * 6
    grpo = lines[8:]
    assert any(line["grad_norm"] > 0 for line in grpo)  # some group's rewards differ: the rollouts matter
    last = grpo[-1]
    assert (last["rounds"], last["step_in_round"], last["optimizer_steps_per_round"], last["trajectories"]) == (
        3,
        2,
        2,
        48,
    )
    # N of seq-mean-token-mean: the step's 8 completions; the `tokens` counter counts their supervised bytes
    assert (last["normaliser"], last["normaliser_unit"]) == (8.0, "sequences")
    assert 0 < last["completion_tokens"] <= 48 * 6  # at most data.max_new_tokens per completion
    trained_tokens = last["tokens"] - lines[7]["tokens"]  # each trajectory is trained on once (ppo_epochs = 1)
    assert trained_tokens == last["completion_tokens"]
    for key in ("mean_reward", "clip_fraction"):
        assert 0.0 <= last[key] <= 1.0, key
    assert last["approx_kl"] >= 0
    held_out = [line["held_out_reward"] for line in lines if "held_out_reward" in line]
    assert len(held_out) == 3 and all(0.0 <= value <= 1.0 for value in held_out)  # steps 4, 8, 12: eval_every


# Every objective setting at once, as a run would set them: GSPO's ratio with an asymmetric clip, a k3 KL penalty to
# the frozen reference policy (the policy at the end of SFT), an entropy bonus, verl's token-sum; and the sampler's.
OBJECTIVE_OVERRIDES = [
    'data.importance_level="sequence"',
    "data.clip_ratio=0.1",
    "data.clip_ratio_high=0.15",
    "data.kl_coef=0.05",
    "data.entropy_coef=0.01",
    'data.loss_aggregation="token-sum"',
    "data.temperature=0.8",  # and the sampler's settings: π_T in the sampler and the loss, a nucleus, stop tokens
    "data.top_p=0.95",
    "data.stop=\n ",  # a newline and a space: a string key's text is taken as it stands (bash: data.stop=$'\n ')
]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_objective_settings_train_log_and_resume_bit_for_bit_with_their_reference_policy(
    tmp_path, monkeypatch, capsys, ranks
):
    """The KL penalty's reference policy is saved with the run: a run stopped in round 0 (step 9) and at round 2's
    start (step 12) and resumed ends with the uninterrupted run's bits and metrics."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    lines = run_in_sessions(tmp_path, "whole", [14], ranks, *OBJECTIVE_OVERRIDES)
    run_in_sessions(tmp_path, "sessions", [9, 12, 14], ranks, *OBJECTIVE_OVERRIDES)
    assert_same_run(tmp_path, "sessions", "whole")
    grpo = lines[8:]
    assert all(line["normaliser_unit"] == "none (a sum)" and line["normaliser"] == 1.0 for line in grpo)
    assert all(line["entropy"] > 0 and line["kl_ref"] >= 0 for line in grpo)  # k3 is non-negative
    # round 0 samples from the reference itself: its KL is 0 but for the rounding of two forwards
    assert grpo[0]["kl_ref"] < 1e-6 < grpo[-1]["kl_ref"]
    payload = torch.load(tmp_path / "whole" / "checkpoints" / "latest.pt", weights_only=True)
    assert set(payload["data"]["rollouts"]["reference"]) == set(payload["model"])


def test_a_forks_objective_trains_on_the_shipped_source_and_logs_through_its_hook(tmp_path, monkeypatch, capsys):
    """forks/cispo.py, named by data.policy_loss: GRPO steps through train.py with its loss, its own logged mean
    (the truncated importance weight) in every GRPO step's metrics line."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    lines = run_in_sessions(tmp_path, "cispo", [12], 1, 'data.policy_loss="forks.cispo:CISPO"')
    grpo = lines[8:]
    assert all(0 < line["importance_weight"] <= 1.2 for line in grpo)  # min(ρ, 1 + ε_high)
    assert any(line["grad_norm"] > 0 for line in grpo)
    assert "forks.cispo:CISPO" in capsys.readouterr().out  # the start-up line names the objective


def test_sampling_in_smaller_forwards_draws_the_same_round(tmp_path, monkeypatch, capsys):
    """data.sample_batch_size cuts a rank's share of the round into forwards of that many rows (memory only): the
    draws are per row, so rounds 0 and 1 sampled 3 rows at a time hold the completions of one forward of 16."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    whole = run_in_sessions(tmp_path, "whole", [11], 1)
    argv = arguments(tmp_path, 'run.name="cut"', "run.max_steps=11", "data.sample_batch_size=3")
    assert train.main(argv) == 0
    cut = read_metrics(tmp_path / "cut")
    for line, other in zip(whole[8:], cut[8:], strict=True):
        assert (line["completion_tokens"], line["mean_reward"]) == (other["completion_tokens"], other["mean_reward"])


def test_one_and_two_ranks_sample_the_same_first_round(tmp_path, monkeypatch, capsys):
    """The rollout is a function of (seed, round, row) and of the weights: SFT on 1 and 2 ranks ends at weights a
    rounding apart, and the first round's completions (their count of tokens, their rewards) are the same."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    one = run_in_sessions(tmp_path, "one", [9], 1)
    two = run_in_sessions(tmp_path, "two", [9], 2)
    assert (one[8]["completion_tokens"], one[8]["mean_reward"]) == (two[8]["completion_tokens"], two[8]["mean_reward"])
    # float32 sums in another order: the SFT losses agree to about 1e-6 relative
    for line, other in zip(one, two, strict=True):
        assert line["loss"] == pytest.approx(other["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rank_killed_mid_round_restarts_and_the_run_ends_bit_identical(tmp_path, ranks):
    """Steps counted from 1, as faulty_train counts them: SFT 1-8, round 0 is 9-10, round 1 is 11-12. The last
    rank is SIGKILLed before step 11 (torchrun restarts the workers; they resume from step 10's checkpoint, at a
    round's boundary, and sample round 1 afresh), then before step 12 (they resume from step 11's checkpoint, which
    holds round 1's rollout). The run ends with the bits of the uninterrupted one."""
    reference = start_torchrun(
        ["--standalone", f"--nproc_per_node={ranks}"], ["train.py"], arguments(tmp_path, 'run.name="whole"')
    )
    status, output = finish(reference, time.monotonic() + 300)
    assert status == 0, output[-4000:]
    faults = [
        {"attempt": 0, "rank": ranks - 1, "kill_before_micro_batch": [11, 0]},
        {"attempt": 1, "rank": ranks - 1, "kill_before_micro_batch": [12, 0]},
    ]
    fault_log = tmp_path / "faults.jsonl"
    job = start_torchrun(
        ["--standalone", f"--nproc_per_node={ranks}", "--max-restarts=2"],
        ["-m", "tests.faulty_train"],
        arguments(tmp_path, 'run.name="killed"'),
        faults,
        fault_log,
    )
    status, output = finish(job, time.monotonic() + 300)
    assert status == 0, output[-4000:]
    assert len(read_fault_log(fault_log)) == 2
    assert output.count("resuming from") == 2
    assert_same_run(tmp_path, "killed", "whole")


def test_the_steps_normaliser_carries_its_unit_and_the_gradient_is_the_objectives():
    """optimizer_step with N counted in sequences: the update is the gradient of Σ S / N_sequences (float64, by
    hand), the result names N and its unit, and `tokens` still counts the supervised targets."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4, dtype=torch.float64)
    inputs, labels = torch.randn(5, 2, 3, dtype=torch.float64), torch.tensor([[1, 2], [0, -100]] + [[3, 1]] * 3)
    weights = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    expected = (
        torch.nn.functional.cross_entropy(
            model(inputs).reshape(-1, 4), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        / 5
    )  # 5 sequences
    expected.backward()
    reference = {name: weights[name] - tensor.grad for name, tensor in model.named_parameters()}
    model.load_state_dict(weights)
    model.zero_grad()
    micro_batches = [MicroBatch(inputs[:2], labels[:2], 2), MicroBatch(inputs[2:], labels[2:], 3)]
    counts = GlobalCounts(tokens=9, examples=5, normaliser=5.0, unit="sequences")
    result = optimizer_step(
        StepSetup(model, torch.device("cpu")),
        micro_batches,
        torch.optim.SGD(model.parameters(), lr=1.0),
        global_counts=counts,
    )
    assert (result.tokens, result.normaliser, result.unit) == (9, 5.0, "sequences")
    assert result.loss == pytest.approx(float(expected.detach()), rel=1e-12)  # float64 sums in another order
    for name, tensor in model.named_parameters():
        torch.testing.assert_close(tensor.detach(), reference[name], rtol=1e-12, atol=1e-14)


def test_the_objective_check_passes_on_the_runs_rollout_and_its_wrong_normaliser_fails_naming_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(train.Path(train.__file__).parent)
    spec = importlib.util.spec_from_file_location("check_objectives", "scripts/rl/check_objectives.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    settings = arguments(tmp_path)
    assert check.main(settings) == 0
    assert "PASS seq-mean-token-mean" in capsys.readouterr().out
    assert check.main([*settings, "--inject-bug", "wrong-normaliser"]) == 1
    assert "normaliser declared: targets = " in capsys.readouterr().out
    assert check.main([*settings, 'data.loss_aggregation="prompt-mean"', "--inject-bug", "wrong-normaliser"]) == 1
    assert "the objective's: groups = 2" in capsys.readouterr().out


def loop_update_errors(rank: int, ranks: int, micro_batch_sizes: list[int]) -> dict:
    """Train.py's path for one GRPO step, on this rank: StepBatches over the on-policy rows (the step's row ids, the
    row weights and N in the mode's unit, the extras), then optimizer_step with the clipped-surrogate loss, SGD at
    lr 1 on a float64 policy; against the objective's float64 gradient over the step's 12 rows, from its
    definition. The rows are tests/test_rl_objectives.py's (lengths 1 to 9, ratios past the clip), in 3 groups of 4."""
    model = tiny_policy()
    mine = torch.nn.parallel.DistributedDataParallel(model) if ranks > 1 else model
    rows = policy_step_rows(model)
    context = SimpleNamespace(replicas=ranks, replica=rank, device=torch.device("cpu"))
    errors = {}
    for mode, objective_settings in [(mode, {}) for mode in MODES] + [("token-sum", TRAIN_SETTINGS)]:
        rollouts = rollouts_of(rows, loss_aggregation=mode, **objective_settings)
        reference = reference_gradient(model, rows, rollouts.declared)
        loss_sum_fn = rollouts.loss_sum_fn(clipped_surrogate_sum)  # as build_training resolves it
        for m in micro_batch_sizes:
            update, unit = one_step_update(model, mine, rollouts, loss_sum_fn, context, m)
            errors[(mode, bool(objective_settings), m)] = (relative_error(update, reference), unit)
    return errors


def policy_step_rows(model) -> StepRows:
    """tests/test_rl_objectives.py's rows of `model`, with group-relative advantages, in 3 groups of 4."""
    drawn = step_rows(model)
    group_ids = torch.arange(12) // 4  # trajectory j answers prompt j // group_size
    advantages = group_relative_advantages(torch.linspace(0.0, 1.0, 12, dtype=torch.float64) ** 2, group_ids)
    return StepRows(drawn.tokens, drawn.labels, drawn.old_log_probs, advantages, group_ids, drawn.ref_log_probs)


def rollouts_of(rows: StepRows, **objective_settings) -> Rollouts:
    """Rollouts of one GRPO step of 12 rows whose round is `rows`, under `objective_settings`."""
    settings = RolloutSettings(
        mini_batch_size=12, prompts_per_round=3, group_size=4, sft_steps=0, norm_constant=CONSTANT, **objective_settings
    )
    rollouts = Rollouts(settings, addition_problems(3), [], SEQ_LEN, 0, 12)
    ref_log_probs = rows.ref_log_probs if settings.kl_coef else None
    rollouts.round = Round(
        0, rows.tokens, rows.labels, rows.old_log_probs, torch.zeros(12), rows.advantages, ref_log_probs
    )
    return rollouts


def one_step_update(model, mine, rollouts: Rollouts, loss_sum_fn, context, m: int) -> tuple[list, str]:
    """(the update of one SGD step at lr 1 over the rollouts' step 0 in micro-batches of m rows, N's unit); the
    model's weights are put back after it."""
    config = SimpleNamespace(
        run=SimpleNamespace(seed=0, max_steps=1), batch=SimpleNamespace(global_batch_size=12, tail="drop")
    )
    micro_batches, counts = StepBatches(config, SimpleNamespace(train=rollouts), context).take(0, m)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(mine.parameters(), lr=1.0)
    setup = StepSetup(mine, torch.device("cpu"), loss_sum_fn=loss_sum_fn)
    optimizer_step(setup, micro_batches, optimizer, global_counts=counts)
    with torch.no_grad():
        update = [old - p for old, p in zip(before, model.parameters(), strict=True)]
        for p, old in zip(model.parameters(), before, strict=True):
            p.copy_(old)
    return update, counts.unit


def test_two_rollouts_in_one_process_each_train_with_their_own_objective():
    """The checker and a run, or two tests, build rollouts in one process: each step trains with the objective its
    own rows declare (the loss they hand build_training), whichever rollouts were bound to a model last."""
    model = tiny_policy()
    rows = policy_step_rows(model)
    context = SimpleNamespace(replicas=1, replica=0, device=torch.device("cpu"), is_main=False)
    plain = rollouts_of(rows, loss_aggregation="token-sum")
    every = rollouts_of(rows, loss_aggregation="token-sum", **TRAIN_SETTINGS)
    for rollouts in (plain, every):  # as train.py binds each run's rows
        rollouts.bind_policy(model, context, None)
    references = {id(rollouts): reference_gradient(model, rows, rollouts.declared) for rollouts in (plain, every)}
    # The two objectives' gradients differ by far more than the tolerance, so a loss shared by both would fail.
    assert relative_error(references[id(plain)], references[id(every)]) > 1e-2
    for rollouts in (plain, every):
        update, _ = one_step_update(model, model, rollouts, rollouts.loss_sum_fn(clipped_surrogate_sum), context, 4)
        # float64 sums in another order and grouping: about 1e-15 relative; RELATIVE_TOLERANCE is 1e-9
        assert relative_error(update, references[id(rollouts)]) <= RELATIVE_TOLERANCE


def test_the_surrogate_on_rows_with_advantages_needs_the_rollouts_loss():
    """clipped-surrogate called without the loss the rollouts hand it (RowHooks.loss_sum_fn) has no objective to
    compute on GRPO rows: one line naming where it comes from, not a default objective; SFT rows need none."""
    labels = torch.tensor([[IGNORE_INDEX, 5, 7]])
    outputs = torch.randn(1, 3, 16)
    assert torch.isfinite(clipped_surrogate_sum(outputs, labels))
    with pytest.raises(ValueError, match="Rollouts.loss_sum_fn"):
        clipped_surrogate_sum(
            outputs, labels, advantages=torch.ones(1), old_log_probs=torch.zeros(1, 3), row_weights=torch.ones(1)
        )


# Every objective setting at once through train.py's path: asymmetric clip, GSPO, KL (k1), entropy bonus.
TRAIN_SETTINGS = dict(
    clip_ratio=0.03, clip_ratio_high=0.04, importance_level="sequence", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.1
)


@pytest.mark.parametrize("ranks", [1, 2])
def test_every_aggregation_through_train_pys_path_is_the_objectives_gradient(ranks):
    splits = [1, 2, 3, 4, 6, 12] if ranks == 1 else [2, 3, 6]
    per_rank = [loop_update_errors(0, 1, splits)] if ranks == 1 else run_on_ranks(loop_update_errors, 2, (splits,))
    for (mode, _, m), (error, unit) in per_rank[0].items():
        # float64 sums in another order and grouping: about 1e-15 relative; RELATIVE_TOLERANCE is 1e-9
        assert error <= RELATIVE_TOLERANCE, (mode, m, error)
        assert unit == NORMALISER_UNITS[mode]


def test_a_mid_round_checkpoint_without_its_rollout_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """The weights of a checkpoint in the middle of a round are not those the round sampled from: without the
    round's rollout the resume cannot be the uninterrupted run, so it is refused (exit 2) instead of resampled."""
    monkeypatch.chdir(train.Path(train.__file__).parent)
    run_in_sessions(tmp_path, "stripped", [9], 1)  # step 9: round 0's second step
    checkpoints = tmp_path / "stripped" / "checkpoints"
    payload = torch.load(checkpoints / "latest.pt", weights_only=True)
    assert payload["data"]["rollouts"]["round"] == 0
    del payload["data"]["rollouts"]
    save_checkpoint(payload, checkpoints, 9, keep=20)
    capsys.readouterr()
    assert train.main(arguments(tmp_path, 'run.name="stripped"')) == 2
    error = capsys.readouterr().err
    assert "the checkpoint at step 9 is in the middle of GRPO round 0 but holds no rollout of it" in error
    assert error.count("\n") == 1
    assert len(read_metrics(tmp_path / "stripped")) == 9  # nothing written
