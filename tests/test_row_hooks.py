"""The optional part of the Rows interface (accumulation/data/rows.py's RowHooks): what rows that depend on the model
being trained tell the loop. The loop always calls the hooks; rows that declare RowHooks get theirs called, every
other source the defaults; a Rows class that defines a hook without declaring it is refused in one line, since
the loop would silently never call it (a normaliser ignored changes every gradient)."""

import json
import sys
import textwrap

import pytest
import torch

import train
from accumulation.data.rows import DEFAULT_HOOKS, RowHooks, make_rows, row_hooks
from accumulation.rl.on_policy import Rollouts

FORK_MODULE = """
import torch

from accumulation.config.registry import register_data
from accumulation.data.custom import data_from_custom_rows
from accumulation.data.rows import RowHooks, make_rows
from accumulation.data.splits import row_fingerprint

CALLS = {"bind_policy": [], "sampled_at": []}


class Delegating:
    def __init__(self, rows):
        self.rows = rows

    num_rows = property(lambda self: self.rows.num_rows)
    seq_len = property(lambda self: self.rows.seq_len)

    def examples(self, row_ids, step):
        return self.rows.examples(row_ids, step)

    def supervised_counts(self, row_ids, step):
        return self.rows.supervised_counts(row_ids, step)

    def raw_example(self, row_id, step):
        return self.rows.raw_example(row_id, step)


class DeclaredRows(Delegating, RowHooks):
    def bind_policy(self, model, context, resume):
        CALLS["bind_policy"].append(type(model).__name__)

    def sampled_at(self, step):
        CALLS["sampled_at"].append(step)
        return False

    def normaliser(self, row_ids, step):
        return 2 * float(self.supervised_counts(row_ids, step).sum()), "targets"  # N doubled: half the loss

    def step_fields(self, step, eval_every):
        return {"rows_step": step}

    def state_dict(self):
        return {"steps_seen": torch.tensor(len(CALLS["sampled_at"]))}


class UndeclaredRows(Delegating):
    def normaliser(self, row_ids, step):
        return 2 * float(self.supervised_counts(row_ids, step).sum()), "targets"


def source(rows_class):
    def build(data_config, *, model_vocab_size, seed):
        rows = rows_class(make_rows([bytes(range(40, 120))] * 8, seq_len=8))
        fingerprint = row_fingerprint(rows.rows)
        return data_from_custom_rows(data_config.source, rows, None, fingerprint=fingerprint, vocab_size=256)

    return build


register_data("plain", source(Delegating))
register_data("declared", source(DeclaredRows))
register_data("undeclared", source(UndeclaredRows))
"""

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=16",
    "data.seq_len=8",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=2",
    "run.max_steps=3",
    "run.sample_bytes=0",
]


@pytest.fixture
def fork(tmp_path, monkeypatch):
    (tmp_path / "hooks_fork.py").write_text(textwrap.dedent(FORK_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield sys.modules.get
    sys.modules.pop("hooks_fork", None)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rows_that_declare_the_hooks_have_each_called_by_the_loop(fork, tmp_path):
    """bind_policy once with the model, sampled_at for each step built ahead, the normaliser in the step's N (the
    same rows, N doubled: the logged loss Σ S / N is half the plain source's, whose sum is the same to the bit),
    step_fields in each metrics line, state_dict in the checkpoint."""
    runs = tmp_path / "runs"
    for name in ("plain", "declared"):
        status = train.main([f"data.source=hooks_fork:{name}", f"run.name={name}", f"run.out_dir={runs}", *TINY])
        assert status == 0
    calls = fork("hooks_fork").CALLS
    assert calls["bind_policy"] == ["GPT"]
    assert calls["sampled_at"] == [1, 2]  # steps 1 and 2 built one step ahead; none past run.max_steps
    plain, declared = metrics(runs / "plain"), metrics(runs / "declared")
    assert [line["rows_step"] for line in declared] == [1, 2, 3]
    assert "rows_step" not in plain[0]
    assert declared[0]["loss"] == pytest.approx(plain[0]["loss"] / 2, rel=1e-12)  # one sum, divided by 2N and N
    checkpoint = torch.load(runs / "declared" / "checkpoints" / "latest.pt", weights_only=True)
    assert checkpoint["data"]["rollouts"] == {"steps_seen": torch.tensor(2)}
    assert "rollouts" not in torch.load(runs / "plain" / "checkpoints" / "latest.pt", weights_only=True)["data"]


def test_rows_that_define_a_hook_without_declaring_it_are_refused_in_one_line(fork, tmp_path, capsys):
    status = train.main(["data.source=hooks_fork:undeclared", f"run.out_dir={tmp_path / 'runs'}", *TINY])
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: data.source: the training rows of 'hooks_fork:undeclared' define normaliser without declaring them: "
        "subclass accumulation.data.rows.RowHooks in their class, or the loop never calls them"
    ]
    assert not (tmp_path / "runs").exists()


def test_the_rollouts_declare_the_hooks_and_other_rows_get_the_defaults():
    assert issubclass(Rollouts, RowHooks)
    rows = make_rows([b"abcdefgh"], seq_len=4)
    assert row_hooks(rows) is DEFAULT_HOOKS
    assert DEFAULT_HOOKS.normaliser(torch.arange(1), 0) == (None, "targets")
    assert (
        not DEFAULT_HOOKS.sampled_at(5) and DEFAULT_HOOKS.step_fields(3, 1) == {} and DEFAULT_HOOKS.state_dict() == {}
    )
