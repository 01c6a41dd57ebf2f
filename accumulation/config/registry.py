"""Where models, losses and data sources are declared: each registers itself in the file that defines it, and a
config names it by that name or as "module:name" (docs/forking.md, "A fork is one file and a config"). A fork's
module registers its pieces as it is imported; whatever stops it is one line (accumulation/probe.py's fault_text,
the one import of the project here). accumulation/config/config.py reads this module."""

import dataclasses
import importlib
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from accumulation.probe import fault_text

KINDS = ("model", "loss", "data", "sink")

# The built-in pieces: name -> the module that registers it, imported when a config names it.
BUILT_IN = {
    "model": {
        "gpt": "accumulation.models.gpt",
        "gru": "accumulation.models.gru",
        "encoder": "accumulation.models.encoder",
    },
    "loss": {"clipped-surrogate": "accumulation.rl.on_policy"},
    "data": {"arithmetic-rollouts": "accumulation.rl.on_policy"},
    "sink": {
        "tensorboard": "accumulation.run.sinks",
        "jsonl": "accumulation.run.sinks",
        "wandb": "accumulation.run.external_sinks",
        "mlflow": "accumulation.run.external_sinks",
    },
}

# The generic model keys a registered model may leave unused (register_model(generic_keys=...)): one whose size comes
# from elsewhere (a Hugging Face config.json) declares the ones it reads; setting another one is refused.
GENERIC_MODEL_KEYS = ("n_layer", "n_head", "d_model", "dropout")

# "package.module:name": a piece named by import path.
IMPORT_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z0-9_.-]+")


class RegistryError(ValueError):
    """A name that names no piece, a module that cannot be imported, or a clash of registrations."""


@dataclass(frozen=True)
class Piece:
    """One registered model, loss or data source (docs/forking.md, "A fork is one file and a config").

    build         model: build(model_config, vocab_size, *, seq_len, seed) -> nn.Module (the model contract);
                  data: build(data_config, *, model_vocab_size, seed) -> Data; loss: unused;
                  sink: build(session) -> an object with write(record), flush(), close() (run/sinks.py's SinkSession)
    settings      None, or a frozen dataclass of setting(...) fields: the piece's own keys (config/config.py)
    loss_sum_fn   a model's own loss (None: the token cross-entropy); a loss's function
    fingerprint   None, or fingerprint(section_config) -> str: state the keys do not show, compared on resume
    check         None, or check(config) raising ValueError(one line) for a combination the piece cannot run
    generic_keys  a model's: the GENERIC_MODEL_KEYS its build reads (all by default; a config setting another is
                  refused), and generic_keys_note why the others do not apply (e.g. "its size comes from config.json")
    """

    kind: str
    name: str
    build: Callable | None = None
    settings: type | None = None
    loss_sum_fn: Callable | None = None
    fingerprint: Callable | None = None
    check: Callable | None = None
    generic_keys: tuple[str, ...] = GENERIC_MODEL_KEYS
    generic_keys_note: str = ""


# Every registered piece, by kind and name.
REGISTERED: dict[str, dict[str, Piece]] = {kind: {} for kind in KINDS}


def _register(piece: Piece) -> Piece:
    if piece.settings is not None and not dataclasses.is_dataclass(piece.settings):
        raise RegistryError(f"{piece.kind} {piece.name!r}: settings must be a dataclass of setting(...) fields")
    existing = REGISTERED[piece.kind].get(piece.name)
    # A module imported twice (as a script, then by name) registers its pieces again: the same function's name.
    if existing is not None and _function_name(existing) != _function_name(piece):
        raise RegistryError(f"{piece.kind} {piece.name!r} is registered twice, by two different functions")
    REGISTERED[piece.kind][piece.name] = piece
    return piece


def _function_name(piece: Piece) -> str:
    return getattr(piece.build or piece.loss_sum_fn, "__qualname__", "")


def register_model(name, build, *, generic_keys=GENERIC_MODEL_KEYS, **options) -> Piece:
    """Declare a model: `model.name = name` builds it with build(model_config, vocab_size, seq_len=, seed=).
    `options`: Piece's settings, loss_sum_fn, fingerprint, check and generic_keys_note."""
    unknown = set(generic_keys) - set(GENERIC_MODEL_KEYS)
    if unknown:
        raise RegistryError(f"model {name!r}: generic_keys must be among {GENERIC_MODEL_KEYS}, got {sorted(unknown)}")
    return _register(Piece("model", name, build, generic_keys=tuple(generic_keys), **options))


def register_loss(name, loss_sum_fn) -> Piece:
    """Declare a loss: `model.objective = name` trains with loss_sum_fn(outputs, labels), a SUM over targets."""
    return _register(Piece("loss", name, loss_sum_fn=loss_sum_fn))


def register_data(name, build, *, settings=None, check=None) -> Piece:
    """Declare a data source: `data.source = name` builds it with build(data_config, model_vocab_size=, seed=)."""
    return _register(Piece("data", name, build, settings, check=check))


def register_sink(name, build, *, check=None) -> Piece:
    """Declare a logger sink: `log.sinks` naming it makes rank 0 call build(session) once per session and hand the
    result each step's record (accumulation/run/sinks.py's SinkSession and Sink)."""
    return _register(Piece("sink", name, build, check=check))


def is_piece_name(kind: str, name: str) -> bool:
    """Whether `name` names a piece of this kind (registered, built in, or an import path), not e.g. a data file."""
    return name in REGISTERED[kind] or name in BUILT_IN[kind] or IMPORT_PATH.fullmatch(name) is not None


def lookup(kind: str, name: str) -> Piece:
    """The piece `name` names: a registered name, a built-in (its module imported first), or "module:name"."""
    if name in BUILT_IN[kind]:
        importlib.import_module(BUILT_IN[kind][name])  # registers it; cached after the first time
    if name in REGISTERED[kind]:
        return REGISTERED[kind][name]
    if IMPORT_PATH.fullmatch(name) is None:
        names = names_text(kind)
        raise RegistryError(f'expected one of {names}, or a module:name import path, got "{name}"')
    module_name, _, short_name = name.partition(":")
    problem = import_problem(module_name)
    if problem is not None:
        raise RegistryError(problem)
    if short_name not in REGISTERED[kind]:
        raise RegistryError(
            f"{module_name} registers no {kind} {short_name!r} (registered: "
            f"{names_text(kind)}); call register_{kind}({short_name!r}, ...) in it"
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


def fork_raised(error: Exception) -> str:
    """The words for an exception a fork's function (its model's or data's build) raised, for the one line that
    names the function: fault_text's "TypeError: message (at fork.py:12)". A ValueError is the fork refusing its
    input, and its message says all; any other exception is a bug in the fork's code, whose traceback is printed
    first, from the fork's own frame on (the caller's frame, which caught it, and this program's above it are
    left out: they say nothing about the bug)."""
    if not isinstance(error, ValueError):
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    return fault_text(error)


def config_name(piece: Piece) -> str:
    """What a config writes to choose a registered piece: its name for a built-in, "module:name" for a fork's."""
    module_name = getattr(piece.build or piece.loss_sum_fn, "__module__", "")
    return piece.name if module_name in BUILT_IN[piece.kind].values() else f"{module_name}:{piece.name}"


def names_text(kind: str) -> str:
    """The names a config may write for one kind: the built-ins, then those of the fork modules imported so far."""
    forks = [config_name(piece) for name, piece in REGISTERED[kind].items() if name not in BUILT_IN[kind]]
    return ", ".join(f'"{name}"' for name in [*BUILT_IN[kind], *forks]) or "none"
