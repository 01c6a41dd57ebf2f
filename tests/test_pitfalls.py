"""The pitfall gallery, run once as a user runs it (`python scripts/teaching/pitfalls.py --json --png PATH`): the
integration tier, since the gallery's own runs take minutes on 2 cores.

The script judges itself (exit status 1 when a twin misbehaves); these tests also judge its JSON with
thresholds of their own, one pair per metric: how close the correct twin must be to its reference, and how
far off the buggy twin must be.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accumulation.models.gpt import GPT
from scripts.teaching import pitfall_cases_rl, pitfall_setup, pitfalls
from testkit import reference as testkit_reference

REPO = Path(__file__).resolve().parent.parent
ACCUMULATION_STEPS = pitfall_setup.ACCUMULATION_STEPS  # A: micro-batches per rank in every step of the gallery
GRADIENT_BYTES = sum(p.numel() * 8 for p in GPT(pitfall_setup.MODEL, seed=0).parameters())  # float64 gradients

# metric -> (the correct twin agrees with its reference, the buggy twin is measurably off), each on one row.
RULES = {
    pitfall_setup.GRADIENT_ERROR: (lambda row: row["correct"] < 1e-10, lambda row: row["buggy"] > 1e-3),
    pitfall_setup.UPDATE_ERROR: (lambda row: row["correct"] < 1e-10, lambda row: row["buggy"] > 1e-3),
    pitfall_cases_rl.OBJECTIVE_ERROR: (lambda row: row["correct"] < 1e-10, lambda row: row["buggy"] > 1e-3),
    pitfall_setup.LOSS_ERROR: (lambda row: row["correct"] < 1e-10, lambda row: row["buggy"] > 1e-3),
    pitfall_setup.LR_ERROR: (lambda row: row["correct"] < 1e-12, lambda row: row["buggy"] > 1e-3),
    pitfall_setup.RANK_DIVERGENCE: (lambda row: row["correct"] == 0, lambda row: row["buggy"] > 1e-3),
    pitfall_setup.ROWS_NOT_ONCE: (lambda row: row["correct"] == 0, lambda row: row["buggy"] >= 1),
    # One all-reduce of every gradient per update, against one per micro-batch.
    pitfall_setup.ALLREDUCE_BYTES: (
        lambda row: row["correct"] == GRADIENT_BYTES,
        lambda row: row["buggy"] == ACCUMULATION_STEPS * GRADIENT_BYTES,
    ),
    # One micro-batch's saved activations at a time, against all A micro-batches' at once.
    pitfall_setup.SAVED_BYTES: (
        lambda row: 0 < row["correct"] * ACCUMULATION_STEPS <= row["buggy"],
        lambda row: row["buggy"] >= 2 * row["correct"],
    ),
}


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    png_path = tmp_path_factory.mktemp("pitfalls") / "gallery.png"
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "teaching" / "pitfalls.py"), "--json", "--png", str(png_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    return completed, png_path


def rows_of(gallery) -> list[dict]:
    completed, _ = gallery
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads(completed.stdout)


@pytest.mark.integration
def test_the_gallery_passes_its_own_checks_and_draws_the_figure(gallery):
    completed, png_path = gallery
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 10_000  # a drawn chart, not an empty canvas


@pytest.mark.integration
def test_json_is_a_list_of_pitfall_metric_buggy_correct(gallery):
    rows = rows_of(gallery)
    assert isinstance(rows, list) and len(rows) >= 20
    for row in rows:
        assert set(row) == {"pitfall", "metric", "buggy", "correct", "cosine", "norm_ratio", "reference"}
        assert isinstance(row["pitfall"], str) and isinstance(row["metric"], str) and row["reference"]
        assert isinstance(row["buggy"], float) and isinstance(row["correct"], float)
        # Direction and scale belong to the rows that compare vectors, and to all of them.
        has_vectors = row["metric"] in (
            pitfall_setup.GRADIENT_ERROR,
            pitfall_cases_rl.OBJECTIVE_ERROR,
            pitfall_setup.UPDATE_ERROR,
        )
        assert (row["cosine"] is not None) == has_vectors == (row["norm_ratio"] is not None), row
    assert len({row["pitfall"] for row in rows}) == len(rows)


def row_named(rows: list[dict], start: str) -> dict:
    [row] = [row for row in rows if row["pitfall"].split(". ", 1)[1].startswith(start)]
    return row


@pytest.mark.integration
def test_the_issue_pitfalls_are_all_there(gallery):
    rows = rows_of(gallery)
    for start in (
        "×D compensation forgotten",
        "partial last group divided by A",
        "same data on every rank",
        "optimizer.step per micro-batch",
        "scaler.update per micro-batch",
        "logged loss of the last micro-batch",
        "sync flag set after the forward",
        "pipeline scale_grads left at its default",
        "pipeline loss normalised after the schedule",
        "pipeline clip norm of one stage",
    ):
        row_named(rows, start)


@pytest.mark.integration
def test_scale_only_bugs_keep_the_direction_and_have_the_predicted_length(gallery):
    """Four bugs multiply the true gradient by one number, worked out from the set-up, not read off the run:
    dividing by A again (1/A), forgetting ×D (1/D), a 2-of-4 partial group divided by A (2/4), and clipping
    s·g at the threshold meant for g (1/s, s = 1024; PyTorch's 1e-6 guard in the clip factor moves it by less
    than 1e-6 relative). Float64 keeps the cosine within 1e-12 of 1."""
    rows = rows_of(gallery)
    expected_ratio = {
        "divided by A on top of N": 1 / ACCUMULATION_STEPS,
        "×D compensation forgotten": 1 / pitfall_setup.WORLD_SIZE,
        "partial last group divided by A": 2 / ACCUMULATION_STEPS,
        "clipped before unscale_": 1 / 1024,
    }
    for start, ratio in expected_ratio.items():
        row = row_named(rows, start)
        assert row["cosine"] == pytest.approx(1.0, abs=1e-12), row
        assert row["norm_ratio"] == pytest.approx(ratio, rel=1e-5), row


@pytest.mark.integration
def test_pipeline_bugs_have_the_predicted_size(gallery):
    """The pipeline rows (2 ranks as P = 2 stages, one replica, the gallery's A = 4 micro-batches holding N
    supervised tokens), predicted from the set-up: the schedule's default scale_grads divides the right
    gradient by A (1/A); backpropagating the raw sum and dividing after the schedule leaves it N · D / D = N
    times too large; each stage clipped to max_norm alone makes the whole gradient √P · max_norm long instead
    of max_norm (every stage's own norm is above the threshold, a tenth of the whole norm), and turns it.
    PyTorch's 1e-6 guard in each clip factor moves that ratio by about 1e-5 relative here."""
    rows = rows_of(gallery)
    tokens_global = pitfall_setup.tokens_in(pitfall_setup.step_batches(pitfall_setup.STEP_IDS))
    for start, ratio in (
        ("pipeline scale_grads left at its default", 1 / ACCUMULATION_STEPS),
        ("pipeline loss normalised after the schedule", tokens_global),
    ):
        row = row_named(rows, start)
        assert row["cosine"] == pytest.approx(1.0, abs=1e-12), row
        assert row["norm_ratio"] == pytest.approx(ratio, rel=1e-9), row
    row = row_named(rows, "pipeline clip norm of one stage")
    assert row["norm_ratio"] == pytest.approx(2**0.5, rel=1e-4), row
    assert row["cosine"] < 0.99, row


@pytest.mark.integration
def test_direction_bugs_turn_the_gradient(gallery):
    """Weighting tokens differently (mean of means, per-rank means) or dropping micro-batches turns the
    vector: the cosine is measurably below 1."""
    rows = rows_of(gallery)
    for start in ("mean of micro-batch means", "no cross-rank token normalization", "zero_grad inside the group"):
        assert row_named(rows, start)["cosine"] < 0.99


@pytest.mark.integration
def test_every_correct_twin_agrees_with_its_reference(gallery):
    for row in rows_of(gallery):
        correct_agrees, _ = RULES[row["metric"]]
        assert correct_agrees(row), row


@pytest.mark.integration
def test_every_buggy_twin_shows_its_bug(gallery):
    for row in rows_of(gallery):
        _, bug_shown = RULES[row["metric"]]
        assert bug_shown(row), row


def test_a_failed_check_is_named_in_the_table():
    """What makes the exit status 1: each way a pair can fail is reported on its own row."""
    measurements = [
        pitfall_setup.Measurement(
            "1. fine", pitfall_setup.GRADIENT_ERROR, 0.5, 1e-16, correct_agrees=True, bug_shown=True, reference="r"
        ),
        pitfall_setup.Measurement(
            "2. loop broken",
            pitfall_setup.GRADIENT_ERROR,
            0.5,
            0.3,
            correct_agrees=False,
            bug_shown=True,
            reference="r",
        ),
        pitfall_setup.Measurement(
            "3. bug hidden", pitfall_setup.SAVED_BYTES, 1000, 1000, correct_agrees=True, bug_shown=False, reference="r"
        ),
    ]
    lines = pitfalls.table(measurements).splitlines()
    assert lines[0].split() == ["pitfall", "metric", "buggy", "correct", "cosine", "norm", "ratio", "check"]
    assert lines[1].endswith("ok")
    assert lines[2].endswith("FAIL: correct twin disagrees")
    assert lines[3].endswith("FAIL: bug not shown") and "1,000" in lines[3]


@pytest.mark.integration
def test_the_guide_quotes_the_gallery_as_measured(gallery):
    """docs/accumulation.md holds the gallery's table: each pitfall's row with the buggy and the correct value,
    the cosine and the norm ratio as printed now. A correct twin's rounding-level residue is printed as its
    bound ("< 1e-14"), never as digits: those depend on the CPU's reduction order, and the guide must hold on
    any machine. So this test also fails if a residue leaves its bound on some CPU."""
    guide_rows = {
        line.split(" | ")[0].strip("| "): line
        for line in (REPO / "docs" / "accumulation.md").read_text().splitlines()
        if line.startswith("| ")
    }
    for row in rows_of(gallery):
        assert row["pitfall"] in guide_rows, row["pitfall"]
        cells = [cell.strip() for cell in guide_rows[row["pitfall"]].strip("| ").split(" | ")]
        printed = [
            pitfalls.number(row["buggy"]),
            pitfalls.correct_cell(row["metric"], row["correct"]),
            pitfalls.optional_number(row["cosine"]),
            pitfalls.optional_number(row["norm_ratio"]),
        ]
        assert cells[-4:] == printed, (row["pitfall"], cells, printed)


@pytest.mark.integration
def test_the_figure_names_each_rows_metric_anchors_ratios_at_1_and_is_readable(gallery, tmp_path):
    from matplotlib.colors import to_rgb
    from matplotlib.text import Text

    measurements = [
        pitfall_setup.Measurement(
            row["pitfall"],
            row["metric"],
            row["buggy"],
            row["correct"],
            True,
            True,
            row["reference"],
            row["cosine"],
            row["norm_ratio"],
        )
        for row in rows_of(gallery)
    ]
    png_path = tmp_path / "pitfalls.png"
    figure = pitfalls.draw(measurements, str(png_path))
    texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert all(t.get_fontsize() >= pitfalls.FONT_PT for t in texts), "a text below the projector's size"
    # Points are pixels at 72 dpi: no wider than the guide's column, the page never shrinks them below FONT_PT.
    from PIL import Image

    assert Image.open(png_path).width <= pitfalls.GUIDE_WIDTH_PX
    # Every text lies inside the figure: a title wider than its panel once ran past the right edge and was cut.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # lays the texts out at the figure's own dpi, as savefig does at its
    renderer, width = canvas.get_renderer(), figure.bbox.width
    written = [*figure.texts, *(t for axes in figure.axes for t in (axes.title, *axes.texts))]  # not the ticks
    for text in (t for t in written if t.get_text().strip()):
        extent = text.get_window_extent(renderer)
        assert extent.x0 >= 0 and extent.x1 <= width, (text.get_text(), extent.x0, extent.x1, width)
    error_axes, cosine_axes, scale_axes = figure.axes[:3]
    row_labels = [label.get_text() for label in error_axes.get_yticklabels()]
    vector_rows = [m for m in measurements if m.metric in pitfalls.RELATIVE_ERRORS]
    assert row_labels == [f"{m.pitfall}\n({m.metric})" for m in vector_rows]  # every row names its metric
    for axes, field in ((cosine_axes, "cosine"), (scale_axes, "norm_ratio")):
        values = [getattr(m, field) for m in vector_rows if getattr(m, field) is not None]
        bars = axes.patches
        assert len(bars) == len(values)
        for bar, value in zip(bars, values, strict=True):
            assert bar.get_x() == 1.0 and bar.get_x() + bar.get_width() == pytest.approx(value)  # from 1 to the value
            # Red only where the buggy twin deviates from the ideal 1.
            assert (to_rgb(bar.get_facecolor()) == to_rgb("tab:red")) == (abs(value - 1) >= 5e-4), (field, value)
    # A correct twin at rounding level or 0 is a marker and its text, never a bar from the axis's floor.
    exact = [m for m in vector_rows if pitfalls.exact_marker_text(m.metric, m.correct) is not None]
    assert exact, "the gallery's correct twins are exact: at least one must be drawn as a marker"
    green_bars = [p for p in error_axes.patches if to_rgb(p.get_facecolor()) == to_rgb("tab:green")]
    assert len(green_bars) == len(vector_rows) - len(exact)
    error_texts = [t.get_text() for t in error_axes.texts]
    for m in exact:
        assert pitfalls.exact_marker_text(m.metric, m.correct) in error_texts
    assert any(text.startswith("< 1e-14") and text.endswith("(rounding)") for text in error_texts)
    assert not any(text.startswith("<") and "exact" in text for text in error_texts)  # a bound is not exact


# ---------------------------------------------------------------------------------------------------------
# The RL rows (26 to 31): each buggy twin is the gradient its bug's formula implies, and the correct twin is exact.
# ---------------------------------------------------------------------------------------------------------


def rl_step_facts():
    """Per-row lengths, micro-batch of each row and the counts the bugs divide by, from the rows' set-up."""
    lengths = torch.tensor(pitfall_cases_rl.COMPLETION_TOKENS, dtype=torch.float64)
    m = pitfall_cases_rl.MICRO_BATCH_SIZE
    micro_batch_tokens = lengths.view(-1, m).sum(dim=1).repeat_interleave(m)  # T_k of each row's micro-batch
    return lengths, micro_batch_tokens, len(lengths) // m  # A on one process


def predicted(row_weights, reference, loss="surrogate"):
    """(relative error, cosine, norm ratio) of ∇ Σ_i c_i Σ_t ℓ_it against the reference: what the bug implies."""
    implied = pitfall_cases_rl.implied_gradient(row_weights, loss)
    cosine, norm_ratio = pitfall_setup.direction_and_scale(implied, reference)
    return testkit_reference.max_relative_error(implied, reference), cosine, norm_ratio


def assert_measured_as_predicted(measurement, prediction):
    # Twin and prediction are float64 gradients of the same weighted sum, summed in other orders (per micro-batch
    # or at once): they differ by a few ulps of the largest entry, while each prediction differs from the
    # correct update by 1e-2 or more. 1e-9 relative leaves six orders of magnitude on either side.
    error, cosine, norm_ratio = prediction
    assert measurement.buggy == pytest.approx(error, rel=1e-9), measurement
    assert measurement.cosine == pytest.approx(cosine, abs=1e-9), measurement
    assert measurement.norm_ratio == pytest.approx(norm_ratio, rel=1e-9), measurement
    assert measurement.correct_agrees and measurement.bug_shown, measurement  # correct within GRADIENT_RTOL


def test_rl_token_mean_per_micro_batch_is_each_micro_batchs_mean_over_a():
    lengths, micro_batch_tokens, accumulation = rl_step_facts()
    reference = pitfall_cases_rl.reference_gradient("token-mean")
    measurement = pitfall_cases_rl.token_mean_per_micro_batch_over_a()
    assert_measured_as_predicted(measurement, predicted(1 / (accumulation * micro_batch_tokens), reference))
    assert measurement.cosine < 0.99  # the weights differ by micro-batch: the direction turns


def test_rl_token_mean_scaled_by_row_share_weighs_each_micro_batch_by_its_rows():
    lengths, _, _ = rl_step_facts()
    weights = torch.empty_like(lengths)
    for first, last in pitfall_cases_rl.token_budget_bounds():
        weights[first:last] = (last - first) / len(lengths) / lengths[first:last].sum()
    assert len({last - first for first, last in pitfall_cases_rl.token_budget_bounds()}) > 1  # rows differ
    reference = pitfall_cases_rl.reference_gradient("token-mean")
    measurement = pitfall_cases_rl.token_mean_scaled_by_row_share()
    assert_measured_as_predicted(measurement, predicted(weights, reference))
    assert measurement.cosine < 0.99


def test_rl_dr_grpo_summed_per_micro_batch_is_m_times_the_objective():
    """Σ_i s_i / (C·A) against Σ_i s_i / (C·|B|): the factor |B|/A = m exactly, the direction unchanged."""
    measurement = pitfall_cases_rl.dr_grpo_sum_over_c_per_micro_batch()
    assert measurement.norm_ratio == pytest.approx(pitfall_cases_rl.MICRO_BATCH_SIZE, rel=1e-12)
    assert measurement.cosine == pytest.approx(1.0, abs=1e-12)  # float64 keeps a parallel pair within 1e-12
    assert measurement.correct_agrees


def test_rl_token_mean_over_the_generation_batch_is_scaled_by_the_steps_share_of_its_tokens():
    lengths, _, _ = rl_step_facts()
    step_tokens = lengths[: pitfall_cases_rl.STEP_ROWS].sum()
    measurement = pitfall_cases_rl.token_mean_over_generation_batch()
    assert measurement.norm_ratio == pytest.approx(float(step_tokens / lengths.sum()), rel=1e-12)  # 26 / 50
    assert measurement.cosine == pytest.approx(1.0, abs=1e-12)
    assert measurement.correct_agrees


def test_rl_prompt_mean_without_1_over_a_is_a_times_the_objective():
    _, _, accumulation = rl_step_facts()
    measurement = pitfall_cases_rl.prompt_mean_without_accumulation_normaliser()
    assert measurement.norm_ratio == pytest.approx(accumulation, rel=1e-12)
    assert measurement.cosine == pytest.approx(1.0, abs=1e-12)
    assert measurement.correct_agrees


@pytest.mark.integration
def test_rl_distillation_per_micro_batch_summed_on_2_ranks_is_the_sum_of_micro_batch_means(gallery):
    """Each rank sums its micro-batches' token means, DDP averages the D ranks: c_i = 1 / (D · T_k(i))."""
    _, micro_batch_tokens, _ = rl_step_facts()
    reference = pitfall_cases_rl.reference_gradient("token-mean", "distillation")
    error, cosine, norm_ratio = predicted(
        1 / (pitfall_setup.WORLD_SIZE * micro_batch_tokens), reference, "distillation"
    )
    row = row_named(rows_of(gallery), "distillation token-mean per micro-batch")
    assert row["buggy"] == pytest.approx(error, rel=1e-9)  # the tolerance of assert_measured_as_predicted
    assert row["cosine"] == pytest.approx(cosine, abs=1e-9)
    assert row["norm_ratio"] == pytest.approx(norm_ratio, rel=1e-9)
    assert row["correct"] < pitfall_setup.GRADIENT_RTOL
