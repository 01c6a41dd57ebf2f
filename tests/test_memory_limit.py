"""The memory a run can have at most (accumulation/data/memory.py): the cgroup's limit read from a fake cgroup
tree (v2 memory.max, v1 memory.limit_in_bytes, "max" or v1's huge number meaning none), and the start-up check
of train.py against the smaller of that limit and the machine's memory."""

import os
import resource
from pathlib import Path

import pytest

from accumulation.data import memory
from tests.test_checkpoints import run_in_process
from tests.test_train import tiny_settings, uneven_corpus

GIB = 2**30
# What cgroup v1 writes for "no limit": 2^63 - 1 rounded down to a 4 KiB page.
V1_UNLIMITED = "9223372036854771712"


def fake_cgroup(monkeypatch, tmp_path: Path, membership: str, files: dict[str, str]) -> None:
    """/proc/self/cgroup holding `membership`, and a cgroup tree under tmp_path holding `files` (path: text)."""
    proc_file, root = tmp_path / "proc_self_cgroup", tmp_path / "sys_fs_cgroup"
    proc_file.write_text(membership)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", proc_file)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)


@pytest.mark.parametrize(
    "membership, files, limit_bytes",
    [
        # cgroup v2: one line "0::/path", the limit in <root>/<path>/memory.max
        ("0::/job.slice/step_0\n", {"job.slice/step_0/memory.max": f"{4 * GIB}\n"}, 4 * GIB),
        ("0::/job.slice\n", {"job.slice/memory.max": "max\n"}, None),
        # cgroup v1: a line per hierarchy, the limit in <root>/memory/<path>/memory.limit_in_bytes
        ("5:cpu,cpuacct:/\n4:memory:/job_7\n", {"memory/job_7/memory.limit_in_bytes": f"{2 * GIB}\n"}, 2 * GIB),
        ("4:memory:/job_7\n", {"memory/job_7/memory.limit_in_bytes": f"{V1_UNLIMITED}\n"}, None),
        # hybrid (systemd's): a v2 line without the memory controller, and the v1 memory hierarchy
        ("4:memory:/job_7\n0::/\n", {"memory/job_7/memory.limit_in_bytes": f"{3 * GIB}\n"}, 3 * GIB),
        # a line that names a group without a limit file (outside the container's view)
        ("0::/elsewhere\n", {}, None),
    ],
    ids=["v2", "v2-max", "v1", "v1-unlimited", "hybrid", "no-file"],
)
def test_the_cgroup_limit_is_read_from_v2_and_v1_and_no_limit_is_none(
    tmp_path, monkeypatch, membership, files, limit_bytes
):
    fake_cgroup(monkeypatch, tmp_path, membership, files)
    assert memory.cgroup_memory_limit_bytes() == limit_bytes


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_limit_is_the_smaller_of_the_cgroup_s_and_the_machine_s(tmp_path, monkeypatch):
    no_ulimit = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: no_ulimit)
    fake_cgroup(monkeypatch, tmp_path, "0::/job\n", {"job/memory.max": f"{GIB}\n"})
    assert memory.memory_limit_bytes() == (GIB, "the cgroup's memory.max")
    (tmp_path / "sys_fs_cgroup" / "job" / "memory.max").write_text(f"{2 * machine_bytes()}\n")  # above the machine
    assert memory.memory_limit_bytes() == (machine_bytes(), "this machine's memory")


def test_train_py_refuses_a_model_larger_than_the_cgroup_allows_before_writing_anything(tmp_path, monkeypatch, capsys):
    """A job whose cgroup allows 4 KiB: the tiny model's 16 bytes a weight already exceed it. One line naming the
    cgroup, exit 2, no run directory; the same run with the limit at the machine's size trains."""
    corpus = uneven_corpus(tmp_path / "corpus")
    fake_cgroup(monkeypatch, tmp_path, "0::/job\n", {"job/memory.max": "4096\n"})
    settings = tiny_settings(tmp_path, corpus, **{"run.max_steps": 1, "run.sample_bytes": 0})
    status, _, error = run_in_process(settings, capsys)
    assert status == 2
    assert error.startswith("error: model.d_model / model.n_layer / data.seq_len: the gpt model has "), error
    assert "GiB of the cgroup's memory.max; choose a smaller model" in error and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()
    (tmp_path / "sys_fs_cgroup" / "job" / "memory.max").write_text("max\n")
    assert run_in_process(settings, capsys)[0] == 0
