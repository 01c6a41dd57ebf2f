"""A checkpoint read back and checked before a run continues from it (accumulation/run/restore.py).

Verified before use: torch.save writes a zip archive with a CRC-32 of every entry (the pickle, each tensor's
bytes), and torch.load never checks them, so a flipped bit in a tensor loads without a word. read_checkpoint
reads every entry once and compares its CRC-32 (check_archive) before torch.load sees the file. Every byte
torch.load reads is covered: an entry's bytes by its CRC, the names and offsets that locate it by zipfile's
own cross-checks of the central directory against each entry's header; what is left (timestamps, padding)
changes nothing that is loaded. The cost is one more read of the file, at CRC-32 speed (docs/training.md has
the figure), and nothing at all when writing: torch computes the CRCs anyway.
"""

import dataclasses
import math
import os
import stat
import warnings
import zipfile
from pathlib import Path

import torch

from accumulation.counters import Counters
from accumulation.run.checkpoint import CheckpointError, step_checkpoints
from accumulation.run.run_dir import few

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "counters", "config", "rng", "data")
COUNTER_NAMES = [field.name for field in dataclasses.fields(Counters)]


def read_checkpoint(path: Path) -> dict:
    """Load a checkpoint safely: weights_only=True refuses any pickled object that is not a tensor or a
    plain container, so a malicious file cannot run code. Raises CheckpointError for anything unusable."""
    check_archive(path)
    try:
        # A damaged file can make the unpickler warn (e.g. of an unknown pickle protocol) before it fails;
        # the error below says all there is to say, so the warnings stay out of the user's terminal.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, corrupted, not a torch file, or a refused pickle
        raise CheckpointError(f"checkpoint {path} cannot be read ({load_failure(error)})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(payload).__name__}, not a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the keys {missing}; it was not written by this program")
    problem = structure_problem(payload)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged or was not written by this program: {problem}")
    return payload


def check_archive(path: Path) -> None:
    """Read every entry of the checkpoint's zip archive and compare it with the CRC-32 stored beside it
    (zipfile does the comparison as the last byte of an entry is read). Raises CheckpointError naming the
    file and the first damaged entry: a flipped bit, a truncated or overwritten file."""
    try:
        archive = zipfile.ZipFile(path)
    except Exception as error:  # not a zip archive at all: truncated, random bytes, a directory, unreadable
        raise CheckpointError(f"checkpoint {path} cannot be read ({load_failure(error)})") from None
    with archive:
        for entry in archive.infolist():
            try:
                with archive.open(entry) as stream:
                    while stream.read(2**20):
                        pass
            except Exception as error:  # a wrong CRC, a damaged header, a size that runs past the end
                if "CRC" in str(error):
                    why = f"the CRC of its entry {entry.filename} does not match its bytes"
                else:
                    why = f"its entry {entry.filename} cannot be read ({error})"
                raise CheckpointError(
                    f"checkpoint {path} is damaged: {why} (a bit flipped on the disk or in a copy, or the file "
                    f"changed in place)"
                ) from None


def load_failure(error: Exception) -> str:
    """What torch.load found wrong with a file, in one line. A refusal of the weights-only unpickler comes
    wrapped in advice to load the file with weights_only=False, or to allow the refused global: exactly what
    must not be done with a file of unknown origin. So for any message that speaks of weights_only, only the
    reason is kept ("unsupported GLOBAL posix.system ..."), found as the first line that is not advice: torch
    versions word and order the advice differently, and not all of them mark the reason."""
    text = str(error).strip()
    if "weights_only" in text:
        reasons = [
            line.strip().removeprefix("WeightsUnpickler error:").strip().split(". ")[0].rstrip(".")
            for line in text.splitlines()
            if line.strip()
            and not any(advice in line for advice in ("weights_only", "Weights only", "Check the documentation"))
        ]
        reason = reasons[0] if reasons else "it holds objects that are not tensors or plain values"
        return f"the weights-only loader, which accepts tensors and plain values only, refused it: {reason}"
    return text.splitlines()[0] if text else type(error).__name__


def structure_problem(payload: dict) -> str | None:
    """What is wrong with the parts of a checkpoint that resuming reads as plain values, or None. The state
    dicts of the optimizer, scheduler and scaler are PyTorch's own, checked when they are loaded; the
    model's is checked against the configured model by check_model_state."""
    for key in REQUIRED_KEYS:
        if not isinstance(payload[key], dict):
            return f"{key} is a {type(payload[key]).__name__}, not a dict"
    if not all(isinstance(value, torch.Tensor) for value in payload["model"].values()):
        return "model holds values that are not tensors"
    counters = payload["counters"]
    if sorted(counters) != sorted(COUNTER_NAMES) or not all(
        type(value) is int and value >= 0 for value in counters.values()
    ):
        return f"counters should be the non-negative integers {', '.join(COUNTER_NAMES)}, got {counters}"
    if type(payload.get("skips_in_a_row")) is not int or payload["skips_in_a_row"] < 0:
        return "skips_in_a_row is missing or not a non-negative integer (a checkpoint of an older version?)"
    if not isinstance(payload["data"].get("fingerprint"), str):
        return "data lacks the fingerprint of the training data"
    files = payload["data"].get("files", [])  # absent in checkpoints of older versions
    if not (isinstance(files, list) and all(isinstance(stamp, dict) and "path" in stamp for stamp in files)):
        return "data.files should be a list of the token files' stamps"
    per_rank = payload["rng"].get("per_rank")
    states_ok = (
        isinstance(per_rank, list)
        and len(per_rank) > 0
        and all(
            isinstance(state, dict) and isinstance(state.get("cpu"), torch.Tensor) and state["cpu"].dtype == torch.uint8
            for state in per_rank
        )
    )
    if not states_ok:
        return "rng lacks the random-number-generator state of each rank"
    # torch.set_rng_state accepts only a state of its generator's size: another one would be a traceback
    # after "resuming from". CPU: the Mersenne Twister's state; CUDA: Philox's seed and offset, 8 bytes each.
    for rank, state in enumerate(per_rank):
        for device, size in (("cpu", torch.get_rng_state().numel()), ("cuda", CUDA_RNG_STATE_BYTES)):
            value = state.get(device, torch.zeros(size, dtype=torch.uint8))
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.shape == (size,)):
                got = f"{value.numel()} bytes" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                return (
                    f"the random-number-generator state of rank {rank} has {got}, a {device.upper()} generator's {size}"
                )
    return None


CUDA_RNG_STATE_BYTES = 16


def check_model_state(path: Path, stored: dict, expected: dict[str, torch.Tensor]) -> None:
    """Refuse a model state that does not fit `expected`, the configured model's state dict (on the meta
    device), naming what differs. load_state_dict would refuse another name or shape too, but only after the
    run directory is touched, and with a long RuntimeError; a weight of another dtype it would copy in without
    a word, an fp16 weight rounded, an int64 one cut to whole numbers."""
    missing = [name for name in expected if name not in stored]
    unexpected = [name for name in stored if name not in expected]
    problems = [f"{label} {few(names)}" for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
    problems += [
        f"{name} has shape {list(stored[name].shape)}, the configured model {list(tensor.shape)}"
        for name, tensor in expected.items()
        if name in stored and stored[name].shape != tensor.shape
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {path}: its model does not fit the configured model: {'; '.join(problems[:3])}"
        )
    for name, tensor in expected.items():
        if stored[name].dtype != tensor.dtype:
            raise CheckpointError(
                f"checkpoint {path}: its weight {name} is stored as {stored[name].dtype}, the configured model's "
                f"is {tensor.dtype}; the file is damaged or was converted: {OLDER_CHECKPOINT}"
            )


# What to do about a checkpoint that is damaged, ending each such line.
OLDER_CHECKPOINT = (
    "resume from an older checkpoint (delete the newer step files and latest.pt), or start a new run.name"
)


def check_weights_finite(path: Path, stored: dict) -> None:
    """Refuse weights holding NaN or inf: every update from them is non-finite and skipped, so the run would
    go on without learning anything (one pass over the weights, on the host)."""
    broken = [name for name, tensor in stored.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if broken:
        raise CheckpointError(
            f"checkpoint {path}: the weights {few(broken)} hold NaN or inf, so no update from them can be applied; "
            f"{OLDER_CHECKPOINT}"
        )


def check_optimizer_state(path: Path, stored, parameters: list[list[torch.Tensor]]) -> None:
    """Refuse an optimizer state that does not fit this run's optimizer, before anything is written:
    `parameters` holds each parameter group's parameters (on the meta device), in the optimizer's order (the
    numbering its state dict uses). Every state tensor but the scalar step counter is shaped like its
    parameter (AdamW's two moments, SGD's momentum buffer); one of another shape would fail at the first
    update, a whole traceback after "resuming". Each such tensor must also have its parameter's dtype
    (load_state_dict would convert an fp16 moment back without a word, its low bits lost)."""
    groups = stored.get("param_groups") if isinstance(stored, dict) else None
    state = stored.get("state") if isinstance(stored, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: its optimizer state lacks param_groups or state; it is damaged")
    stored_sizes = [len(group.get("params", [])) if isinstance(group, dict) else None for group in groups]
    expected_sizes = [len(group) for group in parameters]
    if stored_sizes != expected_sizes:
        raise CheckpointError(
            f"checkpoint {path}: its optimizer has parameter groups of {stored_sizes} parameters, this run's "
            f"{expected_sizes}; it was written by another model or optimizer"
        )
    numbered = [parameter for group in parameters for parameter in group]  # as the state dict numbers them
    for number, values in state.items():
        if not (isinstance(number, int) and 0 <= number < len(numbered) and isinstance(values, dict)):
            raise CheckpointError(f"checkpoint {path}: its optimizer state names parameter {number!r}; it is damaged")
        for key, value in values.items():
            if key == "step":  # the updates this parameter has taken: a whole number, as a number or a 1-element tensor
                count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(count, bool) or not isinstance(count, int | float) or not 0 <= count < math.inf:
                    raise CheckpointError(
                        f"checkpoint {path}: optimizer state step of parameter {number} is {count!r}, not a count of "
                        f"updates; the file is damaged: {OLDER_CHECKPOINT}"
                    )
                continue
            if value is None or isinstance(value, int | float):  # e.g. an optimizer's scalar settings per parameter
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"checkpoint {path}: optimizer state {key} of parameter {number} is {value!r}, not a tensor; the "
                    f"file is damaged: {OLDER_CHECKPOINT}"
                )
            parameter = numbered[number]
            if value.shape != parameter.shape:
                raise CheckpointError(
                    f"checkpoint {path}: optimizer state {key} of parameter {number} has shape {list(value.shape)}, "
                    f"its parameter {list(parameter.shape)}; the file is damaged: {OLDER_CHECKPOINT}"
                )
            if value.is_floating_point() and value.dtype != parameter.dtype:
                raise CheckpointError(
                    f"checkpoint {path}: optimizer state {key} of parameter {number} is stored as {value.dtype}, "
                    f"its parameter's {parameter.dtype}; the file is damaged or was converted: {OLDER_CHECKPOINT}"
                )


def check_training_state(path: Path, payload: dict, fresh: dict, moments: tuple[str, tuple[str, ...]]) -> None:
    """Refuse optimizer, scheduler and GradScaler state that PyTorch's loaders would take without a word
    and that would then fail at the first step, or quietly train another run. `fresh` holds the state dicts
    of a new optimizer, scheduler and scaler of this run ("optimizer", "scheduler", "scaler"): each stored
    value must be of the kind of the new one (a number where a number is, a list as long), the numbers
    finite. `moments` names what the optimizer keeps per parameter, e.g. ("AdamW's moments", ("exp_avg",
    "exp_avg_sq")): after an applied update every entry of its state holds them, and an empty state would
    restart them from zero."""
    problem = training_state_problem(payload, fresh, moments)
    if problem:
        raise CheckpointError(
            f"checkpoint {path}: {problem}; the file is damaged or was not written by this program: {OLDER_CHECKPOINT}"
        )


def training_state_problem(payload: dict, fresh: dict, moments: tuple[str, tuple[str, ...]]) -> str | None:
    updates = payload["counters"]["updates"]
    groups = payload["optimizer"]["param_groups"]  # a list as long as this run's: check_optimizer_state
    for number, (stored_group, fresh_group) in enumerate(zip(groups, fresh["optimizer"]["param_groups"], strict=True)):
        if not isinstance(stored_group, dict):
            return f"its optimizer state's param_groups[{number}] is not a dict"
        for key, fresh_value in fresh_group.items():
            if key == "params" or (key not in stored_group and kind_of(fresh_value) != "a number"):
                continue  # the flags PyTorch fills in when a checkpoint of an older version lacks them
            if key not in stored_group:
                return f"its optimizer state's param_groups[{number}] lacks {key}"
            problem = value_problem(stored_group[key], fresh_value)
            if problem:
                return f"its optimizer state's param_groups[{number}].{key} {problem}"
    scheduler = payload["scheduler"]
    for key in ("base_lrs", "last_epoch"):
        if key not in scheduler:
            return f"its scheduler state lacks {key}"
    for key in fresh["scheduler"].keys() & scheduler.keys():
        problem = value_problem(scheduler[key], fresh["scheduler"][key])
        if problem:
            return f"its scheduler state's {key} {problem}"
    if scheduler["last_epoch"] != updates:  # the schedule's unit is applied updates: the two count the same
        return f"its scheduler is at {scheduler['last_epoch']} applied updates, its counters at {updates}"
    scaler = payload["scaler"]
    if scaler:  # empty when the run had no GradScaler
        scale = scaler.get("scale")
        if kind_of(scale) == "a number" and not (math.isfinite(scale) and scale > 0):
            return f"its GradScaler state's scale is {scale}, expected a finite number above 0"
        for key, fresh_value in fresh["scaler"].items():
            problem = value_problem(scaler[key], fresh_value) if key in scaler else "is missing"
            if problem:
                return f"its GradScaler state's {key} {problem}"
    what, keys = moments
    state = payload["optimizer"]["state"]
    if keys and updates > 0 and not state:
        return f"its optimizer state is empty after {updates} applied updates: {what} would restart from zero"
    for number, values in state.items():
        missing = [key for key in keys if key not in values]
        if missing:
            return f"its optimizer state of parameter {number} lacks {', '.join(missing)}"
    return None


def kind_of(value) -> str:
    if isinstance(value, bool):  # before numbers: bool is a subclass of int
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str):
        return "text"
    if isinstance(value, torch.Tensor):
        return "a tensor"
    return "None" if value is None else f"a {type(value).__name__}"


def value_problem(stored, fresh) -> str | None:
    """How `stored` differs in kind from `fresh` (a new object's value for the same key), or None. None in
    `fresh` (a setting left to PyTorch, a scheduler's lambda) accepts anything."""
    if fresh is None:
        return None
    expected, got = kind_of(fresh), kind_of(stored)
    if got != expected:
        shown = f"the text {stored!r}" if isinstance(stored, str) else ("None" if stored is None else got)
        return f"is {shown}, expected {expected}"
    if expected == "a number" and not math.isfinite(stored):
        return f"is {stored}, expected a finite number"
    if expected == "a list":
        if len(stored) != len(fresh):
            return f"holds {len(stored)} values, expected {len(fresh)}"
        for index, (stored_item, fresh_item) in enumerate(zip(stored, fresh, strict=True)):
            problem = value_problem(stored_item, fresh_item)
            if problem:
                return f"[{index}] {problem}"
    return None


# What a checkpoint name may be besides a regular file, as os.stat reports it.
FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: Path) -> None:
    """Refuse a checkpoint name that is not a regular file, before anything opens it: a FIFO blocks its reader
    forever, and a device such as /dev/zero never ends, so reading it fills the memory. A symbolic link is
    followed: one to a regular file (a checkpoint kept elsewhere) is read like the file itself."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode):
        return
    kind = next((name for is_kind, name in FILE_KINDS if is_kind(mode)), "not a regular file")
    if path.is_symlink():
        kind = f"a symbolic link to {os.readlink(path)}, which is {kind}"
    raise CheckpointError(
        f"checkpoint {path} is {kind}, not a file this program wrote; remove it (or put a checkpoint file in "
        f"its place) and run again"
    )


def newest_readable_checkpoint(checkpoint_dir: Path, warn) -> tuple[Path, dict] | None:
    """latest.pt if it reads, else the newest step file that does (each bad one passed over is reported
    through `warn`). None when the folder holds no checkpoint at all; CheckpointError when it holds only
    unreadable ones: then that one line says it all, without the warnings. A checkpoint name that is not a
    regular file (check_regular_file) is a CheckpointError before any checkpoint is read."""
    candidates = [checkpoint_dir / "latest.pt"] + list(reversed(step_checkpoints(checkpoint_dir)))
    candidates = [path for path in candidates if path.exists()]
    if not candidates:
        return None
    for path in candidates:
        check_regular_file(path)
    return first_readable(candidates, read_checkpoint, checkpoint_dir, warn)


def first_readable(candidates: list[Path], read, checkpoint_dir: Path, warn) -> tuple[Path, dict]:
    """(path, payload) of the first of `candidates` (newest first) that `read` reads, each bad one before it
    reported through `warn`; CheckpointError when none reads."""
    problems = []
    for path in candidates:
        try:
            payload = read(path)
        except CheckpointError as error:
            problems.append(error)
            continue
        for problem in problems:
            warn(f"warning: {problem}; passed over for an older checkpoint")
        return path, payload
    raise CheckpointError(
        f"none of the {len(candidates)} checkpoints in {checkpoint_dir} can be used (the newest: {problems[0]}); "
        f"delete the folder to start afresh or restore a good file"
    )
