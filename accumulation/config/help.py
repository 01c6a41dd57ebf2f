"""`python train.py --help`: usage, then every key grouped by section with its default, the values it allows, its
unit and its meaning, then the own keys of every registered model and data source (their modules imported here:
--help is the one place that lists them all). Imported only for --help.
"""

import dataclasses
import importlib
import sys
from dataclasses import fields

from accumulation.config.config import (
    OWNED_SECTIONS,
    Config,
    ConfigError,
    PieceError,
    allowed_text,
    load_config,
    settings_of,
    unused_model_keys,
    value_text,
)
from accumulation.config.registry import BUILT_IN, REGISTERED, Piece, config_name


def _key_help(key: str, declaration: dataclasses.Field, default) -> list[str]:
    unit = declaration.metadata["unit"]
    unit_text = f"; unit: {unit}" if unit else ""
    return [
        f"  {key} = {value_text(default)}    ({allowed_text(declaration)}{unit_text})",
        f"      {declaration.metadata['help']}",
    ]


def registered(kind: str) -> dict[str, Piece]:
    """The built-in pieces of this kind (their modules imported) and those of every fork module imported so far."""
    for module_name in BUILT_IN[kind].values():
        importlib.import_module(module_name)
    return dict(REGISTERED[kind])


def print_help(argv: list[str]) -> int:
    """Print help_text(argv) and return the exit status: 0, or 2 with one line on stderr when argv names a fork's
    module that cannot be imported (its keys are unknown)."""
    try:
        print(help_text(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def help_text(argv: list[str] = ()) -> str:
    """Usage and every key, grouped by section, with its default, allowed values, unit and meaning; then the own
    keys of every registered model and data source, those of a fork that `argv` names (--config FILE, model.name=
    module:name) included. Raises PieceError when argv names a piece that cannot be found or imported."""
    lines = [
        "usage: python train.py [--config FILE] [section.key=value ...]",
        "       torchrun --standalone --nproc_per_node=N train.py [--config FILE] [section.key=value ...]",
        "",
        "Settings come from the defaults below, then the TOML file given by --config, then the command",
        "line in order; a key given twice takes its last value. Example:",
        "  python train.py --config configs/default.toml run.max_steps=100 optim.lr=1e-3",
    ]
    model_name = Config().model.name
    try:
        model_name = load_config([argument for argument in argv if argument not in ("--help", "-h")]).model.name
    except PieceError:
        raise  # a piece that cannot be found or imported: its keys cannot be listed, so say so instead
    except ConfigError:
        pass  # --help lists what it can; the run itself reports the error
    defaults = Config()
    unused = unused_model_keys(model_name)  # model.n_layer and kin, for a model that does not read them
    current_section = None
    for key, declaration, default in settings_of(defaults):
        if key in unused:
            continue
        section_name, dot, _ = key.partition(".")
        heading = f"[{section_name}]" if dot else "top level"
        if heading != current_section:
            lines += ["", heading]
            current_section = heading
        lines += _key_help(key, declaration, default)
    for section_name, choosing_key in OWNED_SECTIONS.items():
        for piece in registered(section_name).values():
            if piece.settings is None:
                continue
            lines += [
                "",
                f'[{section_name}] with {section_name}.{choosing_key} = "{config_name(piece)}"',
            ]
            for declaration in fields(piece.settings):
                lines += _key_help(f"{section_name}.{declaration.name}", declaration, declaration.default)
    return "\n".join(lines) + "\n"
