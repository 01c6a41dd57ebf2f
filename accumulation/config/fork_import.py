"""A piece that no registered or built-in name names (accumulation/config/registry.py, lookup): a fork's module
named by import path ("module:name"), imported here, or no piece at all, one line naming those there are. Also
the listing of every piece, for --help and those lines. Imported only on these paths. A fork's module registers
its pieces as it is imported; whatever stops it is one line."""

import importlib

from accumulation.config.registry import BUILT_IN, IMPORT_PATH, REGISTERED, Piece, RegistryError
from accumulation.probe import fault_text


def lookup_by_import_path(kind: str, name: str) -> Piece:
    """The piece "module:name" names, its module imported first; a RegistryError for any other name."""
    if IMPORT_PATH.fullmatch(name) is None:
        raise RegistryError(f'expected one of {names_text(kind)}, or a module:name import path, got "{name}"')
    module_name, _, short_name = name.partition(":")
    problem = import_problem(module_name)
    if problem is not None:
        raise RegistryError(problem)
    if short_name not in REGISTERED[kind]:
        raise RegistryError(
            f"{module_name} registers no {kind} {short_name!r} (registered: {names_text(kind)}); "
            f"call register_{kind}({short_name!r}, ...) in it"
        )
    return REGISTERED[kind][short_name]


def import_problem(module_name: str) -> str | None:
    """Import a fork's module: None when it imported, else why not (not found, a syntax error, an exception,
    sys.exit), in one line."""
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # The module itself (or its package) not found; a module IT imports not found is a fault in the fork.
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            return (
                f"cannot import {module_name} ({error}); the module must be importable: install it, or run from "
                f"the folder that holds it, or add that folder to PYTHONPATH"
            )
        return f"cannot import {module_name}: {fault_text(error)}"
    except SystemExit as error:
        return (
            f"{module_name} exited (sys.exit({error.code!r})) while being imported; a fork's module only defines and "
            f'registers its pieces: move what runs at import under `if __name__ == "__main__":`'
        )
    except Exception as error:  # a syntax error or any exception raised at import: the fork's own fault
        return f"cannot import {module_name}: {fault_text(error)}"
    return None


def registered(kind: str) -> dict[str, Piece]:
    """The built-in pieces of this kind (their modules imported) and those of every fork module imported so far."""
    for module_name in BUILT_IN[kind].values():
        importlib.import_module(module_name)
    return dict(REGISTERED[kind])


def config_name(piece: Piece) -> str:
    """What a config writes to choose the piece: its name for a built-in, "module:name" for a fork's."""
    module_name = getattr(piece.build or piece.loss_sum_fn, "__module__", "")
    return piece.name if module_name in BUILT_IN[piece.kind].values() else f"{module_name}:{piece.name}"


def names_text(kind: str) -> str:
    """The names a config may write: the built-ins, then those of fork modules imported so far."""
    forks = [config_name(piece) for name, piece in REGISTERED[kind].items() if name not in BUILT_IN[kind]]
    return ", ".join(f'"{name}"' for name in [*BUILT_IN[kind], *forks]) or "none"
