"""scripts/teaching/minimal_loop.py, the loop to read first: short, and checked against optimizer_step."""

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from scripts.teaching import minimal_loop

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "teaching" / "minimal_loop.py"


# The script's main in this process (the default tier), or the script run as a user runs it (integration).
LAUNCHED = [False, pytest.param(True, marks=pytest.mark.integration)]


def run(arguments: list[str], launched: bool, capsys) -> tuple[int, str]:
    """(exit status, stdout) of minimal_loop.py with `arguments`."""
    if not launched:
        status = minimal_loop.main(arguments)
        return status, capsys.readouterr().out
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert not completed.stderr, completed.stderr
    return completed.returncode, completed.stdout


def code_lines(source: str) -> int:
    """Lines holding code: comments, blank lines and docstrings (a string that is a whole statement) excluded,
    counted with Python's tokenizer as docs/forking.md counts step.py."""
    lines = set()
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            previous = token.type if token.type != tokenize.COMMENT else previous
            continue
        if token.type == tokenize.ENDMARKER:
            continue
        docstring = token.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        previous = token.type
        if not docstring:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def test_the_minimal_loop_has_at_most_80_lines_of_code_and_the_docs_say_how_many():
    """README, docs/tools.md, docs/teaching.md and the guide each say "N lines of plain PyTorch": N is the count."""
    assert code_lines("x = 1\n# c\n\ndef f():\n    '''doc'''\n    return 2\n") == 3  # the counter itself
    count = code_lines(SCRIPT.read_text())
    assert count <= 80
    for doc in ("README.md", "docs/tools.md", "docs/teaching.md", "docs/accumulation.md"):
        text = " ".join((REPO / doc).read_text().split())  # a sentence may wrap between the number and its noun
        stated = re.findall(r"(\d+) lines of plain PyTorch", text)
        assert stated and all(int(number) == count for number in stated), (doc, stated, count)


@pytest.mark.parametrize("launched", LAUNCHED)
def test_the_minimal_loop_matches_optimizer_step_and_the_classic_loop_does_not(capsys, launched):
    status, stdout = run([], launched, capsys)
    assert status == 0, stdout
    lines = stdout.splitlines()
    assert lines[-1] == "PASS"
    ours = float(lines[-3].split(": ")[1].split()[0])
    classic = float(lines[-2].split(": ")[1])
    assert ours <= 1e-5  # the script's own tolerance, stated and justified there
    assert classic > 1e-3  # the mean of micro-batch means ends measurably elsewhere


@pytest.mark.parametrize("launched", LAUNCHED)
def test_the_check_fails_when_the_loop_uses_the_classic_line(capsys, launched):
    status, stdout = run(["--classic"], launched, capsys)
    assert status == 1, stdout
    assert stdout.splitlines()[-1] == "FAIL"
