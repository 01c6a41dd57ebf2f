import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from tests.test_checkpoints import run_in_process
from tests.test_train import tiny_settings

# DDP and torch.compile cache compiled kernels under /tmp/torchinductor_<user> by default; keep the test
# suite from writing outside its own temporary space.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="accumulation-inductor-"))


@pytest.fixture(autouse=True)
def deterministic_torch():
    """Each test starts from the same global RNG state and one intra-op thread (results do not depend on
    the thread count, and two gloo ranks share this machine's two cores)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# pytest.ini runs the suite on `-n auto` pytest-xdist workers. One per core this process may use (a container's
# or taskset's share, not the machine's), at most 8: every worker imports torch and builds its own session
# fixtures, and each 2-rank test already runs two processes. optionalhook: with -p no:xdist nobody calls it.
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    return max(1, min(cores or 1, MAX_WORKERS))


def pytest_addoption(parser):
    """tests/conformance runs against a fork's own config: python -m pytest tests/conformance --fork-config FILE."""
    parser.addoption(
        "--fork-config",
        default=None,
        help="tests/conformance: the TOML config of your fork (default: the project's own configs, as CI runs them)",
    )


# A test that hangs (a data order that never ends, a collective nobody joins) fails after this long instead of
# holding CI until its own limit; the slowest test takes well under a minute here. Subprocesses have their own
# timeouts as well. SIGALRM interrupts Python code (and sleeps, and waits for a child), not a C call that never
# returns: such a test needs its own subprocess timeout.
TEST_TIME_LIMIT_S = 300
# Tests marked `compile` (out of the default run) compile with Inductor, minutes each on a busy 2-core CPU.
COMPILE_TEST_TIME_LIMIT_S = 1800


@pytest.fixture(autouse=True)
def time_limit(request):
    limit = COMPILE_TEST_TIME_LIMIT_S if request.node.get_closest_marker("compile") else TEST_TIME_LIMIT_S

    def expire(signum, frame):
        pytest.fail(f"the test ran longer than {limit} s (tests/conftest.py): it hangs, or is far too slow")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where a GPU is: elsewhere they are reported as skipped, with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); scripts/checks/gpu_check.py runs the CUDA checks")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Shared by tests/test_checkpoints.py and tests/test_bad_input.py; `corpus` is the requesting file's own fixture.
@pytest.fixture
def started_run(tmp_path, corpus, capsys) -> tuple[list[str], Path]:
    """A run directory holding the step-0 checkpoint of tiny settings on a private copy of the corpus, and
    those settings."""
    own_corpus = shutil.copytree(corpus, tmp_path / "corpus")
    arguments = tiny_settings(tmp_path, own_corpus, **{"run.max_steps": 0})
    assert run_in_process(arguments, capsys)[0] == 0
    return arguments, tmp_path / "runs" / "default"
