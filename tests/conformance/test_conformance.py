"""Conformance: what the loop needs from a fork, checked against the fork's own config.

    python -m pytest tests/conformance --fork-config configs/mlm.toml

The model contract the loop actually relies on (not causality, not generate(), not a banner format), the data
contract (rows a pure function of (seed, step, row id), supervised_counts equal to the labels, raw examples
that state exactly the rows), one step against the float64 full-batch reference on 1 and 2 ranks (the
checker, scripts/checks/check_equivalence.py), and an exact resume through train.py. Without --fork-config it runs
on the project's own configs (tests/conformance/conftest.py), as CI does.
"""

import os
import subprocess
import sys

import pytest
import torch

import train
from accumulation import checker as check_equivalence
from accumulation.batching import IGNORE_INDEX
from accumulation.checker.reference import reference_rows
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_batch, step_row_ids
from accumulation.models.factory import (
    build_model,
    build_model_on_meta,
    count_parameters,
    loss_sum_fn_for,
    resolved_vocab_size,
)
from testkit.ranks import run_main_on_ranks
from tests.conformance.conftest import REPO

STEPS = (0, 1)  # two steps: rows that change with the step must change consistently


def built(fork_argv: list[str]):
    config = load_config(fork_argv)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    return config, data, resolved_vocab_size(config.model, data.vocab_size)


def same_inputs(a, b) -> bool:
    """Equal inputs: one tensor, or tuples of tensors, equal in dtype, shape and every value."""
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return isinstance(a, tuple) == isinstance(b, tuple) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs
    )


def concatenated(parts: list):
    """The inputs of consecutive groups of rows as one: each tensor of a tuple concatenated along the rows."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([part[k] for part in parts]) for k in range(len(parts[0])))
    return torch.cat(parts)


def test_model_contract(fork_argv):
    """Same weights from the seed in every build; buildable on the meta device; forward on the step's inputs
    gives outputs the loss turns into one finite number; the state dict holds all state; describe() a line."""
    config, data, vocab_size = built(fork_argv)
    first, second = (
        build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed),
        build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed),
    )
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name}: two builds from the same seed differ; initialise from config.run.seed"
    # meta build
    on_meta = build_model_on_meta(config.model, vocab_size, config.data.seq_len)
    assert count_parameters(on_meta) == sum(p.numel() for p in first.parameters())
    batch = step_batch(
        data.train, 0, seed=config.run.seed, global_batch_size=8, tail="drop", micro_batch_size=8, world_size=1, rank=0
    )
    (micro_batch,) = batch.micro_batches
    first.eval()
    outputs = first(micro_batch.inputs)
    loss_sum = loss_sum_fn_for(config.model)(outputs, micro_batch.labels)
    assert loss_sum.dim() == 0 and torch.isfinite(loss_sum)
    loss_sum.backward()
    assert any(p.grad is not None for p in first.parameters())
    third = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    with torch.no_grad():
        for parameter in third.parameters():
            parameter.add_(1.0)  # other weights, until the state dict is loaded
    third.load_state_dict(first.state_dict())
    third.eval()
    assert torch.equal(third(micro_batch.inputs), outputs.detach()), "the state dict does not hold all the state"
    description = first.describe()
    assert isinstance(description, str) and description and "\n" not in description


@pytest.mark.parametrize("step", STEPS)
def test_data_contract(fork_argv, step):
    """examples(row_ids, step) is a pure function of (seed, step, row id): the same in two calls and in any
    grouping of the rows; supervised_counts equals the labels' count row by row; raw_example states exactly the
    inputs and labels; token ids lie within the vocabulary; the fingerprint is stable."""
    config, data, vocab_size = built(fork_argv)
    rows = data.train
    row_ids = step_row_ids(rows.num_rows, 8, config.run.seed, step, "drop")
    inputs, labels = rows.examples(row_ids, step)
    tensors = list(inputs) if isinstance(inputs, tuple) else [inputs]  # any dtype and shape, rows first
    assert labels.dtype == torch.int64 and labels.shape[0] == len(row_ids)
    assert all(tensor.shape[0] == len(row_ids) for tensor in tensors), "every input tensor has one row per row id"
    if rows.seq_len is not None:  # sequences: data.seq_len positions per row
        assert tensors[0].shape[1] == rows.seq_len == config.data.seq_len
    again = rows.examples(row_ids, step)
    assert same_inputs(again[0], inputs) and torch.equal(again[1], labels), "two calls gave other rows"
    halves = [rows.examples(part, step) for part in (row_ids[:3], row_ids[3:])]
    assert same_inputs(concatenated([h[0] for h in halves]), inputs), "a row depends on the rows beside it"
    assert torch.equal(torch.cat([h[1] for h in halves]), labels), "a row's labels depend on the rows beside it"
    per_row = (labels != IGNORE_INDEX).reshape(len(row_ids), -1).sum(dim=1)
    assert torch.equal(rows.supervised_counts(row_ids, step), per_row), "supervised_counts disagrees with labels"
    assert int(per_row.sum()) > 0
    reference_inputs, reference_labels = reference_rows(rows, row_ids, step, rows.seq_len)
    assert same_inputs(reference_inputs, inputs), "raw_example's inputs are not the rows' inputs"
    assert torch.equal(reference_labels, labels), "raw_example's targets are not the rows' labels"
    if inputs.dtype == torch.int64 and rows.seq_len is not None:  # token ids
        assert 0 <= int(inputs.min()) and int(inputs.max()) < vocab_size
    supervised = labels[labels != IGNORE_INDEX]
    assert 0 <= int(supervised.min()) and int(supervised.max()) < vocab_size
    assert (
        build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed).summary.fingerprint
        == data.summary.fingerprint
    )


def run_checker(fork_argv: list[str], ranks: int, capsys, tmp_path, launched: bool = False) -> tuple[int, str]:
    """(exit status, stdout): one rank in this process; more forked with torchrun's environment
    (testkit/ranks.py), or with `launched` under torchrun itself."""
    if ranks == 1:
        return check_equivalence.main(fork_argv), capsys.readouterr().out
    if not launched:
        per_rank = run_main_on_ranks("accumulation.checker:main", fork_argv, world_size=ranks)
        status = next((status for status, _, _ in per_rank if status != 0), 0)
        assert status in (0, 1), per_rank  # anything else is a crash
        return status, per_rank[0][1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    script = str(REPO / "scripts" / "checks" / "check_equivalence.py")
    completed = subprocess.run(
        launcher + [script, *fork_argv], capture_output=True, text=True, timeout=180, env=environment, cwd=REPO
    )
    assert completed.returncode in (0, 1), completed.stdout + completed.stderr  # anything else is a crash
    return completed.returncode, completed.stdout


def test_the_step_equals_the_float64_reference_on_1_rank(fork_argv, capsys, tmp_path):
    status, stdout = run_checker(fork_argv, 1, capsys, tmp_path)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout


@pytest.mark.expensive
@pytest.mark.parametrize("launched", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_the_step_equals_the_float64_reference_on_2_ranks(fork_argv, capsys, tmp_path, launched):
    status, stdout = run_checker(fork_argv, 2, capsys, tmp_path, launched)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "x ranks 2;" in stdout


@pytest.mark.expensive
def test_resume_is_exact(fork_argv, tmp_path):
    """Two steps straight, and one step then a resumed second one: the same final weights, bit for bit (the
    second step's rows, masks included, are rebuilt from (seed, step, row id) after the restart). train.py's
    main runs in this process, as three launches would run it, without three interpreters' start-up."""
    common = [*fork_argv, "run.log_every=1", "run.checkpoint_every=1", "run.sample_bytes=0", "run.eval_every=0"]
    assert train.main([*common, f"run.out_dir={tmp_path / 'straight'}", "run.max_steps=2"]) == 0
    assert train.main([*common, f"run.out_dir={tmp_path / 'resumed'}", "run.max_steps=1"]) == 0
    assert train.main([*common, f"run.out_dir={tmp_path / 'resumed'}", "run.max_steps=2"]) == 0
    name = load_config(fork_argv).run.name
    straight, resumed = (
        torch.load(tmp_path / folder / name / "checkpoints" / "latest.pt", weights_only=True)
        for folder in ("straight", "resumed")
    )
    assert straight["counters"] == resumed["counters"] and straight["counters"]["steps"] == 2
    for key, weights in straight["model"].items():
        assert torch.equal(weights, resumed["model"][key]), key
    # Frozen parameters (requires_grad off: a LoRA base, a frozen embedding) get no gradient and no update: after
    # two steps they hold their initial values, and something trained.
    config, _, vocab_size = built(fork_argv)
    initial = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    for name, parameter in initial.named_parameters():
        if not parameter.requires_grad:
            assert torch.equal(parameter.detach(), straight["model"][name]), f"{name} is frozen, yet the steps moved it"
    trainable = [(name, p) for name, p in initial.named_parameters() if p.requires_grad]
    assert any(not torch.equal(p.detach(), straight["model"][name]) for name, p in trainable), "nothing trained"
