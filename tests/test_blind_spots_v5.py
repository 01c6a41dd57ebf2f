"""Issue 35's blind spots, each a guarantee whose code a planted bug broke without any test failing
(scripts/checks/plant_bugs.py keeps each plant): a pipeline stage's mode around validation; an optimizer state of
two parameter groups moved between pipelined and one-process layouts; the world-size layout check alone; the
step-0 probe's detectors one at a time; a refusal after the run lock leaving the run directory as it was; a data
error in a step built one step ahead surfacing in its own step; the fused update after an out-of-memory retry; a
run directory deleted mid-run; the checker given a model whose outputs do not fit the loss."""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import train
from accumulation import checker
from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.data.sources import step_row_ids
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.mesh import build_layout
from accumulation.parallel.pipeline import build_pipeline, pipelined_loss_sum
from accumulation.probe import InexactStep, StepZeroFailed, probe_loss_and_model
from accumulation.run.run_dir import LOCK_FILE
from accumulation.shrink_on_oom import ShrinkOnOutOfMemory, optimizer_step_shrinking_on_oom
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import pretend_launched, run_main_on_ranks, run_on_ranks
from tests.test_oom import MODEL as OOM_MODEL
from tests.test_oom import RaisesAboveRows, corpus_rows
from tests.test_pipeline_train import PIPELINE_RUN, STAGES, assert_close_updates, checkpoint, resumed_from_step_2
from tests.test_step import CPU
from tests.test_train import read_metrics, tiny_settings, train_forked, uneven_corpus

# ------------------------------------------------------------------ 1. A pipeline stage's mode around validation


def validation_mode_worker(rank, world_size):
    """A 2-stage GPT with dropout: each stage's modes after the pipelined validation pass, and the loss of two
    passes over the same rows (equal only when no dropout is drawn)."""
    torch.set_num_threads(1)
    layout = build_layout(CPU, pipeline_stages=2)
    model = GPT(GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=16, vocab_size=64, dropout=0.5), seed=3)
    pipeline = build_pipeline(model, layout, CPU, token_cross_entropy_sum, 2, "1f1b")
    generator = torch.Generator().manual_seed(0)
    rows = [
        MicroBatch(tokens[:, :-1], tokens[:, 1:], 2)
        for tokens in (torch.randint(0, 64, (2, 9), generator=generator) for _ in range(3))
    ]
    losses = []
    for _ in range(2):
        loss_sum, _tokens = pipelined_loss_sum(pipeline, rows, None)
        torch.distributed.all_reduce(loss_sum)
        losses.append(loss_sum.item())
    return losses, [module.training for module in pipeline.stage_module.modules()]


def test_pipelined_validation_runs_in_eval_mode_and_leaves_every_stage_in_train_mode():
    """Train mode after: the step after validation draws dropout again. (train.py's loop also sets train mode
    before every step; this is the validation's own promise, which a caller without that line relies on.)"""
    for losses, modes in run_on_ranks(validation_mode_worker, world_size=2, timeout_s=120):
        assert losses[0] == losses[1], "validation drew dropout: a stage ran it in train mode"
        assert all(modes), "a stage was left in eval mode after validation"


def test_validation_between_pipelined_steps_changes_no_update(tmp_path):
    """2 stages with dropout 0.1: validation after every step ends on the very bits of a run that never
    validates. A stage left in eval mode after validation, or validating in train mode (which draws from the
    stream the next step's dropout uses), ends elsewhere; the run without dropout shows that dropout acts."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**PIPELINE_RUN, **STAGES, "model.dropout": 0.1, "run.checkpoint_every": 3}
    runs = {
        "validating": {"run.eval_every": 1},
        "not_validating": {"run.eval_every": 0},
        "no_dropout": {"run.eval_every": 0, "model.dropout": 0.0},
    }
    for name, overrides in runs.items():
        status, _, stderr = train_forked(
            tiny_settings(tmp_path, corpus, **{**settings, **overrides, "run.name": name}), 2
        )
        assert status == 0, stderr
    validating, not_validating, no_dropout = (checkpoint(tmp_path / "runs" / name, 3)["model"] for name in runs)
    for key, value in not_validating.items():
        assert torch.equal(validating[key], value), key
    assert any(not torch.equal(no_dropout[key], value) for key, value in not_validating.items())
    assert all("val_loss" in line for line in read_metrics(tmp_path / "runs" / "validating"))


# ------------------------------------------- 2. An optimizer state of two parameter groups between layouts

# SGD with momentum and weight decay: build_optimizer's two groups (matrices decay, vectors do not) differ in
# their settings, and each parameter's momentum buffer is linear in its gradients, so the pipelined and the
# one-process buffers agree to fp32 rounding (FP32 tolerance of tests/test_pipeline_train.py) while a buffer on
# the wrong parameter, or a group's settings on the other group, is off by its whole size.
TWO_GROUPS = {"optim.momentum": 0.9, "optim.weight_decay": 0.1, "optim.lr": 0.1}
FP32_RTOL = 1e-5


def assert_same_optimizer_state(got: dict, reference: dict) -> None:
    assert got["param_groups"] == reference["param_groups"]
    assert sorted(got["state"]) == sorted(reference["state"])
    for index, state in reference["state"].items():
        buffer, expected = got["state"][index]["momentum_buffer"], state["momentum_buffer"]
        assert buffer.shape == expected.shape, index
        tolerance = FP32_RTOL * expected.abs().max().item() + 1e-7
        assert (buffer - expected).abs().max().item() <= tolerance, index


def test_an_optimizer_state_of_two_groups_moves_between_pipeline_stages_and_one_process(tmp_path):
    """One process and 2 stages, 3 steps each: the pipelined checkpoint's optimizer state (each stage's
    state gathered into one optimizer's numbering) is one process's, parameter by parameter and group by group;
    and each resumed on the other layout from step 2 ends at step 3 where one process does."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {**PIPELINE_RUN, **TWO_GROUPS}
    for name, ranks, layout in [("one", 1, {}), ("piped", 2, STAGES)]:
        arguments = tiny_settings(tmp_path, corpus, **settings, **layout, **{"run.name": name})
        status, _, stderr = train_forked(arguments, ranks)
        assert status == 0, stderr
    one, piped = tmp_path / "runs" / "one", tmp_path / "runs" / "piped"
    reference = checkpoint(one, 3)
    assert reference["optimizer"]["param_groups"][0]["weight_decay"] == 0.1  # two groups that differ
    assert reference["optimizer"]["param_groups"][1]["weight_decay"] == 0.0
    for step in (1, 3):
        assert_same_optimizer_state(checkpoint(piped, step)["optimizer"], checkpoint(one, step)["optimizer"])
    initial = checkpoint(one, 0)["model"]
    for source, name, ranks, layout in [("piped", "piped_on_one", 1, {}), ("one", "one_piped", 2, STAGES)]:
        resumed_from_step_2(tmp_path / "runs" / source, tmp_path / "runs" / name)
        arguments = tiny_settings(tmp_path, corpus, **settings, **layout, **{"run.name": name})
        status, stdout, stderr = train_forked(arguments, ranks)
        assert status == 0, stderr
        assert "resuming from" in stdout
        resumed = checkpoint(tmp_path / "runs" / name, 3)
        assert_close_updates(resumed["model"], reference["model"], initial)
        assert_same_optimizer_state(resumed["optimizer"], reference["optimizer"])


# ------------------------------------------------------------------ 3. The layout check, alone


def test_ranks_that_do_not_divide_into_the_stages_are_refused_by_the_layout_check_alone(tmp_path, capsys, monkeypatch):
    """4 ranks, 3 stages, 3 blocks: every other check passes (3 blocks split into 3 stages; a broken layout
    check would take D = 4 // 3 = 1 replica, A = 8 / 2 = 4 >= 3 micro-batches for 1F1B), so only the check
    that the ranks divide into whole replicas can refuse it. The suite's other cases (1 rank for 2 stages,
    4 ranks for 3 stages of 2 blocks) are refused under the same key by the batch arithmetic or the model's
    split too, and hid a broken layout check. dist.timeout_s: a broken check then waits for 4 ranks that never
    come, failing in seconds instead of hanging."""
    pretend_launched(monkeypatch, 4)
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"model.n_layer": 3, "dist.pipeline_stages": 3, "dist.timeout_s": 3}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: dist.pipeline_stages: 4 ranks cannot be split into replicas of 3 pipeline stages; launch a multiple "
        "of 3 ranks (torchrun --nproc_per_node=N) or choose P dividing 4"
    ]
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ 4. The step-0 probe's detectors, one at a time

VOCAB = 11


def token_rows(supervised_per_row: list[int], seq_len: int = 6) -> MicroBatch:
    """Rows of `seq_len` token ids, the first `k` positions of each row supervised."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (len(supervised_per_row), seq_len), generator=generator)
    labels = torch.randint(0, VOCAB, inputs.shape, generator=generator)
    for row, supervised in enumerate(supervised_per_row):
        labels[row, supervised:] = IGNORE_INDEX
    return MicroBatch(inputs, labels, len(supervised_per_row))


def embedding_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, VOCAB)  # logits [rows, seq, VOCAB]: each position on its own


def per_row_mean(outputs, labels):
    """A sequence-mean objective: each row's mean over its own targets, summed over the rows. Additive over rows
    (each row alone), not over targets (a row's mean changes when some of its targets are taken away), and not
    the micro-batch's mean either: only the split of the targets can see it."""
    losses = F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    per_row = losses.view(labels.shape).sum(dim=1)
    return (per_row / (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)).sum()


def centred_over_rows(outputs, labels):
    """The token cross-entropy sum of logits centred by their mean over the micro-batch's rows. Additive over
    targets (the same logits whatever labels are hidden), not over rows (each half centres by its own mean):
    only the split of the rows can see it."""
    centred = outputs - outputs.mean(dim=0, keepdim=True)
    return F.cross_entropy(centred.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def probe_of(loss_sum_fn, batch: MicroBatch, on_inexact: str = "warn") -> list[str]:
    model = embedding_model()
    return probe_loss_and_model(model, model, loss_sum_fn, batch, CPU, on_inexact)


# 3 + 6 + 6 + 6 = 21 targets: the first half (10) ends inside the third row, so the split of the targets cuts a
# row's targets in two (a split at a row's end would be a split of rows too, which per_row_mean passes).
UNEVEN_ROWS = [3, 6, 6, 6]


def test_the_token_sum_passes_both_splits_silently():
    assert probe_of(token_cross_entropy_sum, token_rows(UNEVEN_ROWS)) == []


def test_a_loss_that_couples_the_targets_of_a_row_is_seen_by_the_split_of_the_targets_alone():
    batch = token_rows(UNEVEN_ROWS)
    model = embedding_model()
    with torch.no_grad():
        outputs = model(batch.inputs)
        halves = sum(per_row_mean(outputs[piece], batch.labels[piece]) for piece in (slice(0, 2), slice(2, 4)))
    assert abs(halves - per_row_mean(outputs, batch.labels)) <= 1e-6 * halves  # additive over rows: only targets
    [line] = probe_of(per_row_mean, batch)
    assert line.startswith("the loss couples the examples of a micro-batch"), line
    with pytest.raises(InexactStep, match=r"batch.on_inexact=error\): the loss couples the examples"):
        probe_of(per_row_mean, batch, on_inexact="error")


def test_a_loss_that_couples_rows_is_seen_by_the_split_of_the_rows_alone():
    batch = token_rows(UNEVEN_ROWS)
    model = embedding_model()
    with torch.no_grad():
        outputs = model(batch.inputs)
        first = batch.labels.clone()
        first.view(-1)[(batch.labels != IGNORE_INDEX).view(-1).nonzero()[10:, 0]] = IGNORE_INDEX
        second = torch.where(first == IGNORE_INDEX, batch.labels, IGNORE_INDEX)
        whole, halves = (
            centred_over_rows(outputs, batch.labels),
            sum(centred_over_rows(outputs, x) for x in (first, second)),
        )
    assert abs(halves - whole) <= 1e-6 * whole  # additive over targets: only the split of the rows sees it
    [line] = probe_of(centred_over_rows, batch)
    assert line.startswith("the loss couples the examples of a micro-batch"), line


def test_a_mean_over_the_micro_batch_is_refused_not_warned():
    def token_mean(outputs, labels):
        return F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    with pytest.raises(InexactStep, match=r"^step 0: the loss is a mean, not a sum over its targets"):
        probe_of(token_mean, token_rows(UNEVEN_ROWS))


def test_a_forward_or_a_loss_that_raises_is_named_and_the_model_left_in_train_mode():
    model = embedding_model()
    images = MicroBatch(torch.randn(2, 3, 4, 4), torch.zeros(2, dtype=torch.long), 2)
    with pytest.raises(StepZeroFailed, match=r"^step 0: the model's forward raised on the first micro-batch"):
        probe_loss_and_model(model, model, token_cross_entropy_sum, images, CPU, "warn")
    assert model.training

    def wrong_shape(outputs, labels):
        return F.cross_entropy(outputs, labels, reduction="sum")  # [rows, seq, V] against [rows, seq]: raises

    with pytest.raises(StepZeroFailed, match=r"^step 0: the loss raised on the model's outputs float32 \[4, 6, 11\]"):
        probe_of(wrong_shape, token_rows(UNEVEN_ROWS))


# ------------------------------------------------------------------ 5. A refusal after the run lock is taken


def every_path(folder) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None), run.lock included: what a refused run must leave as it was."""
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.is_file() else None
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("refusal", ["another run's setting", "a damaged metrics line"])
def test_a_resume_refused_after_taking_the_lock_leaves_the_run_directory_as_it_was(tmp_path, capsys, refusal):
    """A finished run's folder without run.lock (copied from another machine): the resume takes the lock (creating
    run.lock), then finds the checkpoint of another run, or metrics.jsonl damaged, and refuses. One line, exit 2,
    and the folder exactly as before: no run.lock left by the refused job."""
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 1, "run.sample_bytes": 0})
    assert train.main(arguments) == 0
    run_dir = tmp_path / "runs" / "default"
    (run_dir / LOCK_FILE).unlink()
    if refusal == "a damaged metrics line":
        (run_dir / "metrics.jsonl").write_text('{"steps": 1}\nnot json\n')
        named = "metrics.jsonl line 2 is not JSON"
    else:
        arguments.append("optim.lr=0.5")
        named = "belongs to a different run"
    before = every_path(run_dir)
    capsys.readouterr()
    assert train.main(arguments + ["run.max_steps=2"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and named in error, error
    assert every_path(run_dir) == before


# ------------------------------------------------------------------ 6. A data error in a step built one step ahead

# Rows whose supervised_counts promise one target too many at step 2 only: step 2's batch is built (and its
# check fails) while the device runs step 1.
WRONG_AT_STEP_2 = """
from accumulation.config.registry import register_data
from accumulation.data.rows import make_rows
from accumulation.data.custom import data_from_custom_rows
from accumulation.data.splits import row_fingerprint


class CountsWrongAtStep2:
    def __init__(self, rows):
        self.rows, self.num_rows, self.seq_len = rows, rows.num_rows, rows.seq_len

    def examples(self, row_ids, step):
        return self.rows.examples(row_ids, step)

    def raw_example(self, row_id, step):
        return self.rows.raw_example(row_id, step)

    def supervised_counts(self, row_ids, step):
        counts = self.rows.supervised_counts(row_ids, step)
        return counts + 1 if step == 2 else counts


def build(data_config, *, model_vocab_size, seed):
    rows = make_rows([bytes(range(40, 120))] * 8, seq_len=8)
    train = CountsWrongAtStep2(rows)
    return data_from_custom_rows(data_config.source, train, None, fingerprint=row_fingerprint(rows), vocab_size=256)


register_data("wrong-at-step-2", build)
"""


def test_a_data_error_in_the_step_built_ahead_surfaces_in_its_own_step_after_the_one_before_is_kept(
    tmp_path, capsys, monkeypatch
):
    """Step 2's micro-batches are built during step 1 and their check fails there. The error must wait for step 2:
    step 1 is logged and checkpointed first (a resume after fixing the data loses nothing), then one line naming
    step 2, exit 2. Raised where it was found, step 1 would be lost with it."""
    (tmp_path / "prefetch_fork.py").write_text(WRONG_AT_STEP_2)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = {
        "data.source": "prefetch_fork:wrong-at-step-2",
        "data.seq_len": 8,
        "run.max_steps": 5,
        "run.checkpoint_every": 1,
        "run.log_every": 1,
        "run.eval_every": 0,
        "run.sample_bytes": 0,
    }
    try:
        status = train.main(tiny_settings(tmp_path, tmp_path, **settings))
    finally:
        sys.modules.pop("prefetch_fork", None)
    error = capsys.readouterr().err
    assert status == 2
    assert error.count("\n") == 1 and error.startswith("error: step 2: the labels of row "), error
    run_dir = tmp_path / "runs" / "default"
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2]
    assert checkpoint(run_dir, 2)["counters"]["steps"] == 2
    assert not (run_dir / "checkpoints" / "step_000003.pt").exists()


# ------------------------------------------------------------------ 7. The fused update with the out-of-memory retry

# float64: the retry's micro-batches add the same terms in another order, a few ulps (1e-16) apart. Adam's
# update g / (sqrt(v) + eps) keeps a gradient's relative error, so each update agrees to ~1e-12 of its size;
# a second update, a gradient of the failed attempt kept, or a skip lost is off by the whole update.
FUSED_RTOL = 1e-8


def fused_adamw_steps(shrink: bool):
    """Three steps of fused AdamW with a GradScaler, the second one's loss nan (a skip): without a memory
    limit, or with forwards above 2 rows running out of memory (every step redone at m = 4, then 2)."""
    rows = corpus_rows()
    model = GPT(OOM_MODEL, seed=3).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    module = RaisesAboveRows(model, max_rows=2) if shrink else model
    step_function = optimizer_step_shrinking_on_oom if shrink else optimizer_step
    strategy = ShrinkOnOutOfMemory(module) if shrink else None
    history = []
    for step in range(3):
        factor = math.nan if step == 1 else 1.0
        row_ids = step_row_ids(rows.num_rows, 8, 5, step, "drop")
        batches = build_micro_batches(rows, row_ids, 8, 8, 1, 0, step=step)  # m = 8, A = 1
        loss_sum_fn = lambda outputs, labels, factor=factor: token_cross_entropy_sum(outputs, labels) * factor  # noqa: E731
        setup = StepSetup(module, CPU, loss_sum_fn=loss_sum_fn, scaler=scaler, strategy=strategy)
        result = step_function(setup, batches, optimizer)
        state = [value.clone() for values in optimizer.state.values() for value in values.values()]
        history.append((result, [p.detach().clone() for p in model.parameters()], state, scaler.get_scale()))
    return history, module


def test_the_fused_update_after_an_out_of_memory_retry_is_the_update_without_one():
    initial = [p.detach().clone() for p in GPT(OOM_MODEL, seed=3).double().parameters()]
    plain, _ = fused_adamw_steps(shrink=False)
    shrunk, limited = fused_adamw_steps(shrink=True)
    assert limited.rows_seen[:6] == [8, 4, 2, 2, 2, 2]  # each step ran out of memory twice, then ran at m = 2
    for (result, weights, state, scale), (got, got_weights, got_state, got_scale) in zip(plain, shrunk, strict=True):
        assert (got.applied, got.skip_reason, got.micro_batch_size) == (result.applied, result.skip_reason, 2)
        assert got_scale == scale
        for value, expected, start in zip(got_weights, weights, initial, strict=True):
            assert (value - expected).abs().max() <= FUSED_RTOL * (expected - start).abs().max() + 1e-15
        for value, expected in zip(got_state, state, strict=True):
            assert (value - expected).abs().max() <= FUSED_RTOL * expected.abs().max() + 1e-30
    assert [result.applied for result, *_ in shrunk] == [True, False, True]
    steps = [value for value in shrunk[-1][2] if value.dim() == 0]
    assert steps and all(float(value) == 2.0 for value in steps)  # two updates, each applied once


# ------------------------------------------------------------------ 8. The run directory deleted mid-run

# A loss that deletes the run directory on its 41st call (the step-0 probe's 6, then 4 micro-batches a step:
# during step 9), as a person cleaning up the wrong folder would.
DELETES_THE_RUN = """
import shutil

from accumulation.config.registry import register_loss
from accumulation.step import token_cross_entropy_sum

calls = []


def deleting_sum(outputs, labels):
    calls.append(1)
    if len(calls) == 41:
        shutil.rmtree({run_dir!r})
    return token_cross_entropy_sum(outputs, labels)


register_loss("deleting", deleting_sum)
"""


def test_a_run_directory_deleted_mid_run_is_not_said_to_hold_the_metrics(tmp_path, capsys, monkeypatch):
    """TensorBoard's next write fails (its files are gone); the line said "metrics.jsonl holds every step up to
    here" although metrics.jsonl was deleted with them. Now it says the file is gone."""
    run_dir = tmp_path / "runs" / "default"
    (tmp_path / "deleting_fork.py").write_text(DELETES_THE_RUN.format(run_dir=str(run_dir)))
    monkeypatch.syspath_prepend(str(tmp_path))
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"model.objective": "deleting_fork:deleting", "run.max_steps": 20, "run.checkpoint_every": 2}
    try:
        status = train.main(tiny_settings(tmp_path, corpus, **settings, **{"run.sample_bytes": 0}))
    finally:
        sys.modules.pop("deleting_fork", None)
    error = capsys.readouterr().err
    assert status != 0 and error.count("\n") == 1, error
    assert error.startswith(f"error: TensorBoard events in {run_dir / 'tensorboard'} could not be written"), error
    assert f"{run_dir / 'metrics.jsonl'} is gone too" in error and "holds every step" not in error, error


# ------------------------------------------------------------------ 9. The checker: outputs that do not fit the loss

SEVEN_LOGITS = """
import torch
from accumulation.config.registry import register_model


class SevenLogits(torch.nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 7)

    def forward(self, inputs):
        return self.embed(inputs)  # 7 logits per position for a vocabulary of 256


register_model("seven-logits", lambda model_config, vocab_size, *, seq_len, seed: SevenLogits(vocab_size))
"""
UNFIT_LINE = (
    "error: step 0: the loss raised on the model's outputs float32 [2, 16, 7] and the labels int64 [2, 16]: IndexError"
)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_checker_refuses_outputs_that_do_not_fit_the_loss_in_one_line(tmp_path, capsys, monkeypatch, ranks):
    """Before: a 30-line IndexError traceback from inside the loop's step, exit 1 (a FAIL's status). Now every
    rank finds it before any collective and says so in one line, exit 2, as train.py's step 0 does."""
    (tmp_path / "unfit_fork.py").write_text(SEVEN_LOGITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = [
        "model.name=unfit_fork:seven-logits",
        f"data.source={corpus}",
        "data.seq_len=16",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
    ]
    try:
        if ranks == 1:
            per_rank = [(checker.main(arguments), *capsys.readouterr())]
        else:
            per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=ranks)
    finally:
        sys.modules.pop("unfit_fork", None)
    for status, stdout, stderr in per_rank:
        assert status == 2 and stdout == "", (stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith(UNFIT_LINE), stderr


def test_the_checker_runs_the_pipelined_step_twice_and_compares_both(tmp_path):
    """On a 2 × 2 mesh (D = 2 replicas of 2 stages): DDP rebuilds each stage's gradient buckets at the second
    step's first forward, where a reducer armed by the schedule's shape inference died; a one-step check passed
    such a loop. Both steps' gradients are compared with the float64 reference."""
    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = [
        f"data.source={corpus}",
        "data.seq_len=16",
        "model.n_layer=2",
        "model.n_head=2",
        "model.d_model=16",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
        "dist.pipeline_stages=2",
    ]
    per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=4)
    assert [status for status, _, _ in per_rank] == [0] * 4, per_rank[0][2]
    stdout = per_rank[0][1]
    assert "2 pipeline stages (1f1b), 4 ranks" in stdout and stdout.splitlines()[-1] == "PASS", stdout
    assert "eager, 2 steps on the same rows;" in stdout, stdout
