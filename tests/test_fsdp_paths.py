"""dist.strategy = "fsdp2" with the two paths a large model needs: the chunked loss (model.loss = "chunked") and
torch.compile (model.compile = true), each trained through train.main on 2 gloo ranks against fsdp2's plain eager
run of the same settings (accumulation/parallel/fsdp.py, shard_model)."""

import pytest

from accumulation import checker
from accumulation.config.config import load_config
from accumulation.parallel.fsdp import check_strategy_for_world
from testkit.reference import max_relative_error
from tests.test_check_equivalence import reported_relative_error, run_checker_with_stderr
from tests.test_sharded_checkpoint import whole
from tests.test_train import REPO, read_metrics, tiny_settings, train_forked, uneven_corpus

# What both runs share: 4 AdamW updates with dropout (the same masks: the chunked loss and compiled blocks draw no
# random numbers of their own), a checkpoint at the end.
RUN = {"model.dropout": 0.2, "schedule.decay_updates": 4, "run.checkpoint_every": 4, "run.sample_bytes": 0}


def fsdp2_run(tmp_path, corpus, name: str, steps: int, timeout_s: float = 120, **overrides) -> tuple[dict, list, str]:
    """(the final weights gathered whole, the metrics lines, rank 0's stdout) of train.main on 2 forked ranks."""
    settings = {**RUN, "run.name": name, "run.max_steps": steps, "dist.strategy": "fsdp2", **overrides}
    status, stdout, stderr = train_forked(tiny_settings(tmp_path, corpus, **settings), 2, timeout_s)
    assert status == 0, stderr
    run_dir = tmp_path / "runs" / name
    return whole(run_dir)["model"], read_metrics(run_dir), stdout


def assert_same_training(run, reference, rtol: float) -> None:
    weights, metrics, _ = run
    reference_weights, reference_metrics, _ = reference
    assert weights.keys() == reference_weights.keys()
    assert max_relative_error([weights[key] for key in reference_weights], list(reference_weights.values())) < rtol
    assert [line["loss"] for line in metrics] == pytest.approx([line["loss"] for line in reference_metrics], rel=rtol)


def test_fsdp2_with_the_chunked_loss_trains_as_with_the_plain_loss(tmp_path):
    """The chunked loss reads the output head's weight after the model's hidden_states, an FSDP2 forward of the
    root that keeps it whole until the backward: its gradient is reduce-scattered with the rest. Against the plain
    loss the same S and gradients up to fp32 reordering inside the loss (one chunk here: logsumexp and the
    gathered target logit against cross_entropy's log-softmax, ∂S/∂W as one product instead of autograd's), an
    ulp or so per step, carried through 4 AdamW updates: 2.5e-6 of the largest weight measured, bounded at 2e-5.
    A head gradient lost (the head never trained) or not averaged over D = 2 moves each head weight by about the
    learning rate (1e-3) at every update, 1e-2 of the largest weights: 2e-5 separates the two by far."""
    corpus = uneven_corpus(tmp_path / "corpus")
    plain = fsdp2_run(tmp_path, corpus, "plain", 4)
    chunked = fsdp2_run(tmp_path, corpus, "chunked", 4, **{"model.loss": "chunked"})
    assert "loss chunked" in chunked[2]
    assert_same_training(chunked, plain, 2e-5)


def test_the_equivalence_checker_passes_under_fsdp2_with_the_chunked_loss(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    arguments = ["dist.strategy=fsdp2", "model.loss=chunked"]
    status, stdout, _ = run_checker_with_stderr(tmp_path, arguments, 2, capsys, False)
    assert status == 0, stdout
    assert "chunked" in stdout and stdout.splitlines()[-1] == "PASS"
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


@pytest.mark.parametrize("overrides", [["model.compile=true"], ["model.compile=true", "model.loss=chunked"]])
def test_fsdp2_takes_model_compile(overrides):
    """The config check lets fsdp2 compile (its units, shard_model); the compiled run itself is the compile-marked
    test below, minutes of Inductor on the CPU."""
    check_strategy_for_world(load_config(["dist.strategy=fsdp2", *overrides]), 2)


@pytest.mark.compile
def test_fsdp2_with_compiled_blocks_trains_as_eager(tmp_path, monkeypatch):
    """model.compile = true under fsdp2: each block compiled (Inductor) before it is sharded, 3 AdamW updates against
    the eager run. Inductor fuses and reorders fp32 operations (the layer norm's sums, the MLP's pointwise ops):
    a few ulps per value per step, carried through 3 updates: 1.1e-6 of the largest weight measured, bounded at
    1e-5; a block left out of the reduction or compiled around the collectives would be off by 1e-2. Dropout off:
    Inductor draws its masks from its own generator (1.3e-2 apart with model.dropout = 0.2)."""
    corpus = uneven_corpus(tmp_path / "corpus")
    eager = fsdp2_run(tmp_path, corpus, "eager", 3, **{"model.dropout": 0.0})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the ranks inherit it
    compiled = fsdp2_run(tmp_path, corpus, "compiled", 3, 500, **{"model.compile": "true", "model.dropout": 0.0})
    assert any((tmp_path / "inductor").rglob("*.py")), "no block was compiled"  # Inductor's generated kernels
    assert "compile on" in compiled[2]
    assert_same_training(compiled, eager, 1e-5)


def test_fsdp2_says_compile_off_for_a_model_without_fsdp_units(tmp_path, monkeypatch):
    """model.compile = true under fsdp2 compiles each of a model's fsdp_units(); the GRU lists none, so nothing is
    compiled (Inductor writes no kernel), and the banner says compile off (it said on) and why."""
    corpus = uneven_corpus(tmp_path / "corpus")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the ranks inherit it
    settings = {"dist.strategy": "fsdp2", "model.name": "gru", "model.compile": "true", "run.max_steps": 2}
    status, stdout, stderr = train_forked(tiny_settings(tmp_path, corpus, **settings), 2)
    assert status == 0, stderr
    [model_line] = [line for line in stdout.splitlines() if line.startswith("model: ")]
    assert model_line.endswith("compile off"), model_line
    assert "never compiled (model.compile compiles each of fsdp_units())" in stdout
    assert not any((tmp_path / "inductor").rglob("*.py"))
