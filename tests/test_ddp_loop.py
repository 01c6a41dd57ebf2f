"""scripts/teaching/ddp_loop.py, the middle step between minimal_loop.py and accumulation/step.py: its loop is
short, it passes its own float64 check on 2 gloo ranks, and each planted bug makes that check fail."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.teaching import ddp_loop
from tests.test_minimal_loop import code_lines

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "teaching" / "ddp_loop.py"


def test_the_loop_from_set_up_to_teardown_has_at_most_60_lines_of_code():
    source = SCRIPT.read_text()
    loop = source[source.index("def train_rank(") : source.index("def float64_reference(")]
    assert code_lines(loop) <= 60


@pytest.mark.integration  # a teaching script's 2-rank runs, each --bug variant spawning its own ranks
def test_the_loop_passes_and_every_planted_bug_fails():
    """One interpreter runs the correct loop and every --bug variant (each spawns its own 2 ranks), so torch is
    imported once: main() returns 0 for PASS and 1 for FAIL, and prints each rank's error against float64."""
    program = (
        "import json, sys\n"
        "from scripts.teaching import ddp_loop\n"
        "codes = {str(bug): ddp_loop.main(['--bug', bug] if bug else []) for bug in (None, *ddp_loop.BUGS)}\n"
        "print(json.dumps(codes))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", program], capture_output=True, text=True, timeout=180, cwd=REPO
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    codes = json.loads(lines[-1])
    assert codes == {"None": 0, **{bug: 1 for bug in ddp_loop.BUGS}}, completed.stdout
    # The correct loop's own lines: both ranks within the tolerance, the number printed.
    correct_errors = [float(line.split(": ")[-1].split()[0]) for line in lines[:2]]
    assert all(error <= ddp_loop.TOLERANCE for error in correct_errors), lines[:3]
    assert lines[2].startswith("PASS")
