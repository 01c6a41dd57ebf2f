"""Keys and values in words, as error messages and --help show them (accumulation/config/help.py). Imported only
to write such a line."""

import dataclasses
import json
import math

_TYPE_WORDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a non-empty string"}
# The bounds setting() declares (accumulation/config/config_keys.py), each one's symbol.
_BOUND_SYMBOLS = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}


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
