"""The pitfall gallery, run once as a user runs it (`python scripts/pitfalls.py --json --png PATH`).

The script judges itself (exit status 1 when a twin misbehaves); these tests also judge its JSON with
thresholds of their own, one pair per metric: how close the correct twin must be to its reference, and how
far off the buggy twin must be.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from accumulation.model import GPT
from scripts import pitfalls

REPO = Path(__file__).resolve().parent.parent
ACCUMULATION_STEPS = pitfalls.ACCUMULATION_STEPS  # A: micro-batches per rank in every step of the gallery
GRADIENT_BYTES = sum(p.numel() * 8 for p in GPT(pitfalls.MODEL, seed=0).parameters())  # float64 gradients

# metric -> (the correct twin agrees with its reference, the buggy twin is measurably off), each on one row.
RULES = {
    pitfalls.GRADIENT_ERROR: (lambda row: row["correct"] < 1e-10, lambda row: row["buggy"] > 1e-3),
    pitfalls.LR_ERROR: (lambda row: row["correct"] < 1e-12, lambda row: row["buggy"] > 1e-3),
    pitfalls.RANK_DIVERGENCE: (lambda row: row["correct"] == 0, lambda row: row["buggy"] > 1e-3),
    pitfalls.ROWS_NOT_ONCE: (lambda row: row["correct"] == 0, lambda row: row["buggy"] >= 1),
    # One all-reduce of every gradient per update, against one per micro-batch.
    pitfalls.ALLREDUCE_BYTES: (
        lambda row: row["correct"] == GRADIENT_BYTES,
        lambda row: row["buggy"] == ACCUMULATION_STEPS * GRADIENT_BYTES,
    ),
    # One micro-batch's saved activations at a time, against all A micro-batches' at once.
    pitfalls.SAVED_BYTES: (
        lambda row: 0 < row["correct"] * ACCUMULATION_STEPS <= row["buggy"],
        lambda row: row["buggy"] >= 2 * row["correct"],
    ),
}


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    png_path = tmp_path_factory.mktemp("pitfalls") / "gallery.png"
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pitfalls.py"), "--json", "--png", str(png_path)],
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


def test_the_gallery_passes_its_own_checks_and_draws_the_figure(gallery):
    completed, png_path = gallery
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 10_000  # a drawn chart, not an empty canvas


def test_json_is_a_list_of_pitfall_metric_buggy_correct(gallery):
    rows = rows_of(gallery)
    assert isinstance(rows, list) and len(rows) >= 12
    for row in rows:
        assert set(row) == {"pitfall", "metric", "buggy", "correct"}
        assert isinstance(row["pitfall"], str) and isinstance(row["metric"], str)
        assert isinstance(row["buggy"], float) and isinstance(row["correct"], float)
    assert len({row["pitfall"] for row in rows}) == len(rows)


def test_every_correct_twin_agrees_with_its_reference(gallery):
    for row in rows_of(gallery):
        correct_agrees, _ = RULES[row["metric"]]
        assert correct_agrees(row), row


def test_every_buggy_twin_shows_its_bug(gallery):
    for row in rows_of(gallery):
        _, bug_shown = RULES[row["metric"]]
        assert bug_shown(row), row


def test_a_failed_check_is_named_in_the_table():
    """What makes the exit status 1: each way a pair can fail is reported on its own row."""
    measurements = [
        pitfalls.Measurement("1. fine", pitfalls.GRADIENT_ERROR, 0.5, 1e-16, correct_agrees=True, bug_shown=True),
        pitfalls.Measurement("2. loop broken", pitfalls.GRADIENT_ERROR, 0.5, 0.3, correct_agrees=False, bug_shown=True),
        pitfalls.Measurement("3. bug hidden", pitfalls.SAVED_BYTES, 1000, 1000, correct_agrees=True, bug_shown=False),
    ]
    lines = pitfalls.table(measurements).splitlines()
    assert lines[0].split() == ["pitfall", "metric", "buggy", "correct", "check"]
    assert lines[1].endswith("ok")
    assert lines[2].endswith("FAIL: correct twin disagrees")
    assert lines[3].endswith("FAIL: bug not shown") and "1,000" in lines[3]


def test_the_guide_quotes_the_gallery_as_measured(gallery):
    """docs/accumulation.md holds the gallery's table: each pitfall's row with the buggy value printed now."""
    guide_rows = {
        line.split(" | ")[0].strip("| "): line
        for line in (REPO / "docs" / "accumulation.md").read_text().splitlines()
        if line.startswith("| ")
    }
    for row in rows_of(gallery):
        assert row["pitfall"] in guide_rows, row["pitfall"]
        assert f"| {pitfalls.number(row['buggy'])} |" in guide_rows[row["pitfall"]], row["pitfall"]
