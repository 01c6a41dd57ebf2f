"""The memory a run can have at most (accumulation/data/memory.py): the cgroup's limit read from a fake cgroup
tree (v2 memory.max, v1 memory.limit_in_bytes, "max" or v1's huge number meaning none), and the start-up check
of train.py (accumulation/run/build.py, check_fits_in_memory) against each limit: the host's (its memory, the
cgroup's) shared by its ranks, a process's own (RLIMIT_AS) by one."""

import os
import resource
from pathlib import Path

import pytest

import train
from accumulation.config.config import ConfigError, load_config
from accumulation.data import memory
from accumulation.data.sources import build_data
from accumulation.models.factory import build_model_on_meta, count_parameters, resolved_vocab_size
from accumulation.parallel.pipeline import split_into_stages
from accumulation.run import build
from testkit.ranks import run_main_on_ranks
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


def test_the_address_space_limit_is_the_process_s_own_and_the_host_s_limits_are_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (3 * GIB, resource.RLIM_INFINITY))
    monkeypatch.setattr(memory, "mapped_bytes", lambda: GIB)
    fake_cgroup(monkeypatch, tmp_path, "0::/job\n", {"job/memory.max": f"{4 * GIB}\n"})
    assert memory.memory_limits() == [
        (machine_bytes(), "this machine's memory", False),
        (4 * GIB, "the cgroup's memory.max", False),
        (2 * GIB, "the address space ulimit -v leaves", True),  # what the limit leaves over what is mapped
    ]
    assert memory.memory_limit_bytes() == (2 * GIB, "the address space ulimit -v leaves")


PARAMETERS = 24_000_000  # divisible by every D below


@pytest.mark.parametrize(
    "optimizer, bytes_per_parameter",
    [
        ({"optim.name": "adamw"}, 16),  # weight, gradient, two moments
        ({"optim.name": "sgd", "optim.momentum": 0.9}, 12),  # weight, gradient, momentum buffer
        ({"optim.name": "sgd", "optim.momentum": 0}, 8),  # weight and gradient
    ],
    ids=["adamw", "sgd-momentum", "sgd"],
)
@pytest.mark.parametrize(
    "strategy, world_size, local_world_size, own, bytes_needed",
    [
        # (what the limit must hold, as a multiple of bytes_per_parameter × PARAMETERS)
        ("ddp", 1, 1, True, 1.0),  # one process, the whole state
        ("ddp", 2, 2, False, 2.0),  # two whole copies under one host's limit
        ("fsdp2", 4, 4, True, 0.25),  # a process's own limit holds its quarter
        ("fsdp2", 4, 4, False, 1.0),  # the host's holds its 4 ranks' quarters
        ("fsdp2", 8, 4, False, 0.5),  # two hosts of 4: each holds half
    ],
    ids=["ddp-1", "ddp-host-2", "fsdp2-rlimit-4", "fsdp2-host-4", "fsdp2-2-hosts-of-4"],
)
def test_the_memory_check_refuses_exactly_below_the_lower_bound_of_the_optimizer_and_the_strategy(
    tmp_path, monkeypatch, optimizer, bytes_per_parameter, strategy, world_size, local_world_size, own, bytes_needed
):
    """The state a run cannot train without: 4 bytes per parameter for each of the weight, its gradient and the
    optimizer's tensors shaped like it, 1/D of it per rank under fsdp2; a limit of this process (RLIMIT_AS) holds one
    rank's, a limit of the host (its memory, a cgroup) the host's LOCAL_WORLD_SIZE ranks'. One byte less than that
    (plus the activations' lower bound, a few KB here) is refused, one MB more passes."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"dist.strategy": strategy, "device": "cpu", **optimizer}
    config = load_config(tiny_settings(tmp_path, corpus, **settings))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    needed = int(bytes_needed * bytes_per_parameter * PARAMETERS)
    where = "the address space ulimit -v leaves" if own else "the cgroup's memory.max"
    for limit_bytes, refused in ((needed - 1, True), (needed + 2**20, False)):
        monkeypatch.setattr(build, "memory_limits", lambda limit_bytes=limit_bytes: [(limit_bytes, where, own)])
        if refused:
            with pytest.raises(ConfigError, match=f"GiB of {where}; choose a smaller model"):
                build.check_fits_in_memory(config, PARAMETERS, vocab_size=1, chunked_loss=True)
        else:
            build.check_fits_in_memory(config, PARAMETERS, vocab_size=1, chunked_loss=True)


def main_under_a_process_limit(argv: list[str]) -> int:
    """train.main in a rank whose only memory limit is its own $ACCUMULATION_TEST_LIMIT_BYTES (as `ulimit -v`)."""
    limit_bytes = int(os.environ["ACCUMULATION_TEST_LIMIT_BYTES"])
    build.memory_limits = lambda: [(limit_bytes, "the address space ulimit -v leaves", True)]  # this rank's copy
    return train.main(argv)


def test_a_pipeline_rank_is_checked_for_its_largest_stage_not_the_whole_model(tmp_path, monkeypatch):
    """Each pipeline rank holds one stage and keeps, of a micro-batch's activations, at least the residual stream
    its stage receives or makes (m · seq_len · d_model fp32 values; the logits only on the last stage): a limit 4 KiB
    over the largest stage's training state plus that trains; one byte under the stage's state is refused, one line
    naming the stage, exit 2. The check that counted the whole model and all its layers' activations on every rank
    refused the first run."""
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"dist.pipeline_stages": 2, "model.n_layer": 4, "model.d_model": 64, "run.max_steps": 2}
    arguments = tiny_settings(tmp_path, corpus, **{**settings, "run.sample_bytes": 0})
    config = load_config(arguments)
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    model = build_model_on_meta(config.model, resolved_vocab_size(config.model, data.vocab_size), config.data.seq_len)
    per_parameter = 16  # AdamW: the weight, its gradient and two moments, fp32
    stage_bytes = per_parameter * max(count_parameters(stage) for stage in split_into_stages(model, 2))
    whole_bytes = per_parameter * count_parameters(model)
    residual_bytes = config.batch.micro_batch_size * config.data.seq_len * config.model.d_model * 4
    fits = stage_bytes + residual_bytes + 4096
    assert fits < whole_bytes / 1.9  # 1.9 MB against 3.7 MB of state here
    for name, limit_bytes, refused in (("fits", fits, False), ("refused", stage_bytes - 1, True)):
        monkeypatch.setenv("ACCUMULATION_TEST_LIMIT_BYTES", str(limit_bytes))
        outputs = run_main_on_ranks(
            "tests.test_memory_limit:main_under_a_process_limit", [*arguments, f"run.name={name}"], world_size=2
        )
        for status, _stdout, stderr in outputs:
            if refused:
                assert status == 2 and "weights in its largest pipeline stage" in stderr, stderr
                assert stderr.count("\n") == 1, stderr
            else:
                assert status == 0, stderr
    assert not (tmp_path / "runs" / "refused").exists()
