"""The Hugging Face fork (forks/hf_causal_lm.py) past one process: each decoder layer its own FSDP2 unit
(fsdp_units), and GPT-2, Llama and Qwen2 decoders cut into pipeline stages (pipeline_split, forks/hf_stages.py),
on tiny models built here from local configs: nothing is downloaded. The multi-rank runs import transformers in
every rank (10-30 s each on a busy 2-core machine), so they are in the integration tier."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -r requirements-hf.txt)"
)

from accumulation import checker  # noqa: E402
from accumulation.checker.promises import stages_message  # noqa: E402
from forks.hf_causal_lm import HFCausalLM  # noqa: E402
from tests.test_check_equivalence import on_forked_ranks, reported_relative_error  # noqa: E402
from tests.test_train import read_metrics, train_forked  # noqa: E402

LAYERS = {"num_hidden_layers": 3, "max_position_embeddings": 128, "tie_word_embeddings": False, "vocab_size": 256}
ROTARY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **LAYERS}
CONFIGS = {
    # GPT-2's own dropout off: the stages and the whole model must draw nothing (the pipelined runs below draw it).
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=32, n_layer=3, n_head=4, n_positions=128, vocab_size=256, tie_word_embeddings=False
    ),
    "llama": lambda: transformers.LlamaConfig(**ROTARY),
    "qwen2": lambda: transformers.Qwen2Config(**ROTARY),
}
SMALL = ["batch.global_batch_size=8", "batch.micro_batch_size=2", "data.seq_len=100", "run.sample_bytes=0"]


def folder_of(tmp_path, family: str):
    CONFIGS[family]().save_pretrained(tmp_path / family)
    return tmp_path / family


def argv(folder, *extra) -> list[str]:
    return ["--config", "configs/hf_causal_lm.toml", f"model.path={folder}", *SMALL, *extra]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_stages_compute_the_models_forward_and_each_layer_is_a_unit(family, attention):
    """Stages of 1, 2 and 3 layers run one after another give the whole model's logits bit for bit (float64, train
    mode, dropout off): the same modules in the same order on the same positions and causal mask. The checker's
    own stage check (stages_message) agrees. A stage that dropped the mask (eager attention attends to every
    position without it) or restarted positions would differ by far."""
    config = CONFIGS[family]()
    config._attn_implementation = attention
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64), "test")
    assert len(model.fsdp_units()) == 3
    tokens = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        whole = model(tokens)
        for num_stages in (1, 2, 3):
            outputs = tokens
            for stage in model.pipeline_split(num_stages):
                outputs = stage(outputs)
            assert torch.equal(outputs, whole), (family, num_stages)
            assert stages_message(model, num_stages, tokens) is None


def test_a_stage_without_the_causal_mask_is_refused_by_the_checkers_stage_check(monkeypatch):
    """The stage check the checker runs catches a stage that computes another function: here every layer attends
    to later positions too (the mask dropped), which eager attention does when handed none."""
    config = CONFIGS["llama"]()
    config._attn_implementation = "eager"
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64), "test")
    monkeypatch.setattr("transformers.masking_utils.create_causal_mask", lambda **_: None)
    message = stages_message(model, 2, torch.randint(0, 256, (2, 20)))
    assert message is not None and "compute another function than its forward" in message


def test_a_family_it_cannot_cut_is_one_line():
    config = transformers.MistralConfig(**ROTARY)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config), "test")
    with pytest.raises(ValueError, match=r"^dist.pipeline_stages: the Hugging Face fork cuts gpt2, llama, qwen2"):
        model.pipeline_split(2)


@pytest.mark.integration
@pytest.mark.parametrize(
    "family, settings, named",
    [
        ("llama", ["dist.strategy=fsdp2"], "fsdp2: 4 groups (3 from fsdp_units() and the root)"),
        ("gpt2", ["dist.pipeline_stages=2"], "2 pipeline stages (1f1b), 2 ranks"),
    ],
)
def test_sharded_and_pipelined_the_hf_model_trains_and_the_checker_passes(tmp_path, family, settings, named):
    """fsdp2 with each decoder layer a unit, and a GPT-2 cut into 2 stages, on 2 gloo ranks: 3 steps of train.main
    whose loss goes down, then the equivalence checker's PASS (float64 reference of the full batch)."""
    folder = folder_of(tmp_path, family)
    arguments = argv(folder, f"run.out_dir={tmp_path / 'runs'}", "run.max_steps=3", "run.log_every=1", *settings)
    status, stdout, stderr = train_forked(arguments, 2, timeout_s=300)
    assert status == 0, stderr
    assert named in stdout, stdout
    losses = [line["loss"] for line in read_metrics(tmp_path / "runs" / "hf-causal-lm") if "loss" in line]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    status, stdout, _ = on_forked_ranks(argv(folder, *settings), 2)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]
