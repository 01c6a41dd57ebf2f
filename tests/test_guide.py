"""The guide quotes numbers; each must be one that scripts/guide_numbers.py computes with the project's code."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_number_the_script_prints_appears_in_the_guide():
    printed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "guide_numbers.py")], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    guide = (REPO / "docs" / "accumulation.md").read_text()
    values = dict(line.split(": ", 1) for line in printed.strip().splitlines())
    assert len(values) >= 10
    for name, value in values.items():
        # The value as a whole number or phrase: "3.5" must not be satisfied by "13.5".
        assert re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", guide), f"{name} = {value} is not in the guide"


def test_readme_links_the_guide():
    assert "docs/accumulation.md" in (REPO / "README.md").read_text()
