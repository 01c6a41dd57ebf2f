"""Typed configuration, validated when it is loaded: the defaults, then an optional TOML file (--config FILE), then
`section.key=value` overrides. Every key is declared once, in config_keys.py (docs/training.md, "Configuration");
this module reads them, checks every value and combination, and says what is wrong in one line."""

import dataclasses
import json
import math
import operator
import os
import tomllib
from dataclasses import dataclass, field, fields

import tomli_w

from accumulation.config.config_keys import (
    BatchConfig,
    DataConfig,
    DistConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    setting,
)
from accumulation.config.registry import GENERIC_MODEL_KEYS, Piece, RegistryError, is_piece_name, lookup


class ConfigError(ValueError):
    """A configuration problem. The message is one line that names the key and what it allows."""


class PieceError(ConfigError):
    """model.name, data.source or model.objective names no piece, or names a fork's module that cannot be imported:
    --help stops on it too, since it could not list that piece's keys."""


@dataclass(frozen=True)
class Config:
    """The whole configuration: one read-only section per TOML table, plus the top-level `device`. Making one checks
    every value, so any Config that exists is valid. Number keys hold floats: `lr = 1` is read as 1.0."""

    run: RunConfig = field(default_factory=RunConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    device: str = setting("auto", "auto: cuda when a GPU is present, else cpu", choices=("auto", "cpu", "cuda"))

    def __post_init__(self):
        _check_pieces(self)
        for key, declaration, value in settings_of(self):
            _check_value(key, value, declaration)
        _check_combinations(self)


# ---------------------------------------------------------------------------------------------------------
# Walking the declarations
# ---------------------------------------------------------------------------------------------------------


def _section_types() -> dict[str, type]:
    """{"run": RunConfig, "batch": BatchConfig, ...}, in the order they are declared."""
    return {f.name: f.type for f in fields(Config) if dataclasses.is_dataclass(f.type)}


def _top_level_fields() -> dict[str, dataclasses.Field]:
    """The keys that live outside any section: {"device": <field>}."""
    return {f.name: f for f in fields(Config) if not dataclasses.is_dataclass(f.type)}


def _section_fields(section) -> list[tuple[dataclasses.Field, object]]:
    """A section's (declaration, value) pairs: its declared keys, then the chosen piece's own keys (`own`, last)."""
    found = [(declaration, getattr(section, declaration.name)) for declaration in fields(section)]
    own = getattr(section, "own", None)
    own_fields = [(declaration, getattr(own, declaration.name)) for declaration in fields(own)] if own else []
    return [(declaration, value) for declaration, value in found if declaration.name != "own"] + own_fields


def settings_of(config: Config) -> list[tuple[str, dataclasses.Field, object]]:
    """Every (key, declaration, value) of a config, e.g. ("run.max_steps", <field>, 600), top level first."""
    found = [(name, declaration, getattr(config, name)) for name, declaration in _top_level_fields().items()]
    for section_name in _section_types():
        for declaration, value in _section_fields(getattr(config, section_name)):
            found.append((f"{section_name}.{declaration.name}", declaration, value))
    return found


# The sections whose chosen piece may bring its own keys, and the key that chooses it.
OWNED_SECTIONS = {"model": "name", "data": "source"}
_CHOOSING_KEYS = {f"{section_name}.{key}" for section_name, key in OWNED_SECTIONS.items()}


def _piece_of(section_name: str, name) -> Piece | None:
    """The registered piece a section's choosing key names (model.name, data.source), or None: a data.source that
    is a path, or a value of the wrong type (its own check reports it)."""
    if type(name) is not str or (section_name == "data" and not is_piece_name(section_name, name)):
        return None
    try:
        return lookup(section_name, name)
    except RegistryError as error:
        raise PieceError(f"{section_name}.{OWNED_SECTIONS[section_name]}: {error}") from None


def unused_model_keys(model_name) -> list[str]:
    """The generic model keys ("model.n_layer", ...) the model `model_name` names does not read (its registration's
    generic_keys): refused when set, left out of --help, of config.toml and checkpoints, and of the resume check."""
    piece = _piece_of("model", model_name)
    return [f"model.{key}" for key in GENERIC_MODEL_KEYS if piece is not None and key not in piece.generic_keys]


def _own_types(pairs: dict[str, object]) -> dict[str, type | None]:
    """{"model": the chosen model's settings dataclass or None, "data": ...}, from the choosing keys in `pairs`."""
    section_types = _section_types()
    owns = {}
    for section_name, choosing_key in OWNED_SECTIONS.items():
        default = getattr(section_types[section_name](), choosing_key)
        piece = _piece_of(section_name, pairs.get(f"{section_name}.{choosing_key}", default))
        owns[section_name] = piece.settings if piece is not None else None
    return owns


def _check_pieces(config: Config) -> None:
    """Check that model.name (and data.source, when it names a source) names a registered piece, whose own
    settings, if it declares any, its section holds; and that model.objective names a registered loss."""
    for section_name, choosing_key in OWNED_SECTIONS.items():
        section = getattr(config, section_name)
        piece = _piece_of(section_name, getattr(section, choosing_key))
        expected = piece.settings if piece is not None else None
        if section.own is not None or expected is not None:
            _attach_own_settings(section, f"{section_name}.{choosing_key}", expected)
    if config.model.objective:
        try:
            lookup("loss", config.model.objective)
        except RegistryError as error:
            raise PieceError(f"model.objective: {error}") from None


def _declaration(key: str, owns: dict[str, type | None]) -> dataclasses.Field:
    """The declaration of "section.key" (or of a top-level key); unknown names are a ConfigError. `owns` gives
    the own settings of the pieces the config chooses (_own_types): their keys belong to their sections."""
    section_name, dot, name = key.partition(".")
    section_types = _section_types()
    if not dot:
        top_level = _top_level_fields()
        if key not in top_level:
            raise ConfigError(
                f"unknown key {key} (top-level keys: {', '.join(top_level)}; all others are written section.key)"
            )
        return top_level[key]
    if section_name not in section_types:
        raise ConfigError(f"unknown section [{section_name}] (sections: {', '.join(section_types)})")
    declarations = {f.name: f for f in fields(section_types[section_name]) if not f.metadata.get("own")}
    own_type = owns.get(section_name)
    if own_type is not None:
        declarations = _with_own_declarations(declarations, section_name, own_type)
    if name not in declarations:
        raise ConfigError(f"unknown key {key} ({section_name} has: {', '.join(declarations)})")
    return declarations[name]


# The own settings of the model or data source a config chooses (`settings=` where it is registered): a frozen
# dataclass of setting(...) fields, keys of the piece's section (`model.path` for a model's `path`) like every other
# (docs/forking.md, "A fork is one file and a config"). The section holds the instance in its `own` field.


def _with_own_declarations(declarations: dict, section_name: str, own_type: type) -> dict:
    """A section's declarations {name: field} with own_type's added; a key the section already has is refused."""
    for declaration in fields(own_type):
        if declaration.name in declarations:
            raise ConfigError(
                f"{section_name}.{declaration.name}: {own_type.__name__} declares a key that [{section_name}] "
                f"already has"
            )
    return {**declarations, **{declaration.name: declaration for declaration in fields(own_type)}}


def _with_own_settings(values: dict, own_type: type) -> dict:
    """A section's values {name: value} with own_type's keys gathered into `own`, an own_type instance (its
    defaults for the keys not given)."""
    own_names = {declaration.name for declaration in fields(own_type)}
    own = own_type(**{name: value for name, value in values.items() if name in own_names})
    return {**{name: value for name, value in values.items() if name not in own_names}, "own": own}


def _attach_own_settings(section, choosing_key: str, expected: type | None) -> None:
    """Give `section` the own settings `expected` (the chosen piece's settings, or None): their defaults when none
    were given; refused when the section holds another piece's."""
    own = section.own
    if own is None and expected is not None:
        object.__setattr__(section, "own", expected())  # frozen: set once, while the Config is made
    elif own is not None and type(own) is not expected:
        raise ConfigError(
            f"{choosing_key}: {getattr(section, choosing_key.partition('.')[2])!r} takes "
            f"{'no own keys' if expected is None else expected.__name__}, but the section holds {type(own).__name__}"
        )


# ---------------------------------------------------------------------------------------------------------
# Checking values
# ---------------------------------------------------------------------------------------------------------

# The bounds setting() declares, the comparison a value must pass, and its symbol in words.
_BOUNDS = {"at_least": operator.ge, "above": operator.gt, "at_most": operator.le, "below": operator.lt}
_BOUND_SYMBOLS = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}
_TYPE_WORDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a non-empty string"}
# The longest file name Linux file systems accept, in bytes (NAME_MAX).
NAME_MAX_BYTES = 255


def _is_allowed(value, declaration: dataclasses.Field) -> bool:
    metadata = declaration.metadata
    if metadata["choices"] is not None:
        # Compare types too: 1 == True in Python, but 1 is not an allowed value of precision.grad_scaler.
        return any(type(value) is type(choice) and value == choice for choice in metadata["choices"])
    # type(), not isinstance: bool is a subclass of int, and true is not a count
    if type(value) is not declaration.type or (type(value) is float and not math.isfinite(value)):
        return False
    if value == "":
        return declaration.default == ""  # "" means none only where it is the declared default
    return all(test(value, metadata[name]) for name, test in _BOUNDS.items() if metadata[name] is not None)


def _check_value(key: str, value, declaration: dataclasses.Field) -> None:
    if isinstance(value, str) and any("\ud800" <= character <= "\udfff" for character in value):
        # Lone surrogates: a command-line argument's bytes that are not UTF-8 arrive so (os.fsdecode). The run's
        # config.toml, a UTF-8 file, cannot record them, so the run could never be repeated from it.
        shown = os.fsencode(value).decode("utf-8", errors="backslashreplace")
        raise ConfigError(
            f"{key}: {shown!r} holds bytes that are not UTF-8, which the run's config.toml cannot record; use a "
            f"UTF-8 name (for a file or folder: rename it, or link to it under a UTF-8 name)"
        )
    if not _is_allowed(value, declaration):
        raise ConfigError(expected_text(key, declaration, value_text(value)))


def value_text(value) -> str:
    """A value in TOML's spelling: "adamw", true, 0.003, inf."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # inf, -inf, nan: TOML's words (JSON has none)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (str, int, float)) else repr(value)


def allowed_text(declaration: dataclasses.Field) -> str:
    """What a key accepts, in words: 'an integer >= 0', 'one of "adamw", "sgd"', 'true or false'."""
    metadata = declaration.metadata
    if metadata["choices"] is not None:
        return "one of " + ", ".join(value_text(choice) for choice in metadata["choices"])
    words = _TYPE_WORDS[declaration.type]
    if declaration.type is str and declaration.default == "":
        words = 'a string ("" = none)'
    bounds = [f"{symbol} {metadata[name]}" for name, symbol in _BOUND_SYMBOLS.items() if metadata[name] is not None]
    return f"{words} {' and '.join(bounds)}" if bounds else words


def expected_text(key: str, declaration: dataclasses.Field, got: str) -> str:
    """The one line for a value a key does not allow: "optim.lr: expected a finite number > 0, got -1.0"."""
    return f"{key}: expected {allowed_text(declaration)}, got {got}"


def _check_combinations(config: Config) -> None:
    """Rules that involve more than one key (train.py checks the batch against the world size, which it knows)."""
    batch, schedule = config.batch, config.schedule
    problem = run_name_problem(config.run.name)
    if problem:
        raise ConfigError(f"run.name: expected one folder name inside run.out_dir, got {config.run.name!r}: {problem}")
    # The rules of the chosen model and data source, declared where they are registered (e.g. the encoder's).
    for section_name, choosing_key in OWNED_SECTIONS.items():
        piece = _piece_of(section_name, getattr(getattr(config, section_name), choosing_key))
        if piece is not None and piece.check is not None:
            try:
                piece.check(config)
            except ValueError as error:  # a ConfigError too: the same one line
                raise ConfigError(str(error)) from None
    for name in config.log.sinks.split(","):  # each sink named is registered (wandb, mlflow: their package installed)
        _check_sink(name.strip(), config)
    if batch.micro_batch_size > batch.global_batch_size:
        raise ConfigError(
            f"batch.micro_batch_size: expected an integer <= batch.global_batch_size "
            f"({batch.global_batch_size}), got {batch.micro_batch_size}"
        )
    # lr <= 100, above any published setting (SGD linear probes use 30): an AdamW update moves each weight by about
    # lr. Decay multiplies each decayed weight by 1 - lr * weight_decay per update (AdamW; SGD's L2 term alike).
    optim = config.optim
    if optim.lr > 100:
        raise ConfigError(f"optim.lr: expected a number <= 100, got {optim.lr:g} (a minus sign lost from an exponent?)")
    if optim.lr * optim.weight_decay >= 1:
        raise ConfigError(
            f"optim.weight_decay: expected optim.lr x optim.weight_decay < 1, got {optim.lr:g} x {optim.weight_decay:g}"
            f": each update multiplies every decayed weight by 1 - lr x weight_decay, which must stay positive; "
            f"lower optim.weight_decay (typically 0 to 0.1) or optim.lr"
        )
    # With decay_updates = 0 the horizon is run.max_steps, which may grow on resume: not checked here.
    if schedule.name == "cosine" and schedule.decay_updates > 0 and schedule.warmup_updates > schedule.decay_updates:
        raise ConfigError(
            f"schedule.warmup_updates: expected an integer <= schedule.decay_updates "
            f"({schedule.decay_updates}), got {schedule.warmup_updates}"
        )


def _check_sink(name: str, config: Config) -> None:
    try:
        piece = lookup("sink", name)
        if piece.check is not None:
            piece.check(config)
    except (RegistryError, ValueError) as error:
        raise ConfigError(f"log.sinks: {error}") from None


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot be a run directory's name, or None. It is joined to run.out_dir, so it must be one
    path component: a "/" or ".." would put the run elsewhere (an absolute name replaces out_dir whole), and
    "." would be out_dir itself."""
    if name in ("", ".", ".."):
        return "choose a name such as my-run"
    if "/" in name:
        return "it holds a path separator; use one name, and run.out_dir for the folder"
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
        return "it holds a control character (a newline, a tab); use printable characters"
    if len(os.fsencode(name)) > NAME_MAX_BYTES:
        return f"{len(os.fsencode(name))} bytes, more than the {NAME_MAX_BYTES} a file name may have"
    return None


# ---------------------------------------------------------------------------------------------------------
# Reading: command-line overrides, TOML files and plain dicts all become {"section.key": value}
# ---------------------------------------------------------------------------------------------------------


def _unquoted(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _value_from_text(key: str, text: str, declaration: dataclasses.Field):
    """A command-line override's value: for a string key the text, quotes removed; else the TOML value the text
    spells (3e-4, 1_000, true; "auto" stays text). A value of another type than the key's is refused, quoting the
    text: "2.5" for an integer is an error, never rounded."""
    if declaration.type is str:
        return _unquoted(text)
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = _unquoted(text)
    types = (int, float) if declaration.type is float else (declaration.type,)  # `lr=1` means 1.0
    if declaration.type in (int, float, bool) and type(value) not in types:
        raise ConfigError(expected_text(key, declaration, text))
    return value


def _split_argument(argument: str) -> tuple[str, str]:
    """'optim.lr=3e-4' -> ("optim.lr", "3e-4"): the key and its text, converted once the key's type is known."""
    key, equals, text = argument.partition("=")
    if not equals or not key:
        raise ConfigError(
            f"unexpected argument {argument!r}: expected section.key=value, e.g. run.max_steps=100 "
            f"(an optional --config FILE comes first)"
        )
    return key, text


def _config_from_pairs(pairs: dict[str, object], texts: list[tuple[str, str]] = ()) -> Config:
    """Build and validate a Config from `pairs` (typed values, from a file or a dict) then `texts` (command-line
    text, converted by each key's type); keys given in neither keep their defaults. The choosing keys (model.name,
    data.source) are read first, because they decide which other keys exist: the chosen pieces' own keys."""
    choosing = {**pairs, **{key: _unquoted(text) for key, text in texts if key in _CHOOSING_KEYS}}
    owns = _own_types(choosing)
    pairs = {**pairs, **{key: _value_from_text(key, text, _declaration(key, owns)) for key, text in texts}}
    section_values = {section_name: {} for section_name in _section_types()}
    top_level_values = {}
    for key, value in pairs.items():
        if _declaration(key, owns).type is float and type(value) is int:  # an unknown key is a ConfigError here
            value = float(value)  # `lr = 1` means 1.0; the reverse (a float for an integer) is an error
        section_name, dot, name = key.partition(".")
        if dot:
            section_values[section_name][name] = value
        else:
            top_level_values[key] = value
    for section_name, own_type in owns.items():
        if own_type is not None:
            section_values[section_name] = _with_own_settings(section_values[section_name], own_type)
    sections = {name: section_type(**section_values[name]) for name, section_type in _section_types().items()}
    return Config(**sections, **top_level_values)


def load_config(argv: list[str]) -> Config:
    """The config described by a command line (without the program name and without --help):
    an optional `--config FILE` (or `--config=FILE`), then any number of `section.key=value`."""
    pairs = {}
    arguments = list(argv)
    if arguments and arguments[0].startswith("--config"):
        pairs, arguments = _pairs_of_config_option(arguments)
    texts = [_split_argument(argument) for argument in arguments]
    # A generic model key the model does not read is refused where a user sets it; a checkpoint's config may hold it.
    given = {**pairs, **{key: _unquoted(text) for key, text in texts}}
    model_name = given.get("model.name", ModelConfig().name)
    for key in [key for key in unused_model_keys(model_name) if key in given]:
        note = _piece_of("model", model_name).generic_keys_note or "its registration does not read it"
        raise ConfigError(f"{key} does not apply to {model_name}: {note}; remove {key}")
    return _config_from_pairs(pairs, texts)


def config_from_dict(tree: dict) -> Config:
    """The inverse of config_to_dict (e.g. the config stored in a checkpoint), validated like a file."""
    return _config_from_pairs(_pairs_from_tree(tree))


def _pairs_of_config_option(arguments: list[str]) -> tuple[dict[str, object], list[str]]:
    """A command line's leading `--config FILE` or `--config=FILE`: the file's pairs and the arguments after it.
    Any other first argument ("--configure") is left to the caller, which refuses it."""
    if arguments[0] == "--config":
        if len(arguments) < 2:
            raise ConfigError("--config: expected a file name after --config")
        path, rest = arguments[1], arguments[2:]
    elif arguments[0].startswith("--config="):
        path, rest = arguments[0].removeprefix("--config="), arguments[1:]
    else:
        return {}, arguments
    try:
        with open(path, "rb") as file:
            tree = tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read the file ({error.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path}: not valid TOML ({error})") from None
    return _pairs_from_tree(tree), rest


def _pairs_from_tree(tree: dict) -> dict[str, object]:
    """{"run": {"seed": 1}, "device": "cpu"} -> {"run.seed": 1, "device": "cpu"}, rejecting unknown sections (the
    keys are checked by _config_from_pairs, once the chosen pieces, whose own keys they may be, are known)."""
    section_names = list(_section_types())
    pairs = {}
    for name, value in tree.items():
        if name in section_names:
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a section [{name}] of keys, got {value_text(value)}")
            for key, inner_value in value.items():
                pairs[f"{name}.{key}"] = inner_value
        elif isinstance(value, dict):
            raise ConfigError(f"unknown section [{name}] (sections: {', '.join(section_names)})")
        else:
            pairs[name] = value
    return pairs


def config_to_dict(config: Config) -> dict:
    """{"run": {"name": "default", ...}, ..., "device": "auto"}, as a TOML file writes them: the chosen pieces' own
    keys in their sections, without the generic model keys the model does not read (load_config refuses them)."""
    tree = {name: getattr(config, name) for name in _top_level_fields()}
    unused = unused_model_keys(config.model.name)
    for section_name in _section_types():
        section = getattr(config, section_name)
        tree[section_name] = {
            declaration.name: value
            for declaration, value in _section_fields(section)
            if f"{section_name}.{declaration.name}" not in unused
        }
    return tree


def resolved_compile(config: Config, device_type: str) -> bool:
    """Whether to torch.compile: "auto" means on for CUDA under DDP, off on the CPU and under fsdp2."""
    if config.model.compile == "auto":
        return device_type == "cuda" and config.dist.strategy == "ddp"
    return config.model.compile


def resolved_grad_scaler(config: Config) -> bool:
    """Whether to use a gradient scaler: "auto" means on for fp16 only."""
    if config.precision.grad_scaler == "auto":
        return config.precision.dtype == "fp16"
    return config.precision.grad_scaler


# ---------------------------------------------------------------------------------------------------------
# Writing: TOML for the run directory (--help is accumulation/config/help.py)
# ---------------------------------------------------------------------------------------------------------


# The first line of every config.toml this program writes: how a run directory's own file is recognised.
CONFIG_FIRST_LINE = "# The resolved configuration of this run: defaults, file and command line combined."


def config_to_toml(config: Config) -> str:
    """The resolved config as a TOML file that `--config` reads back to an equal Config."""
    header = f"{CONFIG_FIRST_LINE}\n# Run it again with: python train.py --config <this file>\n\n"
    return header + tomli_w.dumps(config_to_dict(config))
