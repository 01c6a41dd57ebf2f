"""README.md and docs/*.md point at files that exist: every script or train.py a command runs, every config a
command passes, every test path pytest is given, every relative link. A moved or renamed file then fails here
instead of leaving a command in the docs that no longer runs as written. Reads text only: no command is run."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# The file a command runs: `python PATH.py`, `torchrun [options] PATH.py` (options may continue over a `\`
# line break), `sbatch PATH`; the config it is given (`--config PATH.toml`, placeholders like FILE have no
# `.toml`); the tests pytest is pointed at. Prose may break a command across lines, hence \s+ between words.
COMMAND_PATHS = [
    re.compile(r"\bpython\s+([\w./-]+\.py)\b"),
    re.compile(r"\btorchrun\s+(?:(?:--?[\w-]+(?:=\S+)?|\$?[\w.:$]+=\S+|\\)\s+)*([\w./-]+\.py)\b"),
    re.compile(r"\bsbatch\s+([\w./-]+\.sbatch)\b"),
    re.compile(r"--config\s+([\w./-]+/[\w.-]+\.toml)\b"),
    re.compile(r"\bpython\s+-m\s+pytest\s+((?:tests|scripts)/[\w./-]*)"),
]
# [text](target), images included; absolute URLs and in-page anchors are not files.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def command_paths(text: str) -> list[str]:
    return [match.group(1).rstrip(".") for pattern in COMMAND_PATHS for match in pattern.finditer(text)]


def relative_links(text: str) -> list[str]:
    targets = (match.group(1) for match in LINK.finditer(text))
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_patterns_see_commands_as_the_docs_write_them():
    # Without this a pattern that matched nothing would let every check below pass vacuously.
    sample = (
        "`python train.py --help` and `python scripts/checks/gpu_check.py`; torchrun --nnodes=2 "
        "--rdzv_endpoint=$HEAD_NODE:29500 \\\n    --max-restarts=3 train.py --config configs/multinode.toml; "
        "`sbatch scripts/operations/slurm.sbatch`, `python -m pytest tests/conformance --fork-config YOURS.toml`"
    )
    assert command_paths(sample) == [
        "train.py",
        "scripts/checks/gpu_check.py",
        "train.py",
        "scripts/operations/slurm.sbatch",
        "configs/multinode.toml",
        "tests/conformance",
    ]
    assert relative_links("[a](docs/x.md#part) [b](https://example.org) [c](#here) ![d](figures/p.png)") == [
        "docs/x.md",
        "figures/p.png",
    ]


def test_every_command_and_link_points_to_a_file_that_exists():
    missing = []
    seen = 0
    for page in PAGES:
        text = page.read_text()
        for path in command_paths(text):
            seen += 1
            if not (REPO / path).exists():  # commands are run from the repository root
                missing.append(f"{page.relative_to(REPO)}: command path {path}")
        for target in relative_links(text):
            seen += 1
            if not (page.parent / target).exists():  # links resolve from the page's own folder
                missing.append(f"{page.relative_to(REPO)}: link {target}")
    assert seen > 50, f"only {seen} commands and links found: the patterns no longer read the docs"
    assert not missing, "\n".join(missing)


def test_readme_stays_an_overview():
    # The README is the front page (what it is, two commands, the ways in, tools, numbers); the reference
    # lives in docs/. 220 lines leaves room to grow without turning back into a manual.
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 220, f"README.md has {lines} lines; move reference material to a docs/ page"


def test_the_reading_path_of_one_step_matches_the_code_and_fits_in_one_sitting():
    """docs/forking.md's "Reading one step" table: each range lies in its file, train.py's holds both fences of the
    training section and step.py's the whole step (optimizer_step, update_or_skip, StepResult), at most 3 files
    and 420 lines in all (the step's constants, StepSetup, and the Strategy protocol included), and the total the
    page states is the sum of the ranges."""
    page = (REPO / "docs" / "forking.md").read_text()
    section = page.split("## Reading one step", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w./]+\.py)` \| (\d+)–(\d+) \|", section, flags=re.MULTILINE)
    assert [path for path, _, _ in rows] == ["train.py", "accumulation/batching.py", "accumulation/step.py"]
    read = {}
    for path, first, last in rows:
        lines = (REPO / path).read_text().splitlines()
        assert 1 <= int(first) <= int(last) <= len(lines), path
        read[path] = "\n".join(lines[int(first) - 1 : int(last)])
    assert "TRAINING SECTION BEGIN" in read["train.py"] and "TRAINING SECTION END" in read["train.py"]
    assert "batches.take(" in read["train.py"] and "result = training.step(" in read["train.py"]
    for name in ("def optimizer_step(", "def update_or_skip(", "class StepResult", "class DataParallel"):
        assert name in read["accumulation/step.py"], name
    assert "class MicroBatch" in read["accumulation/batching.py"]
    total = sum(int(last) - int(first) + 1 for _, first, last in rows)
    assert total <= 420 and f"{total} lines in {len(rows)} files" in section


# A merge conflict's markers at the start of a line: seven of one character, then a space and a branch name
# (or nothing, for the middle one). A page once kept a resolved conflict's markers for a whole session.
CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_page_or_source_keeps_merge_conflict_markers():
    tracked = [*PAGES, REPO / "train.py", *REPO.glob("accumulation/**/*.py"), *REPO.glob("scripts/**/*.py")]
    tracked += [*REPO.glob("tests/*.py"), *REPO.glob("configs/*.toml")]
    marked = [str(path.relative_to(REPO)) for path in tracked if CONFLICT_MARKER.search(path.read_text())]
    assert not marked, f"merge conflict markers left in {marked}"
    assert CONFLICT_MARKER.search("text\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n")
