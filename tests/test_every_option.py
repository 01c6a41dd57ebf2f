"""Every value a user can choose runs through train.py for a few steps, as a new user would run it: each trains, or
is refused with one line and exit status 2 leaving nothing behind. A crash (a traceback, any other status) fails.

The values are read from the key declarations (accumulation/config/config_keys.py and the own keys of each
registered piece), never listed here, so a value added to a key is covered by the next run of this file: every
value of a key declared with choices, true and false for a true/false key, and each built-in piece a config can
name (model.name, data.source, model.objective). Each runs in-process (train.main) on 1 process, and the batch,
dist, loss, precision and optimizer values on 2 gloo ranks forked from the preloaded forkserver (testkit/ranks.py);
every shipped config runs too, shrunk to a CPU's size. A value that needs another setting to run at all runs with
it (COMPANIONS): without it, it would only ever be refused.
"""

import dataclasses
import sys
import tomllib
from pathlib import Path

import pytest

import train
from accumulation.config.config import OWNED_SECTIONS, Config, load_config, settings_of
from accumulation.config.help import registered
from accumulation.config.registry import BUILT_IN
from testkit.ranks import run_main_on_ranks
from tests.conformance.tokens import write_token_folder
from tests.test_train import read_metrics, tiny_settings, uneven_corpus

REPO = Path(__file__).resolve().parents[1]
STEPS = 3

# The sizes every case starts from (tests/test_train.py's tiny_settings): a GPT 16 wide on 16-token rows, 8 rows
# per step in micro-batches of 2 (A = 4 on 1 process, 2 on 2 ranks); here 2 blocks, so that a 2-stage pipeline has
# one per stage, 3 steps, validation and a checkpoint at step 2 and at the end.
TINY = {
    "run.max_steps": STEPS,
    "run.eval_every": 2,
    "run.checkpoint_every": 2,
    "run.sample_bytes": 4,
    "model.n_layer": 2,
}

# What the choosing keys name: the built-in pieces of each kind (a fork's pieces run in their shipped configs).
CHOOSING_KEYS = {f"{section}.{key}": section for section, key in OWNED_SECTIONS.items()} | {"model.objective": "loss"}

# 1 supervised step, then steps 2 and 3 are GRPO rounds of 16 trajectories (4 prompts x 4), one step each
GRPO_ROUNDS = {
    "batch.global_batch_size": 16,
    "batch.micro_batch_size": 4,
    "data.mini_batch_size": 16,
    "data.sft_steps": 1,
    "data.prompts_per_round": 4,
    "data.group_size": 4,
    "data.held_out": 8,
}

# What a shipped config's run is shrunk with, key by key: each one only makes it smaller or shorter, to keep the
# default tier short. A config missing from this table runs with the
# run.* keys alone: a new config that is too big for a CPU shows up as a slow test, not as a pass.
SHRINK = {
    "default.toml": {"model.n_layer": 1, "model.d_model": 32, "data.seq_len": 32},
    "sft.toml": {"model.d_model": 32, "data.seq_len": 100},
    "mlm.toml": {"model.d_model": 32},
    "grpo.toml": {**GRPO_ROUNDS, "model.d_model": 32},
    "grpo_hf.toml": GRPO_ROUNDS,  # the Hugging Face policy (its own sizes) and its tokenizer
    "image_classifier.toml": {"data.images": 64},
    "hf_causal_lm.toml": {"data.seq_len": 100},
}
RUN_KEYS = {"run.max_steps": STEPS, "run.eval_every": 2, "run.checkpoint_every": 2}

# Values that cannot run without another setting, and that setting ("{tokens}": token files written for the test).
# Every other value runs on TINY alone. Without its companion a value here would only be refused.
COMPANIONS = {
    ("data.task", "masked"): {"data.source": "{tokens}", "model.name": "encoder", "run.sample_bytes": 0},
    ("dist.pipeline_schedule", "1f1b"): {"dist.pipeline_stages": 2},
    ("dist.pipeline_schedule", "gpipe"): {"dist.pipeline_stages": 2},
}

# The sections whose values also run on 2 ranks: how the global batch is split and reduced, and what the step does
# with the gradients. The other keys do the same on every rank.
TWO_RANK_KEYS = ("batch.", "dist.", "model.loss", "model.compile", "model.objective", "precision.", "optim.")


def key_values(key: str, declaration: dataclasses.Field) -> list:
    """The values --help enumerates for one key: its choices, true and false, or (a choosing key) the built-ins."""
    if declaration.metadata.get("choices"):
        return list(declaration.metadata["choices"])
    if declaration.type is bool:
        return [True, False]
    if key in CHOOSING_KEYS:
        return list(BUILT_IN[CHOOSING_KEYS[key]])
    return []


def shipped_config_choosing(key: str, value) -> Path | None:
    """The shipped config that sets `key` to `value`: the base a piece's own keys run on."""
    section, _, name = key.partition(".")
    for path in sorted((REPO / "configs").glob("*.toml")):
        if tomllib.loads(path.read_text()).get(section, {}).get(name) == value:
            return path
    return None


def enumerated_cases() -> list[tuple[str, object, Path | None]]:
    """(key, value, base config or None) for every enumerated value of every key --help lists: the keys of every
    section, then the own keys of each built-in piece, run on the shipped config that chooses that piece."""
    keys = settings_of(Config())
    cases = [(key, value, None) for key, declaration, _ in keys for value in key_values(key, declaration)]
    for section, choosing_key in OWNED_SECTIONS.items():
        for piece_name, piece in registered(section).items():
            if piece.settings is None or piece_name not in BUILT_IN[section]:
                continue
            base = shipped_config_choosing(f"{section}.{choosing_key}", piece_name)
            assert base is not None, f"no config in configs/ chooses {section}.{choosing_key}={piece_name}: add one"
            for declaration in dataclasses.fields(piece.settings):
                for value in key_values(f"{section}.{declaration.name}", declaration):
                    cases.append((f"{section}.{declaration.name}", value, base))
    # A built-in piece other than the default runs on the shipped config that chooses it, if one does: that config
    # holds the settings it runs with (a data source and its loss, token files for the encoder).
    defaults = {key: default for key, _, default in settings_of(Config())}
    for index, (key, value, base) in enumerate(cases):
        if key in CHOOSING_KEYS and value != defaults[key] and base is None:
            cases[index] = (key, value, shipped_config_choosing(key, value))
    # A value its base run already has is that run again (the base runs on its own: test_the_defaults_train and
    # the shipped configs' test), unless a companion makes it another run.
    return [case for case in cases if case[1] != base_value(case[0], case[2]) or (case[0], case[1]) in COMPANIONS]


def base_value(key: str, base: Path | None):
    """The value `key` takes in a base run: the shipped config's, or the default."""
    config = load_config(["--config", str(base)] if base is not None else [])
    return next((value for name, _, value in settings_of(config) if name == key), None)


def case_id(key: str, value, base: Path | None) -> str:
    text = f"{key}={str(value).lower() if isinstance(value, bool) else value}"
    return f"{base.stem}:{text}" if base is not None else text


def config_arguments(base: Path | None, tmp_path: Path) -> list[str]:
    """The arguments of a run on a shipped config (shrunk) or on TINY over a small uneven corpus."""
    if base is None:
        corpus = tmp_path / "corpus"
        if not corpus.exists():
            uneven_corpus(corpus)
        return tiny_settings(tmp_path, corpus, **TINY)
    overrides = {"run.out_dir": tmp_path / "runs", **RUN_KEYS, **SHRINK.get(base.name, {})}
    if base.name == "mlm.toml":  # its data/mlm_tokens is made by a README command; these are the same tokens
        overrides["data.source"] = token_folder(tmp_path)
    return ["--config", str(base), *(f"{key}={value}" for key, value in overrides.items())]


def token_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tokens"
    if not folder.exists():
        folder.mkdir()
        write_token_folder(folder)
    return folder


def case_arguments(key: str, value, base: Path | None, tmp_path: Path) -> list[str]:
    companions = {
        name: (token_folder(tmp_path) if setting == "{tokens}" else setting)
        for name, setting in COMPANIONS.get((key, value), {}).items()
    }
    text = str(value).lower() if isinstance(value, bool) else value
    settings = {**companions, key: text, "run.name": "case"}
    return config_arguments(base, tmp_path) + [f"{name}={setting}" for name, setting in settings.items()]


def assert_trained_or_refused(status: int, stderr: str, run_dir: Path) -> str:
    """'trained' (STEPS steps in metrics.jsonl) or 'refused' (one line, exit 2, no run directory); else it fails."""
    if status == 0:
        assert [record["steps"] for record in read_metrics(run_dir)][-1] == STEPS, stderr
        return "trained"
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert status == 2, f"exit status {status}, not 0 or 2:\n{stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"a refusal is one line:\n{stderr}"
    assert not run_dir.exists(), f"a refused run left {run_dir} behind"
    return "refused"


def param(key: str, value, base: Path | None):
    marks = [pytest.mark.compile] if (key, value) == ("model.compile", True) else []  # minutes of compiling on a CPU
    return pytest.param(key, value, base, id=case_id(key, value, base), marks=marks)


CASES = enumerated_cases()
SHIPPED = sorted((REPO / "configs").glob("*.toml"))


def test_the_defaults_train(tmp_path, capsys):
    """The base every case changes one value of: it trains."""
    status = train.main(config_arguments(None, tmp_path) + ["run.name=case"])
    assert assert_trained_or_refused(status, capsys.readouterr().err, tmp_path / "runs" / "case") == "trained"


@pytest.mark.parametrize(("key", "value", "base"), [param(*case) for case in CASES])
def test_every_enumerated_value_trains_or_is_refused_in_one_line_on_one_process(
    key, value, base, tmp_path, capsys, record_property
):
    status = train.main(case_arguments(key, value, base, tmp_path))
    record_property("outcome", assert_trained_or_refused(status, capsys.readouterr().err, tmp_path / "runs" / "case"))


@pytest.mark.parametrize(
    ("key", "value", "base"), [param(*case) for case in CASES if case[0].startswith(TWO_RANK_KEYS)]
)
def test_every_batch_dist_loss_precision_and_optimizer_value_trains_or_is_refused_on_two_ranks(
    key, value, base, tmp_path, record_property
):
    per_rank = run_main_on_ranks("train:main", case_arguments(key, value, base, tmp_path), world_size=2)
    status = next((status for status, _, _ in per_rank if status != 0), 0)  # as torchrun: the first failure
    if status == 2:  # every rank finds the same bad input and says it in the same line
        assert len({err for _, _, err in per_rank}) == 1, [err for _, _, err in per_rank]
    outcome = assert_trained_or_refused(status, per_rank[0][2], tmp_path / "runs" / "case")
    record_property("outcome", outcome)  # the tally of the matrix: python -m pytest THIS_FILE --junitxml=FILE


@pytest.mark.parametrize("config", SHIPPED, ids=[path.name for path in SHIPPED])
def test_every_shipped_config_trains_or_is_refused_in_one_line(config, tmp_path, capsys, record_property):
    """On a CPU, a config for GPUs (device = "cuda") is refused in one line."""
    name = tomllib.loads(config.read_text())["run"]["name"]
    status = train.main(config_arguments(config, tmp_path))
    record_property("outcome", assert_trained_or_refused(status, capsys.readouterr().err, tmp_path / "runs" / name))


def test_the_matrix_covers_every_enumerated_key():
    """The derivation itself: each key with choices or true/false shows up with every value, a new value too."""
    keys = {key for key, _, _ in CASES}
    for key, declaration, _ in settings_of(Config()):
        if declaration.metadata.get("choices") or declaration.type is bool:
            assert key in keys, key
    assert ("batch.on_oom", "shrink", None) in CASES
    assert ("model.name", "gru", None) in CASES
    assert any(key == "data.loss_aggregation" and base is not None for key, _, base in CASES)


def test_a_config_whose_optional_dependency_is_missing_names_its_requirements_file(tmp_path, capsys, monkeypatch):
    """configs/hf_causal_lm.toml without transformers (an import of it fails, as when it is not installed): one line
    that says which requirements file to install, exit 2, and no run directory."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    config = REPO / "configs" / "hf_causal_lm.toml"
    status = train.main(config_arguments(config, tmp_path))
    stderr = capsys.readouterr().err
    assert assert_trained_or_refused(status, stderr, tmp_path / "runs" / "hf-causal-lm") == "refused"
    assert "pip install -r requirements-hf.txt" in stderr
    assert not (tmp_path / "runs").exists()
