"""README.md and docs/*.md point at files that exist: every script or train.py a command runs, every config a
command passes, every test path pytest is given, every relative link. A moved or renamed file then fails here
instead of leaving a command in the docs that no longer runs as written. Reads text only: no command is run."""

import ast
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


# What one step of the default run cannot be understood without, whichever files hold it: where its rows and N come
# from (the data order, the micro-batches, the supervised counts, the normaliser's default), the loss, the step, the
# optimizer and the schedule, and where the run's step is put together (build_training, StepSetup). The reading
# path must name where each is defined.
READING_PATH_MUST_HOLD = {
    "StepBatches",
    "step_row_ids",
    "micro_batch_slices",
    "step_batch",
    "RowSet.supervised_counts",
    "RowHooks.normaliser",
    "token_cross_entropy_sum",
    "optimizer_step",
    "StepSetup",
    "build_training",
    "build_optimizer",
    "lr_multiplier",
}


def definition_lines(path: Path, name: str) -> tuple[int, int] | None:
    """(first, last) line of the definition of `name` in the file at `path`: a top-level function, class or
    assignment, or "Class.method"; its decorators included. None when the file does not define it."""
    scope = ast.parse(path.read_text()).body
    *outer, last = name.split(".")
    for part in outer:
        classes = [node for node in scope if isinstance(node, ast.ClassDef) and node.name == part]
        if not classes:
            return None
        scope = classes[0].body
    for node in scope:
        named = getattr(node, "name", None) == last or any(
            isinstance(target, ast.Name) and target.id == last for target in getattr(node, "targets", [])
        )
        if named or (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == last):
            first = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
            return first, node.end_lineno
    return None


def test_the_reading_path_of_one_step_holds_what_it_names_and_counts_itself():
    """docs/forking.md's "Reading one step" table: each row's range lies in its file and holds every definition the
    row names (a function, class or assignment, or Class.method, whole), or the text it names (train.py's fences);
    together the rows name where N and the step come from (READING_PATH_MUST_HOLD); the total the page states is
    the sum of the ranges over the files they are in. Which files those are is the page's to say."""
    page = (REPO / "docs" / "forking.md").read_text()
    section = page.split("## Reading one step", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w./]+\.py)` \| (\d+)–(\d+) \| ([^|]+) \|", section, flags=re.MULTILINE)
    assert rows, "no rows of the form | `path.py` | first–last | `names` | what |"
    named = set()
    for path, first, last, holds in rows:
        first, last = int(first), int(last)
        lines = (REPO / path).read_text().splitlines()
        assert 1 <= first <= last <= len(lines), f"{path}: lines {first}–{last} of {len(lines)}"
        text = "\n".join(lines[first - 1 : last])
        names = re.findall(r"`([^`]+)`", holds)
        assert names, f"{path} {first}–{last} names nothing it holds"
        for name in names:
            if re.fullmatch(r"[A-Za-z_][\w.]*", name):
                span = definition_lines(REPO / path, name)
                assert span is not None, f"{path} defines no {name}"
                assert first <= span[0] and span[1] <= last, f"{path}: {name} is at {span}, outside {first}–{last}"
                named.add(name)
            else:
                assert name in text, f"{path} {first}–{last} does not hold {name!r}"
    left_out = {name for name in READING_PATH_MUST_HOLD if name not in named and name.split(".")[0] not in named}
    assert not left_out, f"the path leaves out {sorted(left_out)}"  # a method is read with its whole class
    total = sum(int(last) - int(first) + 1 for _, first, last, _ in rows)
    files = len({path for path, _, _, _ in rows})
    assert f"{total:,} lines in {files} files" in section, (total, files)


# A merge conflict's markers at the start of a line: seven of one character, then a space and a branch name
# (or nothing, for the middle one). A page once kept a resolved conflict's markers for a whole session.
CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_page_or_source_keeps_merge_conflict_markers():
    tracked = [*PAGES, REPO / "train.py", *REPO.glob("accumulation/**/*.py"), *REPO.glob("scripts/**/*.py")]
    tracked += [*REPO.glob("tests/*.py"), *REPO.glob("configs/*.toml")]
    marked = [str(path.relative_to(REPO)) for path in tracked if CONFLICT_MARKER.search(path.read_text())]
    assert not marked, f"merge conflict markers left in {marked}"
    assert CONFLICT_MARKER.search("text\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n")
