"""scripts/operations/export.py: a run as a Hugging Face folder that transformers loads, whose logits are those of
train.py's model on the same tokens; bad input in one line, exit 2, nothing written. Skipped without transformers
(requirements-hf.txt)."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (requirements-hf.txt)")

import train  # noqa: E402
from accumulation.run.trained import load_trained_run  # noqa: E402
from scripts.operations import export  # noqa: E402
from tests.test_hf_causal_lm import TINY_LLAMA  # noqa: E402
from tests.test_train import tiny_settings, uneven_corpus  # noqa: E402

TOKENS = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """6 steps at a high learning rate: weights far from their initialisation (a mapping error shows)."""
    tmp_path = tmp_path_factory.mktemp("gpt")
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.max_steps": 6, "run.sample_bytes": 0, "model.n_layer": 2, "model.d_model": 32, "optim.lr": 1e-2}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 0
    return tmp_path / "runs" / "default"


def assert_same_logits_as_float32_rounding_allows(ours: torch.nn.Module, theirs: torch.Tensor) -> None:
    """The two float32 forwards run the same maths through other kernels (SDPA against GPT-2's eager attention,
    Linear against Conv1D's addmm), so they differ by rounding only: the bound is 8 x our own float32 model's
    largest distance from itself in float64, which a rounding-level difference stays within and any mapping error
    (a weight not transposed, the tanh GELU, another eps) exceeds by orders of magnitude."""
    with torch.no_grad():
        logits32 = ours(TOKENS)
        logits64 = ours.double()(TOKENS).float()
        ours.float()
    rounding = (logits32 - logits64).abs().max().item()
    assert 0 < rounding < 1e-4
    assert (theirs - logits32).abs().max().item() <= 8 * rounding


def test_the_gpt_becomes_a_gpt2_lm_head_model_with_the_same_logits(gpt_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export.main([str(gpt_run), str(out)]) == 0
    assert "as GPT2LMHeadModel" in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    assert type(hf_model).__name__ == "GPT2LMHeadModel" and not hf_model.config.tie_word_embeddings
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    assert_same_logits_as_float32_rounding_allows(load_trained_run(gpt_run).model, theirs)


def test_the_tanh_gelu_would_not_pass_the_logits_check(gpt_run, tmp_path):
    """The check above can fail: GPT-2's own activation (tanh-approximated GELU) instead of the exact one."""
    hf_model = export.as_gpt2(load_trained_run(gpt_run).model, 0.0)
    hf_model.config.activation_function = "gelu_new"
    for block in hf_model.transformer.h:
        block.mlp.act = transformers.activations.ACT2FN["gelu_new"]
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    with pytest.raises(AssertionError):
        assert_same_logits_as_float32_rounding_allows(load_trained_run(gpt_run).model, theirs)


def test_the_hugging_face_fork_is_saved_as_its_own_class(tmp_path, capsys):
    folder = tmp_path / "tiny_llama"
    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(folder)
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.max_steps": 2, "run.sample_bytes": 0, "run.name": "llama"}
    arguments = [a for a in tiny_settings(tmp_path, corpus, **settings) if not a.startswith("model.")]
    arguments += ["model.name=forks.hf_causal_lm:hf-causal-lm", f"model.path={folder}"]
    assert train.main(arguments) == 0
    out = tmp_path / "hf"
    assert export.main([str(tmp_path / "runs" / "llama"), str(out)]) == 0
    assert "as LlamaForCausalLM" in capsys.readouterr().out
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    ours = load_trained_run(tmp_path / "runs" / "llama").model
    with torch.no_grad():  # the same class and weights: the same kernels, so the same bits
        assert torch.equal(hf_model(input_ids=TOKENS).logits, ours(TOKENS))


def test_a_tokenizer_json_is_exported_and_auto_tokenizer_loads_it(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {chr(97 + i): i for i in range(26)} | {"<unk>": 26, " ": 27}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    word_level.save(str(tmp_path / "tokenizer.json"))
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.max_steps": 1, "run.sample_bytes": 0, "data.tokenizer": str(tmp_path / "tokenizer.json")}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 0
    out = tmp_path / "hf"
    assert export.main([str(tmp_path / "runs" / "default"), str(out)]) == 0
    assert "tokenizer.json from" in capsys.readouterr().out
    loaded = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert loaded("abc")["input_ids"] == word_level.encode("abc").ids


def test_bad_input_is_one_line_exit_2_and_nothing_written(gpt_run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    (damaged / "checkpoints" / "latest.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("a user's file")
    cases = [
        ([str(tmp_path / "nowhere"), str(tmp_path / "a")], "is not a run directory"),
        ([str(damaged), str(tmp_path / "b")], "cannot be read"),
        ([str(gpt_run), str(tmp_path / "full")], "exists and is not an empty folder"),
        ([str(gpt_run), str(tmp_path / "no" / "parent")], "does not exist"),
        ([str(gpt_run)], "expected RUN_DIR OUT_DIR"),
    ]
    for arguments, message in cases:
        assert export.main(arguments) == 2
        error = capsys.readouterr().err
        assert error.startswith("error: ") and message in error and error.count("\n") == 1, error
    assert sorted(os.listdir(tmp_path)) == ["damaged", "full"]
    assert (tmp_path / "full" / "keep.txt").read_text() == "a user's file"


def test_a_failed_write_leaves_no_folder(gpt_run, tmp_path, monkeypatch):
    def failing_save(self, folder, **options):
        os.makedirs(folder)
        (folder / "config.json").write_text(json.dumps({}))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", failing_save)
    with pytest.raises(OSError):
        export.export(gpt_run, tmp_path / "hf")
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_of_sharded_training_exports_like_any_other(tmp_path, capsys):
    """dist.strategy = "fsdp2" on 2 gloo ranks: rank 0 gathers the shards into one whole checkpoint, which export
    reads as it reads one process's."""
    from tests.test_train import train_forked

    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.max_steps": 2, "run.sample_bytes": 0, "dist.strategy": "fsdp2", "model.n_layer": 2}
    status, _, stderr = train_forked(tiny_settings(tmp_path, corpus, **settings), ranks=2)
    assert status == 0, stderr
    run_dir, out = tmp_path / "runs" / "default", tmp_path / "hf"
    assert export.main([str(run_dir), str(out)]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    assert_same_logits_as_float32_rounding_allows(load_trained_run(run_dir).model, theirs)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """configs/hf_lora.toml, 3 steps at a high learning rate: adapters (B starts at 0) far from zero."""
    pytest.importorskip("peft", reason="peft is not installed (requirements-hf.txt)")
    out = tmp_path_factory.mktemp("lora")
    settings = ["run.max_steps=3", "run.eval_every=0", "run.sample_bytes=0", "optim.lr=3e-2", f"run.out_dir={out}"]
    assert train.main(["--config", "configs/hf_lora.toml", "batch.global_batch_size=8", *settings]) == 0
    return out / "hf-lora"


def test_a_lora_fork_exports_merged_with_the_logits_of_base_and_adapters(lora_run, tmp_path, capsys):
    ours = load_trained_run(lora_run).model
    assert any(name.endswith("lora_B.default.weight") and p.abs().max() > 0 for name, p in ours.named_parameters())
    assert export.main([str(lora_run), str(tmp_path / "merged")]) == 0
    assert "as LlamaForCausalLM, the LoRA adapters merged into its weights" in capsys.readouterr().out
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    with torch.no_grad():  # W + s B A in one matrix against W x + s B (A x): rounding apart
        assert_same_logits_as_float32_rounding_allows(ours, merged(input_ids=TOKENS).logits)


def test_a_lora_fork_exports_its_adapter_beside_its_frozen_base(lora_run, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.tuners.lora import Linear as LoRALinear
    from safetensors.torch import load_file

    out = tmp_path / "adapter"
    assert export.main([str(lora_run), str(out), "--adapter"]) == 0
    assert "as a LoRA adapter, its frozen LlamaForCausalLM base in base/" in capsys.readouterr().out
    assert {"adapter_config.json", "adapter_model.safetensors", "base"} <= {path.name for path in out.iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", local_files_only=True)
    # PeftModel.from_pretrained(base, out), step by step: its layer dispatch asks torchao, which the pin of
    # requirements-cards.txt (0.13) makes it refuse; forks/hf_lora.py names PEFT's own LoRA layer the same way.
    lora = LoraConfig.from_pretrained(out)
    lora._register_custom_module({torch.nn.Linear: LoRALinear})
    model = get_peft_model(base, lora)
    set_peft_model_state_dict(model, load_file(out / "adapter_model.safetensors"))
    with torch.no_grad():  # the same modules and weights as train.py's: the same bits
        assert torch.equal(model(input_ids=TOKENS).logits, load_trained_run(lora_run).model(TOKENS))
    assert export.main([str(lora_run.parent.parent), str(tmp_path / "x"), "--adapter"]) == 2  # not a run directory
    capsys.readouterr()


def test_adapter_is_refused_for_a_model_without_adapters(gpt_run, tmp_path, capsys):
    assert export.main([str(gpt_run), str(tmp_path / "hf"), "--adapter"]) == 2
    assert capsys.readouterr().err == "error: --adapter: model.name=gpt has no LoRA adapters; leave --adapter out\n"
    assert not (tmp_path / "hf").exists()
