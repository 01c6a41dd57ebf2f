import os
import tempfile

import pytest
import torch

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


def pytest_addoption(parser):
    """tests/conformance runs against a fork's own config: python -m pytest tests/conformance --fork-config FILE."""
    parser.addoption(
        "--fork-config",
        default=None,
        help="tests/conformance: the TOML config of your fork (default: the project's own configs, as CI runs them)",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where a GPU is: elsewhere they are reported as skipped, with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); scripts/checks/gpu_check.py runs the CUDA checks")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
