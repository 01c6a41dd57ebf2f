"""Sampling from a trained run (accumulation/run/sample.py, scripts/operations/sample.py): the next-token
distribution against hand-computed ones (temperature, top-p), greedy decoding against argmax decoding written
here, the same text under the same seed, the end-of-run sample of a run on nanoGPT's character-level token files,
and bad input in one line."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from accumulation.config.config import load_config
from accumulation.models.factory import build_model
from accumulation.run.sample import next_token_distribution, sample_tokens
from scripts.operations import sample
from tests.test_train import tiny_settings, uneven_corpus

# Probabilities that are powers of two, in a shuffled order; their logits are their logarithms.
HAND = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625], dtype=torch.float64)
LOGITS = HAND.log()
# The softmax of log(p) returns p up to rounding (a few ulps of 1, about 1e-16): 1e-12 bounds it with room.
ROUNDING = 1e-12


def test_temperature_one_is_the_softmax_and_temperature_two_its_square_root_renormalised():
    assert torch.allclose(next_token_distribution(LOGITS, 1.0, 1.0), HAND, rtol=0, atol=ROUNDING)
    root = HAND.sqrt() / HAND.sqrt().sum()  # softmax(log p / 2) = sqrt(p) / sum sqrt(p)
    assert torch.allclose(next_token_distribution(LOGITS, 2.0, 1.0), root, rtol=0, atol=ROUNDING)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        # Sorted: 0.5 (id 1), 0.25 (id 3), 0.125 (id 0), 0.0625, 0.0625. The smallest prefix with mass >= p:
        (0.3, {1: 1.0}),  # 0.5 >= 0.3
        (0.7, {1: 0.5 / 0.75, 3: 0.25 / 0.75}),  # 0.5 < 0.7 <= 0.75
        (0.8, {1: 0.5 / 0.875, 3: 0.25 / 0.875, 0: 0.125 / 0.875}),  # 0.75 < 0.8 <= 0.875
        (1.0, {1: 0.5, 3: 0.25, 0: 0.125, 2: 0.0625, 4: 0.0625}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_of_the_sorted_distribution_with_mass_at_least_p(top_p, kept):
    """Values of p away from the prefix masses (0.5, 0.75, 0.875): at a mass exactly p the softmax's rounding
    could fall either side."""
    expected = torch.zeros(5, dtype=torch.float64)
    for token, probability in kept.items():
        expected[token] = probability
    assert torch.allclose(next_token_distribution(LOGITS, 1.0, top_p), expected, rtol=0, atol=ROUNDING)


def test_the_distribution_tends_to_the_argmax_as_the_temperature_falls():
    logits = torch.tensor([0.0, 0.1, 0.3, 0.2])
    assert torch.equal(next_token_distribution(logits, 0.0, 1.0), torch.tensor([0.0, 0.0, 1.0, 0.0]).double())
    # At T = 1e-3 the runner-up has exp(-0.1 / 1e-3) = e^-100 of the argmax's mass: 1.0 in float64.
    assert next_token_distribution(logits, 1e-3, 1.0)[2] == 1.0


def small_model() -> torch.nn.Module:
    config = load_config(["model.n_layer=1", "model.d_model=16", "model.n_head=2"])
    return build_model(config.model, 256, seq_len=16, seed=3).eval()


def test_temperature_zero_is_argmax_decoding():
    model = small_model()
    tokens = [104, 105]  # the reference: the argmax of the last position's logits, appended, 20 times
    with torch.no_grad():
        for _ in range(20):
            tokens.append(int(model(torch.tensor([tokens[-16:]]))[0, -1].argmax()))
    generator = torch.Generator().manual_seed(0)
    greedy = sample_tokens(model, [104, 105], 20, context_tokens=16, generator=generator, temperature=0.0)
    assert greedy == tokens


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    model = small_model()

    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return sample_tokens(model, [104], 30, context_tokens=16, generator=generator, temperature=1.0, top_p=0.9)

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)  # 30 draws from a nearly uniform 256-way distribution: equal with odds ~256^-30


# -------------------------------------------------------------------------------- scripts/operations/sample.py


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("run")
    corpus = uneven_corpus(tmp_path / "corpus")
    assert train.main(tiny_settings(tmp_path, corpus, **{"run.max_steps": 2, "run.sample_bytes": 0})) == 0
    return tmp_path / "runs" / "default"


def test_the_script_samples_the_same_text_under_a_seed_and_greedy_text_at_temperature_zero(trained_run, capsys):
    arguments = [str(trained_run), "--prompt", "ab", "--tokens", "12", "--seed", "5"]
    assert sample.main(arguments) == 0
    first = capsys.readouterr()
    assert sample.main(arguments) == 0
    assert capsys.readouterr().out == first.out and first.out.startswith("ab")
    assert "step_000002.pt (step 2)" in first.err or "latest.pt (step 2)" in first.err
    # Temperature 0: the continuation the model's argmax gives, from the checkpoint's weights
    assert sample.main([str(trained_run), "--prompt", "ab", "--tokens", "12", "--temperature", "0"]) == 0
    model = small_model()  # the tiny run's shape
    model.load_state_dict(torch.load(trained_run / "checkpoints" / "latest.pt", weights_only=True)["model"])
    tokens = list(b"ab")
    with torch.no_grad():
        for _ in range(12):
            tokens.append(int(model(torch.tensor([tokens[-16:]]))[0, -1].argmax()))
    expected = bytes(tokens).decode("utf-8", errors="replace")
    assert capsys.readouterr().out == expected + "\n"


def test_bad_input_is_one_line_and_exit_2(tmp_path, trained_run, capsys):
    empty_run = tmp_path / "empty"
    (empty_run / "checkpoints").mkdir(parents=True)
    damaged = tmp_path / "damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    (damaged / "checkpoints" / "latest.pt").write_bytes(b"not a checkpoint")
    cases = {
        str(tmp_path / "nowhere"): "is not a run directory",
        str(tmp_path): "is not a run directory",
        str(empty_run): "holds no checkpoint yet",
        str(damaged): "cannot be read",
    }
    for run_dir, message in cases.items():
        assert sample.main([run_dir, "--prompt", "a"]) == 2
        error = capsys.readouterr().err
        assert error.startswith("error: ") and message in error and error.count("\n") == 1, error
    assert sample.main([str(trained_run), "--prompt", ""]) == 2
    assert "encodes to no token" in capsys.readouterr().err


def nanogpt_characters(folder: Path, text: str) -> Path:
    """nanoGPT's shakespeare_char layout: train.bin and val.bin (uint16 character ids), meta.pkl with vocab_size,
    itos and stoi."""
    characters = sorted(set(text))
    stoi = {character: index for index, character in enumerate(characters)}
    folder.mkdir(parents=True)
    ids = np.array([stoi[character] for character in text], dtype="<u2")
    cut = len(ids) * 9 // 10
    (folder / "train.bin").write_bytes(ids[:cut].tobytes())
    (folder / "val.bin").write_bytes(ids[cut:].tobytes())
    meta = {"vocab_size": len(characters), "itos": dict(enumerate(characters)), "stoi": stoi}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return folder


def test_a_run_on_nanogpt_character_files_gets_its_sample_at_the_end_and_from_the_script(tmp_path, capsys):
    text = "to be or not to be, that is the question. " * 60
    folder = nanogpt_characters(tmp_path / "shakespeare_char", text)
    settings = {"run.max_steps": 2, "run.sample_bytes": 10, "data.val_fraction": 0.0}
    assert train.main(tiny_settings(tmp_path, folder, **settings)) == 0
    out = capsys.readouterr().out
    sampled = out.split("sample:\n")[1].splitlines()[0]
    assert set(sampled) <= set(text) and len(sampled) >= 10  # characters of the vocabulary, the prompt's included
    run_dir = str(tmp_path / "runs" / "default")
    assert sample.main([run_dir, "--prompt", "to be", "--tokens", "7"]) == 0
    continued = capsys.readouterr().out
    assert continued.startswith("to be") and len(continued) == len("to be") + 7 + 1 and set(continued[:-1]) <= set(text)
    assert sample.main([run_dir, "--prompt", "to be!"]) == 2  # "!" is not in the vocabulary
    error = capsys.readouterr().err
    assert error == "error: --prompt: the characters '!' are not in meta.pkl's vocabulary (stoi)\n"
