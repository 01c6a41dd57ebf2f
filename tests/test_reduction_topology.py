"""scripts/teaching/reduction_topology.py: every reduction topology of accumulation.md section 22 on 4 gloo
ranks. The right factor lands on the float64 full batch, each wrong factor f_wrong is off by exactly
|f_wrong / f - 1| (the reduction is linear, so a factor on the loss is a factor on the update), FSDP2's switches
change the counts of its collectives and nothing else, and the guide quotes the table as measured.
About 47 s on 2 shared cores (4 ranks, 10 layouts, each twice): the integration tier."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.teaching import reduction_topology

REPO = Path(__file__).resolve().parent.parent
# The update is read as weights after minus before: a few 1e-14 of its largest entry is the weights' own
# rounding (the script's ROUNDING_BOUND says why); a wrong factor costs 0.5 or more.
RTOL = reduction_topology.ROUNDING_BOUND

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rows() -> dict:
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "teaching" / "reduction_topology.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return {row["layout"]: row for row in json.loads(completed.stdout)}


def test_every_layout_is_exact_with_its_right_factor(rows):
    assert set(rows) == set(reduction_topology.LAYOUTS)
    for name, row in rows.items():
        assert row["right_error"] < RTOL, (name, row["right_error"])


def test_a_wrong_factor_scales_the_update_by_its_ratio(rows):
    for name, row in rows.items():
        if isinstance(row["wrong_factor"], str):
            continue
        expected = abs(row["wrong_factor"] / row["right_factor"] - 1)
        assert row["wrong_error"] == pytest.approx(expected, abs=RTOL), name


def test_n_counted_per_cp_rank_is_not_a_scale_and_is_wrong(rows):
    # Rows supervise their first 1 to 8 positions: the second CP rank's half holds fewer targets, so it
    # divides by a smaller count and its tokens weigh more. Not a factor on the whole update.
    row = rows["CP 2 x 2, N counted over data ranks only"]
    assert row["wrong_error"] > 0.1
    assert all(abs(row["wrong_error"] - abs(k - 1)) > 0.01 for k in (0.5, 2, 4))


def test_fsdp2_switches_change_only_the_collectives(rows):
    units, accumulation = 3, reduction_topology.ACCUMULATION_STEPS  # three FSDP2 units hold parameters
    every = rows["FSDP2, reduce-scatter in every micro-batch"]
    deferred = rows["FSDP2, deferred (gradient sync, reshard after backward)"]
    assert every["reduce_scatters"] == units * accumulation and deferred["reduce_scatters"] == units
    assert deferred["all_gathers"] < every["all_gathers"]  # parameters kept gathered between micro-batches
    hsdp = rows["HSDP 2 x 2, all-reduce in every micro-batch"]
    hsdp_once = rows["HSDP 2 x 2, set_requires_all_reduce(last only)"]
    assert hsdp["reduce_scatters"] == hsdp_once["reduce_scatters"] == units * accumulation
    assert hsdp["all_reduces"] == units * accumulation and hsdp_once["all_reduces"] == units


def test_the_guide_quotes_the_table_as_measured(rows):
    guide = (REPO / "docs" / "accumulation.md").read_text()
    section = guide[guide.index("## 22.") :]
    for name, row in rows.items():
        [line] = [line for line in section.splitlines() if line.startswith(f"| {name} |")]
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[-2] == f"{row['wrong_error']:.3g}", (name, cells)
        assert cells[-4] == f"< {RTOL:.0e}", (name, cells)
    assert re.search(r"python scripts/teaching/reduction_topology\.py", section)
