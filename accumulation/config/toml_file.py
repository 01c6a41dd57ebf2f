"""A configuration given as a TOML tree: a `--config FILE`, or the config a checkpoint stores (config_from_dict), read
into {"section.key": value} pairs that accumulation/config/config.py checks. Imported only on those paths."""

import tomllib

from accumulation.config.errors import ConfigError
from accumulation.config.key_text import value_text


def pairs_of_config_option(arguments: list[str], section_names: list[str]) -> tuple[dict[str, object], list[str]]:
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
    return pairs_from_tree(read_toml_file(path), section_names), rest


def read_toml_file(path: str) -> dict:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read the file ({error.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path}: not valid TOML ({error})") from None


def pairs_from_tree(tree: dict, section_names: list[str]) -> dict[str, object]:
    """{"run": {"seed": 1}, "device": "cpu"} -> {"run.seed": 1, "device": "cpu"}, rejecting unknown sections (the
    keys are checked by config.py's _config_from_pairs, once the chosen pieces, whose own keys they may be, are
    known)."""
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
