"""Plant plausible bugs, one at a time, and check that the tests meant to see each one fail.

    python scripts/checks/plant_bugs.py [--only NAME ...] [--json]

Each bug is a text substitution in one file of a temporary copy of the repository (the tracked and the
untracked, not ignored files); the named tests then run in that copy. "caught" means they failed;
"NOT caught" means they passed with the bug in place, which is a hole in the suite; "not applicable" means
the text to replace is no longer in the file (the code changed: update the bug). CPU-heavy: each bug runs
its own small selection of tests, one after the other.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Run as `python scripts/checks/plant_bugs.py`, Python puts only this file's folder on sys.path: the repository
# root goes first, so that the list of plants imports as the tests import it.
sys.path.insert(0, str(REPO))

from scripts.checks.plants import BUGS, Bug  # noqa: E402
from scripts.checks.plants_detectors import DETECTOR_BUGS  # noqa: E402


def copy_of_repository(destination: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def plant(bug: Bug) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"plant-{bug.name}-") as scratch:
        copy = Path(scratch)
        copy_of_repository(copy)
        target = copy / bug.path
        text = target.read_text()
        if text.count(bug.old) != 1:
            return {"bug": bug.name, "outcome": "not applicable", "seconds": 0.0}
        target.write_text(text.replace(bug.old, bug.new))
        started = time.monotonic()
        environment = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
        # -n 0: in one process. Under pytest-xdist (pytest.ini) -x ends the session as interrupted, exit 2.
        # -m "": every tier, so that a plant's integration test runs too (pytest.ini deselects that tier).
        completed = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-m", "", "-p", "no:cacheprovider", *bug.tests],
            cwd=copy,
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.monotonic() - started
    # pytest: 0 all passed, 1 some failed; anything else (no tests collected, an internal error) is a
    # broken selection, not a catch.
    outcome = {0: "NOT caught", 1: "caught"}.get(completed.returncode, f"error (pytest exit {completed.returncode})")
    return {"bug": bug.name, "outcome": outcome, "seconds": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="plant only these bugs (by name)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    bugs = [bug for bug in BUGS + DETECTOR_BUGS if not args.only or bug.name in args.only]
    results = []
    for bug in bugs:
        result = plant(bug)
        results.append(result)
        if not args.json:
            print(f"{result['bug']:<30} {result['outcome']:<16} {result['seconds']:>6.1f} s   {bug.what}", flush=True)
    caught = sum(result["outcome"] == "caught" for result in results)
    if args.json:
        print(json.dumps({"results": results, "caught": caught, "planted": len(results)}, indent=2))
    else:
        print(f"{caught} of {len(results)} caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
