"""The executable framework cards (scripts/teaching/framework_cards.py): each framework's own accumulation path,
one SGD step on the cards' tiny float64 model, against the float64 full batch. Integration tier (python -m pytest
-m integration): each framework imports for 5-20 s, and the Trainer's 2-rank cards start 2 processes twice
(about 2 minutes). A framework that is not installed is skipped with the reason (pip install -r
requirements-cards.txt torch==2.13.0; .ci/run installs it)."""

import importlib.util
from pathlib import Path

import pytest

from scripts.teaching import framework_cards as cards

FRAMEWORKS = sorted({card.framework for card in cards.all_cards()})
# A bug on these rows moves the update by 3 % or more (the smallest, row 11's position-0 count, by 2 of 63
# targets); a correct path agrees to float32 rounding, cards.MATCH_RTOL.
BUG_MIN = 1e-2
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "accumulation.md"


@pytest.mark.integration
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_setting_is_the_token_mean_or_its_gallery_rows_bug(framework):
    for package in ("transformers", cards.PACKAGES[framework]):  # every card's model is a transformers model
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -r requirements-cards.txt torch==2.13.0)")
    gradients = {}
    for card in (card for card in cards.all_cards() if card.framework == framework):
        measured = cards.measure(card, gradients)
        # The update is the one the card's row weights give on the same rows, computed in float64 from the
        # rows' own gradients: the framework normalises exactly as the card (and its gallery row) says.
        assert measured.matches <= cards.MATCH_RTOL, (card.setting, measured.matches)
        if card.weights is cards.token_mean:
            assert measured.error <= cards.MATCH_RTOL, (card.setting, measured.error)
        else:
            assert measured.error >= BUG_MIN, (card.setting, measured.error)
        # Section 20 quotes the script's table: each line, as printed, stands in the guide.
        line = f"| {card.framework} | {measured.version} | {card.setting} | {cards.shown(measured.error)} |"
        assert line in GUIDE.read_text(), line
