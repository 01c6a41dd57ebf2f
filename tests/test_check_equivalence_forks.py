"""The equivalence checker with a fork: its module found in the folder the checker is launched from, and the
promises that cannot apply to the fork's data said to be n/a, not ok. In-process, as the other checker tests."""

import runpy
import sys

import pytest

from accumulation.parallel import distributed
from tests.test_disrupted_runs import REPO

CWD_FORK = """
from accumulation.config.registry import register_model
from accumulation.models.gpt import build_gpt

register_model("tiny", build_gpt)
"""
TINY_GPT = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.seq_len=16"]


def test_the_checker_imports_a_fork_from_the_folder_it_is_launched_in(tmp_path, monkeypatch, capsys):
    """As `cd my_fork && python path/to/check_equivalence.py model.name=cwd_fork:tiny`: Python puts only the
    script's own folder on sys.path, so without the launch folder the fork's module is not found."""
    (tmp_path / "cwd_fork.py").write_text(CWD_FORK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(REPO / "scripts" / "checks"), *sys.path])  # as Python sets it, restored
    arguments = ["model.name=cwd_fork:tiny", *TINY_GPT, "batch.global_batch_size=4", "batch.micro_batch_size=2"]
    monkeypatch.setattr(sys, "argv", ["check_equivalence.py", *arguments])
    # run_and_exit ends the process with os._exit: here, the status is raised instead
    monkeypatch.setattr(distributed, "run_and_exit", lambda main, argv: sys.exit(main(argv)))
    try:
        with pytest.raises(SystemExit) as exit:
            runpy.run_path(str(REPO / "scripts" / "checks" / "check_equivalence.py"), run_name="__main__")
    finally:
        sys.modules.pop("cwd_fork", None)
    captured = capsys.readouterr()
    assert exit.value.code == 0 and captured.out.splitlines()[-1] == "PASS", captured.err
