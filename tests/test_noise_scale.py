"""accumulation/noise_scale.py: the gradient noise scale B_simple from the micro-batches of accumulation.

The estimator is checked where the answer is known: on the exact expectations it must return |G|² and tr(Σ)
themselves, and on gradients drawn as G plus Gaussian noise of known covariance its averages must land within
a few standard errors of the truth. The gradients it reads off `.grad` during optimizer_step are compared with
each micro-batch's own mean gradient and the step's, computed independently in float64."""

import copy
import math

import pytest
import torch

from accumulation.noise_scale import MicroBatchGradients, NoiseScale
from accumulation.step import StepSetup, optimizer_step
from testkit.reference import float64_reference_gradient, full_batch_mean_loss
from tests.test_step import CPU, micro_batches, new_model

TRUE_GRADIENT_SQUARED = 0.5  # |G|²
TRUE_TRACE = 20.0  # tr(Σ), per token
DIMENSIONS = 32


def true_gradient_and_variances() -> tuple[torch.Tensor, torch.Tensor]:
    """G with |G|² = TRUE_GRADIENT_SQUARED, and a diagonal Σ of unequal variances summing to TRUE_TRACE."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(DIMENSIONS, generator=generator, dtype=torch.float64)
    gradient *= math.sqrt(TRUE_GRADIENT_SQUARED) / gradient.norm()
    variances = torch.rand(DIMENSIONS, generator=generator, dtype=torch.float64) + 0.1
    return gradient, variances * TRUE_TRACE / variances.sum()


def test_on_the_exact_expectations_the_estimates_are_the_true_values():
    # E|g_B|² = |G|² + tr(Σ) / B for every batch size B: the two estimates solve exactly these equations,
    # so fed the expectations they return the truth, whatever the sizes (float64 rounding only).
    noise_scale = NoiseScale()
    for micro_batch_tokens in ([10, 30, 7, 53], [1, 2, 3], [100, 100]):
        step_tokens = sum(micro_batch_tokens)
        noise_scale.add_step(
            [TRUE_GRADIENT_SQUARED + TRUE_TRACE / tokens for tokens in micro_batch_tokens],
            micro_batch_tokens,
            TRUE_GRADIENT_SQUARED + TRUE_TRACE / step_tokens,
            step_tokens,
        )
    assert noise_scale.gradient_squared == pytest.approx(TRUE_GRADIENT_SQUARED, rel=1e-12)
    assert noise_scale.trace == pytest.approx(TRUE_TRACE, rel=1e-12)
    assert noise_scale.b_simple == pytest.approx(TRUE_TRACE / TRUE_GRADIENT_SQUARED, rel=1e-12)


def test_on_sampled_gradients_the_averages_land_within_five_standard_errors_of_the_truth():
    gradient, variances = true_gradient_and_variances()
    generator = torch.Generator().manual_seed(1)
    steps, accumulation = 3000, 4
    noise_scale = NoiseScale()
    per_step_gradient_squared, per_step_trace = [], []
    for _ in range(steps):
        # Micro-batches of unequal token counts, as padded documents give; a token-mean gradient of N_k
        # independent tokens is G plus noise of covariance Σ / N_k, and the step's is their token-weighted mean.
        tokens = torch.randint(5, 60, (accumulation,), generator=generator)
        noise = torch.randn(accumulation, DIMENSIONS, generator=generator, dtype=torch.float64)
        micro_gradients = gradient + noise * (variances / tokens[:, None]).sqrt()
        step_gradient = (tokens[:, None] * micro_gradients).sum(0) / tokens.sum()
        arguments = (
            micro_gradients.square().sum(1).tolist(),
            tokens.tolist(),
            float(step_gradient.square().sum()),
            int(tokens.sum()),
        )
        noise_scale.add_step(*arguments)
        one_step = NoiseScale()
        one_step.add_step(*arguments)
        per_step_gradient_squared.append(one_step.gradient_squared)
        per_step_trace.append(one_step.trace)

    # The steps are independent, so the standard error of each average is the per-step estimates' standard
    # deviation over √steps. Every pair gives an estimate, so the running average is the mean of the per-step
    # ones. Five standard errors: an unbiased estimator misses by that much with probability below 1e-6.
    def within_five_standard_errors(per_step: list[float], average: float, truth: float) -> float:
        values = torch.tensor(per_step, dtype=torch.float64)
        assert average == pytest.approx(float(values.mean()), rel=1e-9)
        standard_error = float(values.std()) / math.sqrt(steps)
        assert abs(average - truth) < 5 * standard_error
        return standard_error

    gradient_error = within_five_standard_errors(
        per_step_gradient_squared, noise_scale.gradient_squared, TRUE_GRADIENT_SQUARED
    )
    trace_error = within_five_standard_errors(per_step_trace, noise_scale.trace, TRUE_TRACE)
    # B_simple is the ratio of the two averages, so it lies between the ratios of their five-error bounds.
    low = (TRUE_TRACE - 5 * trace_error) / (TRUE_GRADIENT_SQUARED + 5 * gradient_error)
    high = (TRUE_TRACE + 5 * trace_error) / (TRUE_GRADIENT_SQUARED - 5 * gradient_error)
    assert low < noise_scale.b_simple < high
    # The test has the power to see a wrong estimator: the band is narrow next to a factor off.
    assert high / low < 1.5


def test_a_step_without_two_sizes_gives_no_estimate():
    noise_scale = NoiseScale()
    assert math.isnan(noise_scale.b_simple)
    noise_scale.add_step([2.0], [40], 2.0, 40)  # A = 1: the micro-batch is the step
    noise_scale.add_step([0.0, 3.0], [0, 40], 3.0, 40)  # the other holds every token
    assert noise_scale.pairs == 0 and math.isnan(noise_scale.b_simple)


def test_the_gradients_read_off_grad_are_each_micro_batch_own_mean_and_the_step_s():
    # Unequal token counts per micro-batch (rows supervise 1 to 8 positions), and one micro-batch with none.
    counts = [[8, 3], [1, 0], [0, 0], [5, 7]]
    batches = micro_batches(counts, seed=3)
    model = new_model()  # float64
    # The reference first, on an untouched copy: PyTorch's own mean loss of each micro-batch alone, and of all.
    reference = copy.deepcopy(model)
    expected_micro = []
    for batch, rows_counts in zip(batches, counts, strict=True):
        reference.zero_grad(set_to_none=True)
        if sum(rows_counts) == 0:  # no supervised token: no mean gradient, reported as 0.0
            expected_micro.append(0.0)
            continue
        full_batch_mean_loss(reference(batch.inputs), batch.labels).backward()
        expected_micro.append(sum(float(p.grad.square().sum()) for p in reference.parameters()))
    expected_step = sum(float(grad.square().sum()) for grad in float64_reference_gradient(model, batches))

    gradients = MicroBatchGradients(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer_step(StepSetup(model, CPU), batches, optimizer)
    micro_squared, step_squared = gradients.finish_step([sum(c) for c in counts])
    gradients.remove()

    # float64: the micro-batch's gradient is a difference of two float64 sums, off by a few ulps of the
    # larger, and (N / N_k)² scales that; 1e-9 relative is far below a wrong factor such as N / N_k (≥ 2 here).
    assert micro_squared[2] == 0.0
    assert micro_squared == pytest.approx(expected_micro, rel=1e-9)
    assert step_squared == pytest.approx(expected_step, rel=1e-9)


def test_finish_step_refuses_tokens_of_a_different_number_of_micro_batches():
    model = new_model()
    batches = micro_batches([[4], [2]], seed=1)
    gradients = MicroBatchGradients(model)
    optimizer_step(StepSetup(model, CPU), batches, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="saw 2 backwards"):
        gradients.finish_step([4, 2, 1])
