"""The model factory and the model contract: shapes, seeded initialisation, meta-device counting, the
vocabulary size, describe() and the optional generate(), for every architecture `model.name` offers."""

import pytest
import torch

from accumulation.config.config import Config, ConfigError, load_config
from accumulation.models import factory as models
from accumulation.models.encoder import Encoder
from accumulation.models.factory import build_model, build_model_on_meta, count_parameters, resolved_vocab_size
from accumulation.models.gpt import GPT, Block, GPTConfig

BYTE_VOCAB_SIZE = 256  # what byte-level data gives
SEQ_LEN = 8
MODEL_NAMES = ("gpt", "gru")


def small_config(name: str, *overrides: str) -> Config:
    return load_config(
        [f"model.name={name}", "model.n_layer=2", "model.n_head=2", "model.d_model=16", f"data.seq_len={SEQ_LEN}"]
        + list(overrides)
    )


def build(config: Config, vocab_size: int) -> torch.nn.Module:
    """build_model with the sections train.py passes it."""
    return build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)


def tokens(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, BYTE_VOCAB_SIZE, (rows, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def total_numel(model: torch.nn.Module) -> int:
    return sum(param.numel() for param in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_maps_token_ids_to_logits_over_the_vocabulary(name):
    model = build(small_config(name), BYTE_VOCAB_SIZE)
    logits = model(tokens(rows=3))
    assert logits.shape == (3, SEQ_LEN, BYTE_VOCAB_SIZE)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_logits_at_a_position_do_not_see_later_tokens(name):
    # Next-token prediction needs causality: changing the last token changes only the last position's logits.
    model = build(small_config(name), BYTE_VOCAB_SIZE).eval()
    inputs = tokens(rows=1)
    changed = inputs.clone()
    changed[0, -1] = (changed[0, -1] + 1) % BYTE_VOCAB_SIZE
    before, after = model(inputs), model(changed)
    assert torch.equal(before[:, :-1], after[:, :-1])
    assert not torch.equal(before[:, -1], after[:, -1])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_seed_alone_decides_the_initial_weights(name):
    first = build(small_config(name, "run.seed=5"), BYTE_VOCAB_SIZE).state_dict()
    again = build(small_config(name, "run.seed=5"), BYTE_VOCAB_SIZE).state_dict()
    other = build(small_config(name, "run.seed=6"), BYTE_VOCAB_SIZE).state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)  # bit-identical: every rank starts equal
    assert not all(torch.equal(first[key], other[key]) for key in first)
    # The draws do not come from the global RNG, which differs by rank (dropout uses it).
    torch.manual_seed(123)
    after_reseeding = build(small_config(name, "run.seed=5"), BYTE_VOCAB_SIZE).state_dict()
    assert all(torch.equal(first[key], after_reseeding[key]) for key in first)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("n_layer", [1, 2, 48])
def test_count_parameters_equals_a_real_build(name, n_layer):
    config = small_config(name, f"model.n_layer={n_layer}")
    on_meta = build_model_on_meta(config.model, BYTE_VOCAB_SIZE, config.data.seq_len)
    assert count_parameters(on_meta) == total_numel(build(config, BYTE_VOCAB_SIZE))


def test_build_model_on_meta_allocates_nothing(monkeypatch):
    built = []

    def recording_build_model(model_config, vocab_size, *, seq_len, seed):
        built.append(build_model(model_config, vocab_size, seq_len=seq_len, seed=seed))
        return built[-1]

    monkeypatch.setattr(models, "build_model", recording_build_model)
    for name in MODEL_NAMES:
        build_model_on_meta(small_config(name).model, BYTE_VOCAB_SIZE, SEQ_LEN)
    assert len(built) == len(MODEL_NAMES)
    assert all(param.is_meta for model in built for param in model.parameters())


def test_count_parameters_of_a_model_too_large_to_build_here():
    # 48 blocks of width 4096: 9.7e9 parameters, 39 GB in float32, counted without allocating any of it.
    config = load_config(["model.n_layer=48", "model.n_head=32", "model.d_model=4096", "data.seq_len=2048"])
    d_model, n_layer, seq_len, vocab = 4096, 48, 2048, BYTE_VOCAB_SIZE
    per_block = 12 * d_model**2 + 13 * d_model  # qkv and proj 4·d², the 4x MLP 8·d², their biases and two norms
    embeddings_and_head = vocab * d_model + seq_len * d_model + 2 * d_model + d_model * vocab
    on_meta = build_model_on_meta(config.model, vocab, config.data.seq_len)
    assert count_parameters(on_meta) == n_layer * per_block + embeddings_and_head


def test_the_vocabulary_comes_from_the_data_unless_the_config_asks_for_more():
    assert resolved_vocab_size(small_config("gpt").model, data_vocab_size=256) == 256
    assert resolved_vocab_size(small_config("gpt", "model.vocab_size=320").model, data_vocab_size=256) == 320
    assert resolved_vocab_size(small_config("gpt", "model.vocab_size=256").model, data_vocab_size=256) == 256
    with pytest.raises(ConfigError) as caught:
        resolved_vocab_size(small_config("gpt", "model.vocab_size=100").model, data_vocab_size=256)
    assert str(caught.value).startswith("model.vocab_size: ")
    assert "256" in str(caught.value) and "got 100" in str(caught.value)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_model_has_the_vocabulary_it_is_given(name):
    model = build(small_config(name), 320)
    assert model(tokens(rows=2)).shape == (2, SEQ_LEN, 320)


def test_generate_is_optional_the_gpt_has_it_and_the_gru_does_not():
    assert not hasattr(build(small_config("gru"), BYTE_VOCAB_SIZE), "generate")
    gpt = build(small_config("gpt"), BYTE_VOCAB_SIZE).eval()
    prompt = torch.tensor(list(b"def "))
    sample = gpt.generate(prompt, num_new_tokens=5, generator=torch.Generator().manual_seed(0))
    assert sample.shape == (len(prompt) + 5,)
    assert torch.equal(sample[: len(prompt)], prompt)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_describe_names_the_family_and_the_parameter_count(name):
    model = build(small_config(name), BYTE_VOCAB_SIZE)
    text = model.describe()
    assert text.startswith(f"{name}: {total_numel(model):,} parameters (2 layers, d_model 16")
    assert text.endswith("vocab 256)")
    assert model.num_parameters() == total_numel(model)


def test_the_default_gpt_is_described_as_documented():
    model = build(Config(), BYTE_VOCAB_SIZE)
    assert model.describe() == "gpt: 875,264 parameters (4 layers, d_model 128, 4 heads, vocab 256)"


def test_a_gradient_reaches_every_gru_parameter():
    model = build(small_config("gru", "model.dropout=0.1"), BYTE_VOCAB_SIZE)
    model(tokens(rows=2)).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


def test_the_encoder_is_the_gpts_blocks_without_the_causal_mask():
    """One block class for both (accumulation/models/gpt.py's Block): changing the last token changes every
    position's output in the encoder, and no earlier position's in the GPT."""
    config = GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=16, vocab_size=32)
    encoder, gpt = Encoder(config, seed=1), GPT(config, seed=1)
    assert {type(block) for block in encoder.blocks} == {type(block) for block in gpt.blocks} == {Block}
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32
    with torch.no_grad():
        assert not torch.equal(encoder(tokens)[:, 0], encoder(changed)[:, 0])
        assert torch.equal(gpt(tokens)[:, :-1], gpt(changed)[:, :-1])
