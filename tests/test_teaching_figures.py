"""scripts/teaching/figures.py draws the three pictures of docs/accumulation.md from numbers it computes or
measures; these tests check those numbers against the algebra the pictures teach, and that each PNG is
drawn. The committed PNGs are checked by tests/test_figures.py (shown in the guide, under 200 kB)."""

import math

import pytest

from scripts.teaching import figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_three_figures_are_drawn_and_the_timeline_is_measured(tmp_path, capsys):
    assert figures.main(["--out", str(tmp_path)]) == 0
    for name in ("normalization.png", "no_sync_timeline.png", "amp_order.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
        assert (tmp_path / name).stat().st_size > 10_000  # bars and labels, not an empty canvas
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    gradient_bytes = sum(p.numel() * p.element_size() for p in figures.gpt().parameters())
    sent = {name.removeprefix("timeline."): value for name, value in printed.items() if name.startswith("timeline.")}
    # Bytes are counts, the same on every CPU: one all-reduce of the whole gradient where the loop syncs.
    assert sent == {
        "no_sync around forward and backward": f"0 0 0 {gradient_bytes}",
        "forward outside no_sync": " ".join([str(gradient_bytes)] * 4),
        "sync flag set after forward": f"{gradient_bytes} 0 0 0",
    }


def test_the_worked_example_shows_where_times_d_enters():
    example = figures.normalization_example()
    # Python floats of a few small terms: exact up to one rounding, so 1e-12 relative is ample.
    assert example["ddp_mean_with_d"] == pytest.approx(example["true_mean"], rel=1e-12)
    assert example["ddp_mean_without_d"] == pytest.approx(example["true_mean"] / len(figures.TOKENS), rel=1e-12)


def test_the_amp_figure_follows_the_scale_through_the_calls():
    """Float64 and a power-of-two scale: unscale_ divides exactly by s. Right order: the clip brings the true
    gradient to max_norm. Wrong order: the clip brings s·g to max_norm, so the update uses max_norm / s.
    clip_grad_norm_ divides by (norm + 1e-6), which moves a clipped norm by at most 1e-6 relative."""
    amp = figures.amp_call_order()
    right = dict(amp["orders"]["right: unscale_, clip, step, update"])
    wrong = dict(amp["orders"]["wrong: clip before unscale_"])
    scaled = right[f"scale(loss).backward() {figures.ACCUMULATION_STEPS}"]
    assert right["unscale_"] == pytest.approx(scaled / amp["scale"], rel=1e-12)
    assert right["unscale_"] == pytest.approx(amp["true_norm"], rel=1e-10)  # the float64 full-batch norm
    assert right["step (norm used)"] == pytest.approx(amp["max_norm"], rel=1e-5)
    assert wrong["step (norm used)"] == pytest.approx(amp["max_norm"] / amp["scale"], rel=1e-5)
    assert math.isclose(amp["scale"], 1024.0)
