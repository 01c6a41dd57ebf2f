"""The figures of docs/accumulation.md: the scripts that draw them write a PNG (short settings here; the
committed figures come from the commands in the guide), and every committed figure is shown in the guide
and small enough to keep in the repository. The gallery's and the sweep's figures are written in
tests/test_pitfalls.py and tests/test_sweep.py."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "docs" / "figures"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(name: str, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "teaching" / name), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def assert_drawn(png_path: Path) -> None:
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    assert png_path.stat().st_size > 10_000  # lines and labels, not an empty canvas


@pytest.mark.integration
@pytest.mark.slow
def test_loss_curves_on_two_ranks_write_the_figure_and_a_row_per_run(tmp_path):
    png_path = tmp_path / "loss_curves.png"
    completed = run_script("loss_curves.py", "--steps", "3", "--seeds", "2", "--png", str(png_path), "--json")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert_drawn(png_path)
    rows = json.loads(completed.stdout)
    assert [row["variant"] for row in rows] == ["correct", "mean of micro-batch means", "per-rank N", "×D forgotten"]
    assert all(len(row["val_loss"]) == 2 for row in rows)  # one value per seed
    # Every variant is paired with the correct run of the same seed, value by value (the same float subtraction,
    # so equal exactly); the correct run's own row is its pairing with itself, zeros.
    correct = rows[0]
    for row in rows:
        for key, difference in (("final_train_loss", "train_minus_correct"), ("val_loss", "val_minus_correct")):
            assert row[difference] == [value - base for value, base in zip(row[key], correct[key], strict=True)]
    assert correct["val_minus_correct"] == [0.0, 0.0]
    # Two seeds are two different runs (weights and data order): their validation losses differ.
    assert rows[0]["val_loss"][0] != rows[0]["val_loss"][1]
    # Three steps from the same weights: the mean of means already moves the weights elsewhere, on each seed.
    assert all(difference != 0.0 for difference in rows[1]["train_minus_correct"])


@pytest.mark.integration
def test_cadence_writes_the_figure_and_same_g_is_one_curve(tmp_path):
    png_path = tmp_path / "cadence.png"
    completed = run_script("cadence.py", "--steps", "3", "--png", str(png_path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert_drawn(png_path)
    difference = float(completed.stdout.splitlines()[-1].rsplit(": ", 1)[1])
    # Same examples, weights and weighting; only fp32 summation order differs (m = 4 vs 16): a few ulps of a
    # loss near 5.5 (1e-6 relative) per step, far below the 1e-3 a different weighting moves it.
    assert difference < 1e-5


def test_every_committed_figure_is_shown_in_the_guide_and_under_200_kb():
    guide = (REPO / "docs" / "accumulation.md").read_text()
    shown = set(re.findall(r"\]\(figures/([\w.-]+\.png)\)", guide))
    committed = {path.name for path in FIGURES.glob("*.png")}
    assert {"pitfalls.png", "loss_curves.png", "sweep_microbatch.png", "cadence.png"} <= committed
    assert shown == committed
    for name in committed:
        assert (FIGURES / name).read_bytes()[:8] == PNG_SIGNATURE
        assert (FIGURES / name).stat().st_size < 200_000, name
