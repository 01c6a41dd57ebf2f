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


def readable_texts(figure) -> list:
    """Every visible, non-empty text of a drawn figure: titles, labels, tick labels, annotations, legends."""
    from matplotlib.text import Text

    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]


def assert_readable(figure, minimum_pt: float) -> None:
    """Text on a projector: each at least `minimum_pt` points at the figure's saved size (sizes are in points
    of the figure's inches, so they hold at any dpi)."""
    small = [(t.get_text(), t.get_fontsize()) for t in readable_texts(figure) if t.get_fontsize() < minimum_pt]
    assert not small, f"texts below {minimum_pt} pt: {small[:5]}"


def is_red(colour) -> bool:
    from matplotlib.colors import to_rgb

    return to_rgb(colour) == to_rgb("tab:red")


def test_the_diagrams_are_readable_and_red_marks_only_what_is_wrong(tmp_path):
    gradient_bytes = 1000
    sent = {
        "no_sync around forward and backward": [0, 0, 0, gradient_bytes],
        "forward outside no_sync": [gradient_bytes] * 4,
        "sync flag set after forward": [gradient_bytes, 0, 0, 0],
    }
    timeline = figures.draw_timeline(sent, gradient_bytes, tmp_path / "timeline.png")
    normalization = figures.draw_normalization(figures.normalization_example(), tmp_path / "normalization.png")
    amp = figures.draw_amp_order(figures.amp_call_order(), tmp_path / "amp.png")
    for figure in (timeline, normalization, amp):
        assert_readable(figure, figures.FONT_PT)
        for axes in figure.axes:
            assert axes.get_ylabel() or axes.get_yticklabels(), "an axis without a label"
    # The timeline: one box per backward; red exactly where a loop differs from the correct first row.
    [axes] = timeline.axes
    boxes = [p for p in axes.patches if p.get_width() > 0.5]
    red_rows = {round(p.get_y() + p.get_height() / 2) for p in boxes if is_red(p.get_facecolor())}
    assert red_rows == {1, 2}  # never the correct loop
    red_in_row = {
        row: sum(1 for p in boxes if is_red(p.get_facecolor()) and round(p.get_y() + 0.4) == row) for row in (1, 2)
    }
    assert red_in_row == {1: 3, 2: 2}  # three extra all-reduces; one extra and one missing
    # amp_order: the right order's line is drawn wider and underneath, so the dashed wrong line on top
    # leaves it visible where the two coincide; every legend entry names a line with points.
    [axes] = amp.axes
    right, wrong = axes.get_lines()[:2]
    assert right.get_linewidth() > 2 * wrong.get_linewidth() and right.get_zorder() < wrong.get_zorder()
    lines = {line.get_label(): line for line in axes.get_lines()}
    for text in axes.get_legend().get_texts():
        assert len(lines[text.get_text()].get_xdata()) > 0


def test_the_cadence_figure_is_readable_with_units_on_its_axes(tmp_path):
    from scripts.teaching import cadence

    curves = {(32, 4): [3.0, 2.5, 2.2], (32, 16): [3.0, 2.5, 2.2], (8, 4): [3.0, 2.8, 2.7], (64, 16): [3.0, 2.4, 2.0]}
    figure = cadence.draw(curves, str(tmp_path / "cadence.png"))
    assert_readable(figure, cadence.FONT_PT)
    by_updates, by_examples = figure.axes
    assert "nats per token" in by_updates.get_ylabel()
    assert by_updates.get_xlabel() == "optimizer updates" and by_examples.get_xlabel() == "examples seen"
    labels = {line.get_label() for line in by_updates.get_lines()}
    assert {text.get_text() for text in by_updates.get_legend().get_texts()} <= labels


def test_the_loss_curves_figure_is_readable(tmp_path):
    """The figure's layout on two made-up runs per variant (its numbers come from the script's real runs)."""
    from scripts.teaching import loss_curves

    def runs(offset: float) -> list[dict]:
        return [{"train": [3.0 + offset, 2.5 + offset, 2.2 + offset], "val": 2.0 + offset} for _ in range(2)]

    curves = {variant: runs(0.01 * k) for k, variant in enumerate(["correct", "mean of means", "per-rank N", "x D"])}
    figure = loss_curves.draw(curves, str(tmp_path / "loss_curves.png"))
    assert_readable(figure, figures.FONT_PT)
