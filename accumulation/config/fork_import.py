"""Importing a fork's module that a config names by import path ("module:name", accumulation/config/registry.py),
and the names of the registered pieces, for the line that says a name names none and for --help: imported only
then. A fork's module registers its pieces as it is imported; whatever stops it is one line."""

import importlib
import traceback

from accumulation.probe import fault_text


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


def fork_raised(error: Exception) -> str:
    """The words for an exception a fork's function (its model's or data's build) raised, for the one line that
    names the function: fault_text's "TypeError: message (at fork.py:12)". A ValueError is the fork refusing its
    input, and its message says all; any other exception is a bug in the fork's code, whose traceback is printed
    first, from the fork's own frame on (the caller's frame, which caught it, and this program's above it are
    left out: they say nothing about the bug)."""
    if not isinstance(error, ValueError):
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    return fault_text(error)


def config_name(piece, built_in: dict[str, str]) -> str:
    """What a config writes to choose a registered piece: its name for a built-in (`built_in`: the built-in names of
    its kind and their modules, registry.BUILT_IN), "module:name" for a fork's."""
    module_name = getattr(piece.build or piece.loss_sum_fn, "__module__", "")
    return piece.name if module_name in built_in.values() else f"{module_name}:{piece.name}"


def names_text(pieces: dict, built_in: dict[str, str]) -> str:
    """The names a config may write for one kind: the built-ins, then those of the fork modules imported so far
    (`pieces`: that kind's registered pieces, registry.REGISTERED)."""
    forks = [config_name(piece, built_in) for name, piece in pieces.items() if name not in built_in]
    return ", ".join(f'"{name}"' for name in [*built_in, *forks]) or "none"
