"""Which configs the conformance suite checks: the fork's (--fork-config FILE), or the project's own.

Every config is cut down to a tiny model and batch (TINY), so that a fork's check takes seconds; the
promises it checks do not depend on the model's size. The project's configs/mlm.toml reads token files that
`scripts/operations/prepare_data.py` writes into data/mlm_tokens; here they are written into a temporary folder instead,
from the same text, so that CI needs nothing prepared.
"""

import tomllib
from pathlib import Path

import pytest

from accumulation.config.config import ModelConfig, unused_model_keys
from tests.conformance.tokens import REPO, write_token_folder

# Small enough for two gloo ranks on a 2-core CPU in seconds: G = 8 = m 2 x A 4 x D 1 = m 2 x A 2 x D 2.
TINY = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "data.val_fraction=0",
]

# The image classifier (forks/image_classifier.py) is the project's fork with float inputs; the Hugging Face fork
# is checked by tests/test_hf_causal_lm.py, where transformers is installed.
PROJECT_CONFIGS = ["configs/default.toml", "configs/sft.toml", "configs/mlm.toml", "configs/image_classifier.toml"]

# The expensive checks (the step on 2 ranks under torchrun, and resume, ~10 s each on this 2-core machine)
# run, for the project's own configs, on the masked-LM fork only, the one whose rows change every step:
# tests/test_check_equivalence.py runs the 2-rank check of the default and SFT data, and tests/test_train.py
# and tests/test_fork.py resume them. A fork's own config (--fork-config) gets every check.
PROJECT_EXPENSIVE = ["configs/mlm.toml"]


def pytest_generate_tests(metafunc):
    forked = metafunc.config.getoption("--fork-config")
    if "fork_config" in metafunc.fixturenames:
        expensive = "expensive" in metafunc.definition.keywords
        configs = [forked] if forked else (PROJECT_EXPENSIVE if expensive else PROJECT_CONFIGS)
        metafunc.parametrize("fork_config", configs)


@pytest.fixture(scope="session")
def mlm_tokens(tmp_path_factory) -> Path:
    return write_token_folder(tmp_path_factory.mktemp("mlm_tokens"))


@pytest.fixture
def fork_argv(fork_config: str, request) -> list[str]:
    """The arguments train.py and the checker take for this config, cut down to TINY (less the generic model keys
    its model does not read, such as a Hugging Face model's: load_config refuses them)."""
    with open(REPO / fork_config, "rb") as file:
        model_name = tomllib.load(file).get("model", {}).get("name", ModelConfig().name)
    unused = unused_model_keys(model_name)
    argv = [
        "--config",
        str(REPO / fork_config),
        *[argument for argument in TINY if argument.split("=")[0] not in unused],
    ]
    if not request.config.getoption("--fork-config") and fork_config == "configs/mlm.toml":
        argv.append(f"data.source={request.getfixturevalue('mlm_tokens')}")
    return argv
