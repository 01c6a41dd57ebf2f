"""scripts/teaching/noise_scale.py, the guide's measured noise scale (section 15), at a short length: it trains
the default config with optimizer_step, reads every step's gradient off `.grad` with the norm optimizer_step
reports, and gives a finite, positive B_simple from its 8 micro-batches per step. About a minute on 2 shared
cores (20 steps of the default GPT, and building the embedded corpus): the integration tier."""

import math

import pytest

from scripts.teaching import noise_scale as noise_scale_script

pytestmark = pytest.mark.integration


def test_the_script_measures_a_finite_noise_scale_from_the_run_s_own_gradients():
    results = noise_scale_script.measure(steps=20, window=10)
    # The step's squared norm summed in float64 from fp32 .grad against clip_grad_norm's fp32 norm of the same
    # gradient: the summation order differs, about 1e-6 relative; a gradient missing a micro-batch's
    # contribution or read after clipping would be off by far more than 1e-4.
    assert results["largest_norm_mismatch"] < 1e-4
    windows = results["windows"]
    assert [window["steps"] for window in windows] == [(0, 10), (10, 20)]
    # Early in training the gradient is large against its noise: both averages are positive and their ratio
    # is a finite number of tokens, far below the tokens of one step (the script prints about 250 at steps
    # 10-20), as are the ratios from the window's even and odd steps apart.
    for window in windows:
        assert window["gradient_squared"] > 0 and window["trace"] > 0
        for b_simple in (window["b_simple_tokens"], *window["b_simple_tokens_even_odd"]):
            assert 0 < b_simple < results["global_batch_tokens"]
        assert math.isclose(
            window["b_simple_examples"], window["b_simple_tokens"] / window["tokens_per_example"], rel_tol=1e-12
        )
        # Documents of the embedded corpus, one per row of 128 positions: at most 128 supervised tokens per row.
        assert 1 < window["tokens_per_example"] <= 128
