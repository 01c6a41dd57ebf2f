"""The own settings of the model or data source a config chooses (`settings=` where it is registered): a frozen
dataclass of setting(...) fields, keys of the piece's section (`model.path` for a model's `path`) like every other
(docs/forking.md, "A fork is one file and a config"). The section holds the instance in its `own` field. Imported
only when the chosen piece declares settings or a section holds some."""

from dataclasses import fields

from accumulation.config.errors import ConfigError


def with_own_declarations(declarations: dict, section_name: str, own_type: type) -> dict:
    """A section's declarations {name: field} with own_type's added; a key the section already has is refused."""
    for declaration in fields(own_type):
        if declaration.name in declarations:
            raise ConfigError(
                f"{section_name}.{declaration.name}: {own_type.__name__} declares a key that [{section_name}] "
                f"already has"
            )
    return {**declarations, **{declaration.name: declaration for declaration in fields(own_type)}}


def with_own_settings(values: dict, own_type: type) -> dict:
    """A section's values {name: value} with own_type's keys gathered into `own`, an own_type instance (its
    defaults for the keys not given)."""
    own_names = {declaration.name for declaration in fields(own_type)}
    own = own_type(**{name: value for name, value in values.items() if name in own_names})
    return {**{name: value for name, value in values.items() if name not in own_names}, "own": own}


def attach_own_settings(section, choosing_key: str, expected: type | None) -> None:
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
