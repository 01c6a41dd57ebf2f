"""The Hugging Face fork (forks/hf_causal_lm.py) against the model contract, on a tiny Llama built here from a
local config: nothing is downloaded. Skipped where transformers is not installed (requirements-hf.txt; .ci/run
installs it). Importing transformers costs 10-15 s per process, so the checks share one module and one process."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -r requirements-hf.txt)"
)

import train  # noqa: E402
from accumulation import checker  # noqa: E402
from accumulation.config.config import ConfigError, load_config  # noqa: E402
from accumulation.config.help import help_text  # noqa: E402
from accumulation.models.factory import build_model, model_fingerprint  # noqa: E402
from accumulation.models.loss_decision import has_output_head  # noqa: E402
from scripts.checks import check_equivalence  # noqa: E402

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
SMALL = ["batch.global_batch_size=8", "batch.micro_batch_size=2", "data.seq_len=100"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A folder with a config.json only, and a save_pretrained folder with the weights of another seed."""
    root = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.save_pretrained(root / "config_only")
    torch.manual_seed(123)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "saved")
    return root


def argv(folder, *extra) -> list[str]:
    return ["--config", "configs/hf_causal_lm.toml", f"model.path={folder}", *SMALL, *extra]


def built(folder, seed=1337, *extra):
    config = load_config(argv(folder, f"run.seed={seed}", *extra))
    return build_model(config.model, 256, seq_len=100, seed=seed), config


def test_built_from_a_config_from_the_seed_and_loaded_from_a_saved_folder(folders):
    state_before = torch.get_rng_state()
    first, config = built(folders / "config_only")
    assert torch.equal(torch.get_rng_state(), state_before), "the build left the global generator seeded"
    second, _ = built(folders / "config_only")
    other, _ = built(folders / "config_only", seed=7)
    for name, weights in first.state_dict().items():
        assert torch.equal(weights, second.state_dict()[name]), name
    assert any(not torch.equal(w, other.state_dict()[n]) for n, w in first.state_dict().items())
    saved = transformers.AutoModelForCausalLM.from_pretrained(folders / "saved")
    loaded, _ = built(folders / "saved")
    for name, weights in saved.state_dict().items():
        assert torch.equal(weights, loaded.hf.state_dict()[name]), name
    initialised, _ = built(folders / "saved", 1337, "model.weights=init")
    assert torch.equal(initialised.state_dict()["hf.lm_head.weight"], first.state_dict()["hf.lm_head.weight"])
    with torch.device("meta"):  # shapes only, as the resume check and the memory check build it
        on_meta = build_model(config.model, 256, seq_len=100, seed=0)
    assert sum(p.numel() for p in on_meta.parameters()) == sum(p.numel() for p in first.parameters())


def test_forward_hidden_states_head_and_sampling(folders, monkeypatch):
    model, _ = built(folders / "config_only")
    model.eval()
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    seen = []
    original = model.hf.forward
    monkeypatch.setattr(model.hf, "forward", lambda *a, **k: seen.append(k) or original(*a, **k))
    logits = model(tokens)
    assert all("labels" not in call for call in seen), "labels= was passed to Hugging Face"
    assert has_output_head(model)
    assert torch.allclose(model.output_head(model.hidden_states(tokens)), logits, atol=1e-6)
    samples = [model.generate(tokens[0, :4], 5, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(samples[0], samples[1]) and samples[0].shape == (9,)


def test_fingerprint_covers_config_json_and_a_bad_folder_is_one_line(folders, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "config.json").write_text((folders / "config_only" / "config.json").read_text())
    config = load_config(argv(folder))
    before = model_fingerprint(config.model)
    edited = json.loads((folder / "config.json").read_text())
    edited["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(edited))
    assert model_fingerprint(config.model) != before
    with pytest.raises(ConfigError, match=r"^model.path: expected a folder holding a Hugging Face config.json"):
        load_config(argv(tmp_path / "missing"))


def test_the_checker_passes_the_hf_model_on_sft_data(folders, capsys):
    status = check_equivalence.main(argv(folders / "config_only"))
    out = capsys.readouterr().out
    assert status == 0 and out.splitlines()[-1] == "PASS", out


def test_the_checker_switches_off_a_gpt2_configs_dropout_and_passes(tmp_path, capsys):
    """GPT-2's config keeps its own dropout (resid_pdrop, embd_pdrop, attn_pdrop 0.1), which model.dropout does
    not reach: left on, the loop, the reference and the A = 1, D = 1 baseline drew other masks, and a widened
    tolerance passed a gradient 17 % off. The checker sets every Dropout module's p to 0, says so, and PASSes."""
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    config.save_pretrained(tmp_path / "gpt2")
    status = check_equivalence.main(argv(tmp_path / "gpt2"))
    out = capsys.readouterr().out
    assert status == 0 and out.splitlines()[-1] == "PASS", out
    assert re.search(r"dropout off: \d+ Dropout modules \(p 0.1 -> 0\); config.resid_pdrop \(0.1 -> 0\)", out), out
    assert float(re.search(r"max relative error ([0-9.e+-]+)", out).group(1)) < checker.RELATIVE_TOLERANCE["fp32"]


@pytest.mark.parametrize("key", ["n_layer", "n_head", "d_model", "dropout"])
def test_a_generic_size_key_is_refused_for_it_and_left_out_of_help(folders, key):
    """Its size and dropout come from config.json: model.n_layer and kin would be silently ignored."""
    value = "0.1" if key == "dropout" else "2"
    with pytest.raises(
        ConfigError, match=rf"^model.{key} does not apply to forks.hf_causal_lm:hf-causal-lm: its size "
    ):
        load_config(argv(folders / "config_only", f"model.{key}={value}"))
    assert f"  model.{key} = " not in help_text(argv(folders / "config_only"))
    assert f"  model.{key} = " in help_text([])  # the GPT's


def test_a_resume_does_not_compare_the_keys_it_does_not_read(folders, tmp_path, capsys):
    """A checkpoint whose config holds model.n_layer = 8 (as this program wrote one before it left them out)
    resumes: the key means nothing for this model."""
    settings = argv(folders / "config_only", f"run.out_dir={tmp_path}", "run.log_every=1", "run.sample_bytes=0")
    assert train.main([*settings, "run.max_steps=0"]) == 0, capsys.readouterr().err
    files = {path.stat().st_ino: path for path in (tmp_path / "hf-causal-lm" / "checkpoints").glob("*.pt")}
    for path in files.values():  # latest.pt and the step's file: one file, two names
        payload = torch.load(path, weights_only=True)
        assert "n_layer" not in payload["config"]["model"]
        payload["config"]["model"]["n_layer"] = 8
        torch.save(payload, path)
    assert train.main([*settings, "run.max_steps=1"]) == 0, capsys.readouterr().err
