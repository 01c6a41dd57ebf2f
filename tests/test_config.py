"""The config: defaults, shipped files, command-line overrides, every kind of error, --help and TOML output."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from accumulation.config.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    resolved_compile,
    resolved_grad_scaler,
)
from accumulation.config.help import help_text

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIGS = sorted((REPO_ROOT / "configs").glob("*.toml"))


def declared_keys() -> list[str]:
    """Every key config.py declares, e.g. "device", "run.max_steps": the tests below check behaviour for
    whatever keys exist, so adding a key breaks none of them."""
    keys = []
    for section in dataclasses.fields(Config):
        if dataclasses.is_dataclass(section.type):
            keys += [
                f"{section.name}.{declaration.name}"
                for declaration in dataclasses.fields(section.type)
                if not declaration.metadata.get("own")  # the chosen piece's own keys: tests/test_registry.py
            ]
        else:
            keys.append(section.name)
    return keys


def section_names() -> list[str]:
    return [section.name for section in dataclasses.fields(Config) if dataclasses.is_dataclass(section.type)]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def error_message(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(argv)
    message = str(caught.value)
    assert "\n" not in message, "a config error is one line"
    return message


# ---------------------------------------------------------------------------------------------------------
# Defaults and round trips


def test_defaults_are_the_documented_values():
    # The values the README, the shipped configs and the batch arithmetic below rely on.
    assert load_config([]) == Config()
    config = Config()
    assert config.device == "auto"
    assert (config.run.seed, config.run.max_steps, config.run.resume) == (1337, 600, "auto")
    assert (config.batch.global_batch_size, config.batch.micro_batch_size, config.batch.tail) == (32, 4, "drop")
    assert (config.data.source, config.data.seq_len) == ("stdlib", 128)
    model = config.model
    assert (model.name, model.n_layer, model.n_head, model.d_model, model.vocab_size) == ("gpt", 4, 4, 128, 0)
    assert (config.optim.name, config.optim.lr, config.optim.grad_clip) == ("adamw", 3e-3, 1.0)
    assert (config.precision.dtype, config.precision.grad_scaler) == ("fp32", "auto")


def test_config_to_dict_uses_plain_types_and_round_trips():
    def plain(value):
        if isinstance(value, dict):
            return all(type(key) is str and plain(inner) for key, inner in value.items())
        return type(value) in (str, int, float, bool)

    tree = config_to_dict(Config())
    assert plain(tree)
    assert config_from_dict(tree) == Config()
    changed = load_config(["optim.name=sgd", "model.dropout=0.2", "precision.grad_scaler=true", "device=cpu"])
    assert config_from_dict(config_to_dict(changed)) == changed


def test_config_from_dict_fills_missing_keys_with_defaults_and_validates():
    assert config_from_dict({"run": {"max_steps": 7}}).run == dataclasses.replace(Config().run, max_steps=7)
    with pytest.raises(ConfigError, match=r"^run\.max_steps: expected an integer >= 0, got 2\.5$"):
        config_from_dict({"run": {"max_steps": 2.5}})
    with pytest.raises(ConfigError, match=r"^unknown key run\.bogus "):
        config_from_dict({"run": {"bogus": 1}})


def test_config_is_read_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().run.max_steps = 5


def test_every_key_is_declared_with_default_help_and_unit():
    declared = []
    for section in dataclasses.fields(Config):
        if dataclasses.is_dataclass(section.type):
            for declaration in dataclasses.fields(section.type):
                if not declaration.metadata.get("own"):  # the chosen piece's own keys: tests/test_registry.py
                    declared.append((f"{section.name}.{declaration.name}", declaration))
        else:
            declared.append((section.name, section))
    for key, declaration in declared:
        assert declaration.default is not dataclasses.MISSING, key
        assert declaration.metadata["help"], key
        assert "unit" in declaration.metadata, key


# ---------------------------------------------------------------------------------------------------------
# Shipped configs


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda path: path.name)
def test_shipped_config_loads_and_is_headed_by_its_command(path):
    config = load_config(["--config", str(path)])
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#")
    header = text[: text.index("\n\n")]  # the opening comment block
    assert f"train.py --config configs/{path.name}" in header
    assert config.batch.global_batch_size % config.batch.micro_batch_size == 0


def test_the_expected_configs_are_shipped():
    assert {path.name for path in SHIPPED_CONFIGS} >= {"default.toml", "gpu_8x.toml", "multinode.toml"}


def test_default_toml_is_exactly_the_defaults_and_lists_every_key():
    path = REPO_ROOT / "configs" / "default.toml"
    assert load_config(["--config", str(path)]) == Config()
    with open(path, "rb") as file:
        assert tomllib.load(file) == config_to_dict(Config())  # every declared key, at its default
    assert path.read_text(encoding="utf-8").startswith("# python train.py --config configs/default.toml\n")


def test_default_global_batch_divides_for_1_2_4_and_8_ranks():
    batch = Config().batch
    for world_size, accumulation_steps in ((1, 8), (2, 4), (4, 2), (8, 1)):
        assert batch.global_batch_size == batch.micro_batch_size * accumulation_steps * world_size


def test_gpu_configs_fit_their_world_sizes():
    gpu_8x = load_config(["--config", str(REPO_ROOT / "configs" / "gpu_8x.toml")])
    assert gpu_8x.device == "cuda" and gpu_8x.precision.dtype == "bf16"
    assert gpu_8x.batch.global_batch_size == gpu_8x.batch.micro_batch_size * 2 * 8
    multinode = load_config(["--config", str(REPO_ROOT / "configs" / "multinode.toml")])
    assert multinode.batch.global_batch_size % (16 * multinode.batch.micro_batch_size) == 0
    text = (REPO_ROOT / "configs" / "multinode.toml").read_text(encoding="utf-8")
    assert "--nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500" in text


# ---------------------------------------------------------------------------------------------------------
# Overrides


def test_overrides_are_converted_by_the_type_of_the_key():
    config = load_config(
        [
            "run.max_steps=12",
            "run.seed=-0",
            "optim.lr=3e-4",
            "optim.weight_decay=0",
            "model.compile=true",
            "run.name=my run",
            "data.source='/data/my text.txt'",
            'run.out_dir="out"',
            "device=cpu",
        ]
    )
    assert config.run.max_steps == 12 and type(config.run.max_steps) is int
    assert config.run.seed == 0
    assert config.optim.lr == 3e-4
    assert config.optim.weight_decay == 0.0 and type(config.optim.weight_decay) is float
    assert config.model.compile is True
    assert config.run.name == "my run"
    assert config.data.source == "/data/my text.txt"
    assert config.run.out_dir == "out"
    assert config.device == "cpu"


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ('"auto"', "auto"), ("true", True), ("false", False)])
def test_grad_scaler_override(text, expected):
    assert load_config([f"precision.grad_scaler={text}"]).precision.grad_scaler == expected


def test_a_key_given_twice_takes_its_last_value(tmp_path):
    path = write(tmp_path, "[run]\nmax_steps = 5\nseed = 3\n")
    config = load_config(["--config", path, "run.max_steps=6", "run.max_steps=7"])
    assert config.run.max_steps == 7
    assert config.run.seed == 3  # from the file, untouched
    assert load_config([f"--config={path}"]).run.max_steps == 5


def test_an_override_can_repair_a_combination_the_file_alone_gets_wrong(tmp_path):
    path = write(tmp_path, "[model]\nd_model = 130\n")
    with pytest.raises(ConfigError, match=r"^model\.d_model"):
        load_config(["--config", path])
    assert load_config(["--config", path, "model.n_head=5"]).model.d_model == 130


@pytest.mark.parametrize("text", ["2.5", "1e3", "true", "12abc", "", '"12"'])
def test_integer_keys_accept_only_integer_literals(text):
    message = error_message([f"run.max_steps={text}"])
    assert message == f"run.max_steps: expected an integer >= 0, got {text}"


def test_command_line_numbers_are_read_as_toml_reads_them():
    # The same spelling a config file accepts: underscores between digits, an exponent for a number key.
    config = load_config(["run.max_steps=1_000", "optim.lr=1e-3", "optim.grad_clip=2"])
    assert (config.run.max_steps, config.optim.lr, config.optim.grad_clip) == (1000, 1e-3, 2.0)
    assert type(config.optim.grad_clip) is float


@pytest.mark.parametrize("text", ["abc", "1.2.3", "true", "nan", "inf"])
def test_number_keys_reject_non_numbers(text):
    assert error_message([f"optim.lr={text}"]).startswith("optim.lr: expected a finite number > 0, got ")


def test_a_number_too_large_for_a_float_is_rejected():
    assert error_message(["optim.lr=1e999"]) == "optim.lr: expected a finite number > 0, got inf"


@pytest.mark.parametrize("text", ["yes", "1", "True", ""])
def test_bool_keys_accept_only_true_or_false(text):
    assert error_message([f"precision.tf32={text}"]) == f"precision.tf32: expected true or false, got {text}"


# ---------------------------------------------------------------------------------------------------------
# Errors: each names the key and what is allowed


def test_unknown_section():
    message = error_message(["modle.n_layer=2"])
    assert message == f"unknown section [modle] (sections: {', '.join(section_names())})"
    assert "model" in section_names()


def test_unknown_section_in_a_file(tmp_path):
    assert error_message(["--config", write(tmp_path, "[modle]\nn_layer = 2\n")]).startswith(
        "unknown section [modle] (sections: run, "
    )


def test_unknown_key():
    model_keys = ", ".join(d.name for d in dataclasses.fields(Config().model) if not d.metadata.get("own"))
    assert error_message(["model.d_modle=64"]) == f"unknown key model.d_modle (model has: {model_keys})"
    assert "d_model" in model_keys


def test_unknown_key_in_a_file(tmp_path):
    assert error_message(["--config", write(tmp_path, "[model]\nd_modle = 64\n")]).startswith(
        "unknown key model.d_modle (model has: "
    )
    assert error_message(["--config", write(tmp_path, 'devise = "cpu"\n')]).startswith("unknown key devise ")


def test_a_section_that_is_not_a_table(tmp_path):
    assert error_message(["--config", write(tmp_path, "run = 3\n")]) == "run: expected a section [run] of keys, got 3"


@pytest.mark.parametrize(
    "toml_line, message",
    [
        ("max_steps = 2.5", "run.max_steps: expected an integer >= 0, got 2.5"),
        ("max_steps = 100.0", "run.max_steps: expected an integer >= 0, got 100.0"),
        ("max_steps = true", "run.max_steps: expected an integer >= 0, got true"),
        ('max_steps = "100"', 'run.max_steps: expected an integer >= 0, got "100"'),
        ("max_steps = [1]", "run.max_steps: expected an integer >= 0, got [1]"),
        ("name = 5", "run.name: expected a non-empty string, got 5"),
        ('name = ""', 'run.name: expected a non-empty string, got ""'),
        ("resume = true", 'run.resume: expected one of "auto", "never", got true'),
    ],
)
def test_wrong_types_in_a_file(tmp_path, toml_line, message):
    assert error_message(["--config", write(tmp_path, f"[run]\n{toml_line}\n")]) == message


def test_wrong_types_for_numbers_and_bools_in_a_file(tmp_path):
    assert error_message(["--config", write(tmp_path, "[optim]\nlr = true\n")]) == (
        "optim.lr: expected a finite number > 0, got true"
    )
    assert error_message(["--config", write(tmp_path, "[optim]\nlr = nan\n")]) == (
        "optim.lr: expected a finite number > 0, got nan"
    )
    assert error_message(["--config", write(tmp_path, "[precision]\ntf32 = 1\n")]) == (
        "precision.tf32: expected true or false, got 1"
    )
    assert error_message(["--config", write(tmp_path, "[precision]\ngrad_scaler = 1\n")]) == (
        'precision.grad_scaler: expected one of "auto", true, false, got 1'
    )


def test_an_integer_where_a_number_is_expected_becomes_a_float(tmp_path):
    config = load_config(["--config", write(tmp_path, "[optim]\nlr = 1\ngrad_clip = 0\n")])
    assert config.optim.lr == 1.0 and type(config.optim.lr) is float
    assert config.optim.grad_clip == 0.0 and type(config.optim.grad_clip) is float


@pytest.mark.parametrize(
    "argument, message",
    [
        ("run.max_steps=-1", "run.max_steps: expected an integer >= 0, got -1"),
        ("run.log_every=0", "run.log_every: expected an integer >= 1, got 0"),
        ("run.keep_checkpoints=0", "run.keep_checkpoints: expected an integer >= 1, got 0"),
        ("run.seed=4294967296", "run.seed: expected an integer >= 0 and <= 4294967295, got 4294967296"),
        ("batch.micro_batch_size=0", "batch.micro_batch_size: expected an integer >= 1, got 0"),
        ("data.val_fraction=1", "data.val_fraction: expected a finite number >= 0 and < 1, got 1.0"),
        ("model.dropout=-0.1", "model.dropout: expected a finite number >= 0 and < 1, got -0.1"),
        ("optim.lr=0", "optim.lr: expected a finite number > 0, got 0.0"),
        ("optim.momentum=1.0", "optim.momentum: expected a finite number >= 0 and < 1, got 1.0"),
        ("optim.beta2=0", "optim.beta2: expected a finite number > 0 and < 1, got 0.0"),
        ("optim.grad_clip=-1", "optim.grad_clip: expected a finite number >= 0, got -1.0"),
        ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio: expected a finite number >= 0 and <= 1, got 1.5"),
        ("model.vocab_size=-1", "model.vocab_size: expected an integer >= 0, got -1"),
        ("dist.timeout_s=0", "dist.timeout_s: expected an integer >= 1, got 0"),
    ],
)
def test_out_of_range(argument, message):
    assert error_message([argument]) == message


def test_edges_of_ranges_are_allowed():
    config = load_config(
        ["run.max_steps=0", "run.eval_every=0", "data.val_fraction=0", "optim.grad_clip=0", "schedule.min_lr_ratio=1"]
    )
    assert (config.run.max_steps, config.optim.grad_clip, config.schedule.min_lr_ratio) == (0, 0.0, 1.0)


@pytest.mark.parametrize(
    "argument, message",
    [
        ("optim.name=adam", 'optim.name: expected one of "adamw", "sgd", got "adam"'),
        ("run.resume=always", 'run.resume: expected one of "auto", "never", got "always"'),
        ("batch.tail=pad", 'batch.tail: expected one of "drop", "partial", got "pad"'),
        ("schedule.name=linear", 'schedule.name: expected one of "cosine", "constant", got "linear"'),
        ("precision.dtype=fp8", 'precision.dtype: expected one of "fp32", "bf16", "fp16", got "fp8"'),
        ("precision.grad_scaler=yes", 'precision.grad_scaler: expected one of "auto", true, false, got "yes"'),
        ("optim.on_nonfinite=ignore", 'optim.on_nonfinite: expected one of "skip", "stop", got "ignore"'),
        ("device=tpu", 'device: expected one of "auto", "cpu", "cuda", got "tpu"'),
    ],
)
def test_bad_choice(argument, message):
    assert error_message([argument]) == message


def test_an_unknown_model_name_lists_the_registered_ones():
    # The built-ins first; the pieces of any fork module imported so far follow them (tests/test_registry.py).
    message = error_message(["model.name=lstm"])
    assert message.startswith('model.name: expected one of "gpt", "gru", "encoder"')
    assert message.endswith(', or a module:name import path, got "lstm"')


def test_d_model_must_be_divisible_by_n_head_for_the_gpt():
    assert error_message(["model.d_model=130"]) == (
        "model.d_model: expected a multiple of model.n_head (4) for the gpt, got 130"
    )
    assert load_config(["model.d_model=132", "model.n_head=3"]).model.d_model == 132


def test_n_head_is_not_checked_for_the_gru():
    config = load_config(["model.name=gru", "model.d_model=130"])
    assert (config.model.name, config.model.d_model, config.model.n_head) == ("gru", 130, 4)


def test_micro_batch_may_not_exceed_global_batch():
    assert error_message(["batch.micro_batch_size=64"]) == (
        "batch.micro_batch_size: expected an integer <= batch.global_batch_size (32), got 64"
    )
    assert load_config(["batch.micro_batch_size=32"]).batch.micro_batch_size == 32


def test_warmup_must_fit_in_an_explicit_decay_horizon():
    assert error_message(["schedule.decay_updates=20"]) == (
        "schedule.warmup_updates: expected an integer <= schedule.decay_updates (20), got 30"
    )
    assert load_config(["schedule.decay_updates=30"]).schedule.decay_updates == 30
    # decay_updates = 0 means run.max_steps, which may still grow on resume: a short run is allowed.
    assert load_config(["run.max_steps=10"]).schedule.warmup_updates == 30


def test_grad_scaler_with_fp32_is_allowed_and_auto_means_fp16_only():
    assert resolved_grad_scaler(load_config(["precision.grad_scaler=true"])) is True
    assert resolved_grad_scaler(load_config([])) is False
    assert resolved_grad_scaler(load_config(["precision.dtype=bf16"])) is False
    assert resolved_grad_scaler(load_config(["precision.dtype=fp16"])) is True
    assert resolved_grad_scaler(load_config(["precision.dtype=fp16", "precision.grad_scaler=false"])) is False


def test_compile_auto_means_cuda_under_ddp_only():
    assert resolved_compile(load_config([]), "cuda") is True
    assert resolved_compile(load_config([]), "cpu") is False  # compiling on a CPU takes longer than it saves
    assert resolved_compile(load_config(["dist.strategy=fsdp2"]), "cuda") is False
    assert resolved_compile(load_config(["model.compile=true"]), "cpu") is True
    assert resolved_compile(load_config(["model.compile=false"]), "cuda") is False


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    message = error_message(["--config", missing])
    assert message.startswith(f"--config {missing}: cannot read the file")


def test_config_file_that_is_a_directory(tmp_path):
    assert error_message(["--config", str(tmp_path)]).startswith(f"--config {tmp_path}: cannot read the file")


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[run\nmax_steps = \n")
    assert error_message(["--config", path]).startswith(f"--config {path}: not valid TOML (")


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    assert error_message(["--config", str(path)]).startswith(f"--config {path}: not valid TOML (")


@pytest.mark.parametrize("argument", ["max_steps", "--verbose", "=3", "--help", "--configure"])
def test_an_argument_that_is_not_key_equals_value(argument):
    message = error_message([argument])
    assert message.startswith(f"unexpected argument {argument!r}: expected section.key=value")


def test_config_must_come_first_and_needs_a_file(tmp_path):
    assert error_message(["--config"]) == "--config: expected a file name after --config"
    path = write(tmp_path, "[run]\nmax_steps = 5\n")
    assert error_message(["run.seed=1", "--config", path]).startswith("unexpected argument '--config'")


def test_a_top_level_name_that_is_a_section():
    assert error_message(["run=3"]).startswith("unknown key run (top-level keys: device;")


# ---------------------------------------------------------------------------------------------------------
# --help and TOML output


def test_help_text_lists_every_key_with_its_default_and_unit():
    text = help_text()
    assert "python train.py [--config FILE] [section.key=value ...]" in text
    assert "torchrun --standalone --nproc_per_node=N train.py" in text
    for key in declared_keys():
        assert f"  {key} = " in text, key
    assert "  run.max_steps = 600    (an integer >= 0; unit: steps)" in text
    assert '  optim.name = "adamw"    (one of "adamw", "sgd")' in text
    assert "  optim.lr = 0.003    (a finite number > 0)" in text
    assert "  dist.timeout_s = 300    (an integer >= 1; unit: seconds)" in text
    assert "  batch.global_batch_size = 32    (an integer >= 1; unit: examples)" in text
    assert "  schedule.warmup_updates = 30    (an integer >= 0; unit: updates)" in text
    for section in ("[run]", "[batch]", "[data]", "[model]", "[optim]", "[schedule]", "[precision]", "[dist]"):
        assert f"\n{section}\n" in text
    for section in dataclasses.fields(Config):
        declarations = dataclasses.fields(section.type) if dataclasses.is_dataclass(section.type) else [section]
        for declaration in declarations:
            if not declaration.metadata.get("own"):  # the chosen piece's own keys: tests/test_registry.py
                assert f"      {declaration.metadata['help']}\n" in text, declaration.name


def test_to_toml_round_trips_through_a_file(tmp_path):
    config = load_config(
        [
            'run.name=a "quoted" name \\ and caf\u00e9',  # a run name holds no control character
            "run.out_dir=/tmp/x\u007fy\twith tab",
            "optim.lr=1e-5",
            "optim.weight_decay=0.30000000000000004",
            "model.compile=true",
            "precision.grad_scaler=false",
            "schedule.decay_updates=1000",
            "device=cpu",
        ]
    )
    text = config_to_toml(config)
    assert tomllib.loads(text) == config_to_dict(config)
    assert load_config(["--config", write(tmp_path, text)]) == config


def test_to_toml_of_the_defaults_reads_back_as_the_defaults(tmp_path):
    text = config_to_toml(Config())
    assert load_config(["--config", write(tmp_path, text)]) == Config()
    assert tomllib.loads(text) == config_to_dict(Config())


# ---------------------------------------------------------------------------------------------------------
# The data keys of "Real data at scale"


def test_the_data_keys_are_declared_listed_and_checked(capsys):
    config = Config()
    assert (config.data.layout, config.data.tokenizer, config.data.val_rows) == ("auto", "bytes", 1024)
    assert load_config(["data.layout=packed", "data.val_rows=0"]).data.layout == "packed"
    for argument, message in [
        ("data.layout=rows", 'data.layout: expected one of "auto", "documents", "packed", got "rows"'),
        ("data.val_rows=-1", "data.val_rows: expected an integer >= 0, got -1"),
        ("data.tokenizer=", "data.tokenizer: expected a non-empty string"),
    ]:
        with pytest.raises(ConfigError, match=message):  # no regex metacharacters but "."
            load_config([argument])
    text = help_text()
    for key in ("data.layout", "data.tokenizer", "data.val_rows"):
        assert key in text
