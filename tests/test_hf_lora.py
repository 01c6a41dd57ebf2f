"""The LoRA fork (forks/hf_lora.py: PEFT adapters on a tiny Llama built from data/hf_tiny_llama/config.json,
nothing downloaded): the checker compares the trainable parameters only and PASSes on 1 process and on 2 gloo
ranks, with the plain and the chunked loss; train.py trains it a few steps, its banner counting the parameters
that train and those that do not, and the frozen base weights come out unchanged. Skipped where PEFT is not
installed (requirements-hf.txt; .ci/run installs it)."""

import re

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -r requirements-hf.txt)")

import train  # noqa: E402
from accumulation import checker  # noqa: E402
from accumulation.config.config import load_config  # noqa: E402
from accumulation.models.factory import build_model  # noqa: E402
from testkit.ranks import run_main_on_ranks  # noqa: E402

SMALL = ["--config", "configs/hf_lora.toml", "batch.global_batch_size=8", "batch.micro_batch_size=2"]
# The tiny Llama's 110,400 parameters: rank-8 adapters on q_proj (64 -> 64) and v_proj (64 -> 32) of 2 layers
# train, 2 x 8 x (64 + 64 + 64 + 32) = 3,584; the rest is frozen.
TRAINABLE, FROZEN = 3_584, 106_816


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_the_checker_compares_the_trainable_parameters_and_passes(capsys, loss):
    """Frozen parameters have no gradient (p.grad is None): the checker crashed on them. Under PEFT, base_model is
    the adapted whole model, so the chunked loss's hidden_states must come from the decoder."""
    status = checker.main([*SMALL, f"model.loss={loss}"])
    out = capsys.readouterr().out
    assert status == 0 and out.splitlines()[-1] == "PASS", out
    assert f"110,400 parameters ({TRAINABLE:,} train and are compared, {FROZEN:,} frozen)" in out
    assert f"the loop ran model.loss = {loss} as {loss}:" in out
    assert float(re.search(r"max relative error ([0-9.e+-]+)", out).group(1)) < checker.RELATIVE_TOLERANCE["fp32"]


# Each rank imports transformers and PEFT: about 28 s on this machine, so the integration tier; the default tier
# checks frozen parameters on 2 ranks with a frozen embedding (tests/test_checker_diagnoses.py).
@pytest.mark.integration
def test_the_checker_passes_on_two_gloo_ranks():
    per_rank = run_main_on_ranks("accumulation.checker:main", SMALL, world_size=2, timeout_s=180)
    statuses = [status for status, _, _ in per_rank]
    out = per_rank[0][1]
    assert statuses == [0, 0] and out.splitlines()[-1] == "PASS", per_rank
    assert "x ranks 2;" in out and f"{FROZEN:,} frozen" in out


def test_train_py_moves_the_adapters_only(tmp_path, capsys):
    steps = ["run.max_steps=3", "run.log_every=1", "run.eval_every=0", "run.sample_bytes=0", "run.checkpoint_every=3"]
    argv = [*SMALL, *steps, f"run.out_dir={tmp_path}", "model.loss=chunked"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"parameters {TRAINABLE:,} train, {FROZEN:,} frozen;" in out, out
    config = load_config(argv)
    initial = build_model(config.model, 256, seq_len=config.data.seq_len, seed=config.run.seed)
    trained = torch.load(tmp_path / "hf-lora" / "checkpoints" / "latest.pt", weights_only=True)["model"]
    frozen = {name: p for name, p in initial.named_parameters() if not p.requires_grad}
    adapters = {name: p for name, p in initial.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in adapters.values()) == TRAINABLE and all("lora_" in name for name in adapters)
    for name, parameter in frozen.items():
        assert torch.equal(parameter.detach(), trained[name]), f"{name} is frozen, yet training moved it"
    moved = [name for name, p in adapters.items() if not torch.equal(p.detach(), trained[name])]
    assert len(moved) == len(adapters), sorted(set(adapters) - set(moved))


def test_a_target_the_base_model_lacks_is_one_line_and_exit_2(tmp_path, capsys):
    """PEFT's own error for it is a traceback from inside get_peft_model."""
    assert train.main([*SMALL, "model.lora_targets=q_proj,qproj", f"run.out_dir={tmp_path}"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model.lora_targets: qproj not among the base model's linear layers (down_proj,")
    assert not any(tmp_path.iterdir())
