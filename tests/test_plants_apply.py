"""Every planted bug of scripts/checks/plant_bugs.py still finds its text: a plant whose text the code no longer
holds is reported "not applicable" only when the whole (15-minute) plant run is made, and until then the tests it
names go unchecked against it."""

from pathlib import Path

import pytest

from scripts.checks.plants import BUGS
from scripts.checks.plants_detectors import DETECTOR_BUGS

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bug", BUGS + DETECTOR_BUGS, ids=[bug.name for bug in BUGS + DETECTOR_BUGS])
def test_each_plant_s_text_occurs_exactly_once_in_its_file(bug):
    text = (REPO / bug.path).read_text()
    assert text.count(bug.old) == 1, f"{bug.path} holds {bug.old!r} {text.count(bug.old)} times: update {bug.name}"
    assert bug.old != bug.new
