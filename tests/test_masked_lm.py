"""The masked-LM fork's rows (accumulation/data/masked_lm.py): BERT's 15% with 80/10/10, fresh every step, a pure
function of (seed, step, row id), supervised exactly where masked."""

import torch

from accumulation.config.config import load_config
from accumulation.data.masked_lm import MASK_FRACTION
from accumulation.data.sources import build_data
from accumulation.data.uniforms import step_uniforms
from tests.conformance.tokens import REPO, write_token_folder


def masked_rows(tmp_path, seed: int = 1337):
    tokens = write_token_folder(tmp_path)
    config = load_config(["--config", str(REPO / "configs" / "mlm.toml"), f"data.source={tokens}", f"run.seed={seed}"])
    return build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed).train


def test_fifteen_percent_masked_80_10_10_and_only_the_masked_supervised(tmp_path):
    rows = masked_rows(tmp_path)
    row_ids = torch.arange(rows.num_rows)  # 2,637 rows of 64 positions: 168,768 draws
    original = torch.stack([torch.from_numpy(rows.packed.window(i)[:64].astype("int64")) for i in row_ids.tolist()])
    inputs, labels = rows.examples(row_ids, 3)
    masked = labels != -100
    positions = masked.numel()
    # Binomial: the standard deviation of the fraction is sqrt(p(1-p)/n) = 0.0009 for n = 168,768; 0.006 is 7.
    assert abs(masked.sum() / positions - MASK_FRACTION) < 0.006
    assert torch.equal(labels[masked], original[masked])  # the target is the original token
    assert torch.equal(inputs[~masked], original[~masked])  # unmasked positions read their own token
    mask_token, masked_count = rows.mask_token, int(masked.sum())
    share_mask = int((inputs[masked] == mask_token).sum()) / masked_count
    share_kept = int((inputs[masked] == original[masked]).sum()) / masked_count
    # About 25,000 masked positions: standard deviations 0.0025 (80%) and 0.0019 (10%); 7 of them. A random
    # replacement equals the original token 1 time in 256, so "kept" is 10% + 10%/256.
    assert abs(share_mask - 0.8) < 0.018 and abs(share_kept - 0.1) < 0.013
    assert int((inputs == mask_token).sum()) == int((inputs[masked] == mask_token).sum())


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return float(((x - x.mean()) * (y - y.mean())).mean() / (x.std() * y.std()))


def test_every_position_is_masked_independently_of_its_neighbours_its_column_and_the_last_step(tmp_path):
    """The fraction alone passes a correlated mask by luck (one such bug missed 0.006 by 0.0004): a mask whose
    positions are drawn together has the right mean and the wrong spread. Independent Bernoulli(p) positions
    give each row's count the binomial variance 64·p·(1-p) = 8.16, each position's mean over R rows the variance
    p(1-p)/R, and zero correlation between neighbours and between two steps' masks; the bounds are 7 standard
    deviations of those statistics, and a correlation of 0.01 between a row's positions moves the first by 5."""
    rows = masked_rows(tmp_path)
    row_ids = torch.arange(rows.num_rows)
    masked = torch.from_numpy(rows.masked(row_ids, 3)).double()  # [2,637 rows, 64 positions]
    count_rows, positions = masked.shape
    p = MASK_FRACTION
    # The sample variance of R binomial counts has a standard deviation of about var·sqrt(2/R) = 0.22.
    assert abs(float(masked.sum(dim=1).var()) - positions * p * (1 - p)) < 1.6
    # 64 column means, each of variance p(1-p)/R = 4.8e-5: their sample variance deviates by about 4.8e-5·sqrt(2/63).
    column_variance = p * (1 - p) / count_rows
    assert float(masked.mean(dim=0).var()) < column_variance * (1 + 7 * (2 / (positions - 1)) ** 0.5)
    # A correlation over n independent pairs has standard deviation 1/sqrt(n): 0.0024 here.
    assert abs(correlation(masked[:, :-1], masked[:, 1:])) < 0.017
    assert abs(correlation(masked, torch.from_numpy(rows.masked(row_ids, 4)))) < 0.017


def test_the_mask_is_fresh_every_step_and_the_same_for_the_same_seed_step_and_row(tmp_path):
    rows = masked_rows(tmp_path)
    row_ids = torch.tensor([5, 900, 17])
    at_step_1, again = rows.examples(row_ids, 1), rows.examples(row_ids.flip(0), 1)
    assert torch.equal(at_step_1[1], again[1].flip(0))  # another order of the same rows: the same masks
    assert not torch.equal(at_step_1[1], rows.examples(row_ids, 2)[1])  # another step: another mask
    (tmp_path / "other").mkdir()
    other_seed = masked_rows(tmp_path / "other", seed=7)
    assert not torch.equal(at_step_1[1], other_seed.examples(row_ids, 1)[1])


def test_step_uniforms_are_uniform_and_a_function_of_their_arguments():
    row_ids = torch.arange(1000)
    draws = step_uniforms(1, 2, row_ids, 50)
    assert draws.shape == (1000, 50) and 0 <= draws.min() and draws.max() < 1
    assert abs(draws.mean() - 0.5) < 0.005  # standard deviation 0.0013 for 50,000 uniforms
    assert (step_uniforms(1, 2, row_ids[[7]], 50) == draws[7]).all()
    # Another seed, step or stream: independent draws, E(x - y)^2 = 1/6 (standard deviation of the mean 0.0009).
    for seed, step, stream in [(2, 2, 0), (1, 3, 0), (1, 2, 1)]:
        other = step_uniforms(seed, step, row_ids, 50, stream)
        assert abs(float(((other - draws) ** 2).mean()) - 1 / 6) < 0.005
