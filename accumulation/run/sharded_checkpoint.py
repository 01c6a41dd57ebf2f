"""Sharded checkpoints (`dist.strategy = "fsdp2"`, and pipeline stages): every rank writes and reads only its own
shards, through torch.distributed.checkpoint (DCP); imported only by an fsdp2 or pipelined run, and by a resume
whose folder holds one.

One checkpoint is a folder `checkpoints/step_XXXXXX.dcp` holding
- DCP's files: `.metadata` (every tensor's global shape, dtype and where its pieces lie) and one `__R_0.distcp`
  per rank R with that rank's shards of the weights and of the optimizer's per-parameter tensors (AdamW's moments),
  always under the whole model's names and its one optimizer's numbering: an fsdp2 rank's are DTensor shards, a
  pipeline stage's its own whole tensors (the ranks of other replicas, holding copies, write none);
- `state.pt`, rank 0's: everything else the single-file checkpoint holds (docs/training.md's keys: counters,
  config, data, scheduler, scaler, rng, ...) and the optimizer's state dict without its parameter-shaped tensors
  (param_groups, and AdamW's `step` per parameter; on stages, gathered from every stage), numbered by parameter
  as the single file numbers it;
- `checksums.json`, rank 0's, written last: each other file's size and CRC-32, each rank's shard files checksummed
  by the rank that wrote them. A resume compares every file with it before it reads anything (a flipped bit, a
  truncated or missing file is refused and the next older checkpoint is used, as for the single file).

Published atomically: the ranks write into `.step_XXXXXX.dcp.tmp`; after a barrier rank 0 writes state.pt and
checksums.json and renames the folder to its name (a rename of a folder is atomic on POSIX file systems). A
process killed before the rename leaves a temporary folder, which no resume reads and the next save removes.

The optimizer's tensors are taken from `optimizer.state_dict()`, not from DCP's `get_optimizer_state_dict`: on an
optimizer with empty state (a fresh run's step-0 checkpoint) that one runs a zero-gradient step with lr 0 to create
the state (torch 2.13, `_init_optim_state`), which sets AdamW's `step` to 1, so the first real update would count
as the second. Here a fresh optimizer's checkpoint holds an empty state, as the single file does.

Resharding is DCP's: a resume allocates the tensors it wants (this run's shards under fsdp2 at any D, whole
tensors under ddp or on one process, a stage's own tensors at any P) and `dcp.load` reads the overlapping pieces
of every rank's file. So a folder written on one layout resumes on any other.
"""

import copy
import json
import os
import shutil
import warnings
import zlib
from concurrent.futures import Future, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from accumulation.parallel.distributed import DistributedContext
from accumulation.run.checkpoint import CheckpointError, on_the_host
from accumulation.run.checkpoint_checks import (
    OLDER_CHECKPOINT,
    REQUIRED_KEYS,
    check_regular_file,
    first_readable,
    read_checkpoint,
    structure_problem,
)
from accumulation.run.run_dir import SHARDED_STEP, STEP_FILE, WriteError, os_error_in, why_not_written

STATE_FILE, CHECKSUMS_FILE = "state.pt", "checksums.json"


def sharded_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """The step_XXXXXX.dcp folders, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if SHARDED_STEP.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(SHARDED_STEP.fullmatch(p.name).group(1)))


def crc32_of(path: Path) -> int:
    """The CRC-32 of a file, read 1 MiB at a time (the memory it takes does not grow with the file)."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            crc = zlib.crc32(chunk, crc)
    return crc


def split_payload(
    payload: dict, optimizer: torch.optim.Optimizer, whole_numbers: list[int] | None = None
) -> tuple[dict, dict]:
    """(the tensors DCP writes, each rank its shards; rank 0's state.pt) from checkpoint_payload's dict, whose
    `model` and `optimizer` hold this rank's tensors (fsdp2: DTensor shards; a pipeline stage: its own, under the
    whole model's names). The optimizer's tensors shaped like their parameter go to DCP under
    "optimizer/<number>/<key>"; the rest of its state dict (step counters, param_groups) stays. `whole_numbers`:
    the number the payload gives each of `optimizer`'s parameters (a stage's, pipeline.whole_numbers), by default
    the optimizer's own."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    numbers = whole_numbers if whole_numbers is not None else range(len(parameters))
    shapes = {number: parameter.shape for number, parameter in zip(numbers, parameters, strict=True)}
    tensors = {f"model/{name}": value for name, value in payload["model"].items()}
    small_state = {}
    for number, entries in payload["optimizer"]["state"].items():
        small_state[number] = {}
        for key, value in entries.items():
            if torch.is_tensor(value) and value.shape == shapes[number]:
                tensors[f"optimizer/{number}/{key}"] = value
            else:
                small_state[number][key] = value
    rest = {key: value for key, value in payload.items() if key not in ("model", "optimizer")}
    rest["optimizer"] = {"state": small_state, "param_groups": payload["optimizer"]["param_groups"]}
    # A copy: rank 0 writes it only once the shards are on the disk, and training changes the live values
    # before that (AdamW's step counters are updated in place).
    return tensors, copy.deepcopy(rest)


def split_stage_payload(payload: dict, pipeline, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """split_payload for a pipeline stage (dist.pipeline_stages > 1, accumulation/parallel/pipeline.py): each stage
    of replica 0 hands DCP its own weights under the whole model's names and its optimizer's parameter-shaped
    tensors under the whole model's numbering (the other replicas, holding copies, hand nothing), so that the
    folder is the one fsdp2 writes of the same state. Rank 0's state.pt gets param_groups over the whole model and
    each parameter's small entries (AdamW's `step`), gathered from the stages. Every rank must call it."""
    from accumulation.parallel.pipeline import stage_state_under_whole_names, whole_numbers

    model, optimizer_state = stage_state_under_whole_names(pipeline, optimizer)
    whole = {**payload, "model": model, "optimizer": optimizer_state}
    tensors, rest = split_payload(whole, optimizer, whole_numbers(pipeline, optimizer))
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(on_the_host(rest["optimizer"]["state"]), everyone, dst=0)
    if everyone is not None:
        merged = {number: small for part in everyone for number, small in part.items()}
        rest["optimizer"]["state"] = dict(sorted(merged.items()))
    return tensors, rest


def copied_unless_updated(tensors: dict, optimizer: torch.optim.Optimizer) -> dict:
    """`tensors` with a copy of each one the optimizer does not update (a module's buffers, which a forward may
    change, e.g. BatchNorm's running statistics; frozen weights): an "overlapped" save writes the others live."""
    updated = {local(parameter).data_ptr() for group in optimizer.param_groups for parameter in group["params"]}
    return {
        key: value if key.startswith("optimizer/") or local(value).data_ptr() in updated else value.detach().clone()
        for key, value in tensors.items()
    }


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardWriter(FileSystemWriter):
    """DCP's file writer, keeping the OSError of a failed write: DCP hands the other ranks only the exception
    raised by torch.save, which a full disk makes a RuntimeError without the OSError behind it."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.os_error = None

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            self.os_error = os_error_in(error)
            raise


class LiveShards(AsyncStager):
    """DCP's staging left out: `dcp.async_save` writes the live tensors themselves, no host copy. Safe for what only
    the optimizer step changes (the weights it updates, its moments) as long as that step waits for the write
    (ShardedCheckpointWriter's "overlapped" saves hold it); the forward and backward only read them."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class ShardedCheckpointWriter:
    """Writes sharded checkpoints, as `run.sharded_save` says: "staged" (`dcp.async_save`) blocks only while the
    shards are copied to the host, then training goes on while a thread writes them; "overlapped" writes from the
    live shards in a thread, no copy, while the next step's forward and backward run, and holds that step's update
    until the write is done (an optimizer pre-hook: only the update changes the weights and moments); "at_once"
    writes from the shards where they are (`dcp.save`: no copy, training waits) and publishes before it returns,
    as every run's last checkpoint and a stop's are. A background write is published by the next save (`finish`).
    The writing thread's collectives run on a process group of their own, so they never interleave with the
    training step's."""

    def __init__(self, checkpoint_dir: Path, keep: int, context: DistributedContext):
        self.checkpoint_dir, self.keep, self.is_main = checkpoint_dir, keep, context.is_main
        self.group = dist.new_group(backend="gloo")  # every rank creates it, in the same order: a collective
        self.pending: tuple[Future, Path, int, dict] | None = None
        self.writer: ShardWriter | None = None  # the write in flight's
        self.update_held = None  # "overlapped": the optimizer pre-hook that waits for the write in flight

    def save(
        self, payload: dict, optimizer: torch.optim.Optimizer, steps: int, how: str = "staged", pipeline=None
    ) -> None:
        """Start writing checkpoint_payload's dict as step `steps`'s checkpoint: this rank's tensors to DCP, the rest
        to rank 0's state.pt (split_payload, or split_stage_payload for a pipeline stage); `optimizer` is what
        updates the shards. `how`: one of "staged", "overlapped", "at_once" (the class's docstring); "at_once"
        publishes it before returning."""
        self.finish()
        if pipeline is None:  # fsdp2: each rank's shards
            tensors, rest = split_payload(payload, optimizer)
        else:  # each stage's own tensors, under the whole model's names and numbers
            tensors, rest = split_stage_payload(payload, pipeline, optimizer)
        temporary = self.checkpoint_dir / f".step_{steps:06d}.dcp.tmp"
        try:
            if self.is_main:
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                for leftover in self.checkpoint_dir.glob(".step_*.dcp.tmp"):  # a save killed before its rename
                    shutil.rmtree(leftover)
            dist.barrier(group=self.group)
            self.writer = ShardWriter(temporary)
            if how == "staged":
                future = dcp.async_save(tensors, storage_writer=self.writer, process_group=self.group)
            elif how == "overlapped":
                tensors = copied_unless_updated(tensors, optimizer)
                stager = LiveShards()
                future = dcp.async_save(
                    tensors, storage_writer=self.writer, process_group=self.group, async_stager=stager
                )
                self.update_held = optimizer.register_step_pre_hook(lambda *_: self.wait_for_write())
            else:
                future = Future()
                future.set_result(dcp.save(tensors, storage_writer=self.writer, process_group=self.group))
        except (Exception, dcp.api.CheckpointException) as error:  # DCP's is a BaseException
            self.failed(error, temporary)
        self.pending = (future, temporary, steps, rest)
        if how == "at_once":
            self.finish()

    def wait_for_write(self) -> None:
        """Block until the write in flight is done (an error stays in its future, for `finish`), and release the
        optimizer step."""
        if self.pending is not None:
            wait([self.pending[0]])
        if self.update_held is not None:
            self.update_held.remove()
            self.update_held = None

    def finish(self) -> None:
        """Wait for the write in flight, if any, checksum this rank's files, and (rank 0) publish it."""
        self.wait_for_write()
        if self.pending is None:
            return
        future, temporary, steps, rest = self.pending
        self.pending = None
        path = self.checkpoint_dir / f"step_{steps:06d}.dcp"
        try:
            future.result()
            rank = dist.get_rank()
            mine = {p.name: [p.stat().st_size, crc32_of(p)] for p in temporary.glob(f"__{rank}_*.distcp")}
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine, group=self.group)
            if self.is_main:
                publish(temporary, path, rest, {name: sums for sums in everyone for name, sums in sums.items()})
                self.prune()
            dist.barrier(group=self.group)  # no rank goes on (or exits) before the checkpoint is in place
        except (Exception, dcp.api.CheckpointException) as error:  # DCP's is a BaseException
            self.failed(error, temporary)

    def prune(self) -> None:
        """Delete all but the newest `keep` checkpoints, sharded folders and single files alike (a run that
        moved from ddp to fsdp2 leaves both), and latest.pt, which now names an older one."""
        both = [(int(SHARDED_STEP.fullmatch(p.name).group(1)), p) for p in sharded_checkpoints(self.checkpoint_dir)]
        both += [(int(STEP_FILE.fullmatch(p.name).group(1)), p) for p in self.checkpoint_dir.glob("step_*.pt")]
        (self.checkpoint_dir / "latest.pt").unlink(missing_ok=True)
        for _, old in sorted(both)[: -self.keep]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()

    def failed(self, error: Exception, temporary: Path):
        """A write that failed: the temporary folder removed, the older checkpoints kept, one line (WriteError)."""
        cause = os_error_in(error)
        if isinstance(error, dcp.api.CheckpointException):  # every rank has it; the OSError is the failed rank's
            mine = self.writer.os_error
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, None if mine is None else (mine.errno, mine.strerror), group=self.group)
            cause = next((OSError(*found) for found in everyone if found is not None), None)
        if cause is None:
            raise error
        if self.is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        complete = sharded_checkpoints(self.checkpoint_dir)
        kept = f"the newest complete checkpoint is {complete[-1].name}" if complete else "no checkpoint exists yet"
        raise WriteError(
            f"checkpoint {temporary} could not be written: {why_not_written(cause, temporary.parent)}; its temporary "
            f"folder was removed and {kept}; fix the cause, and a restart resumes from the newest checkpoint"
        ) from None


def publish(temporary: Path, path: Path, rest: dict, shard_sums: dict) -> None:
    """Rank 0's part of a save, once every rank's shards are on the disk: state.pt, checksums.json (last), then
    the folder renamed into place, each flushed to the disk first."""
    with open(temporary / STATE_FILE, "wb") as file:
        torch.save(rest, file)
        file.flush()
        os.fsync(file.fileno())
    sums = dict(shard_sums)
    for name in (".metadata", STATE_FILE):
        sums[name] = [(temporary / name).stat().st_size, crc32_of(temporary / name)]
    with open(temporary / CHECKSUMS_FILE, "w") as file:
        json.dump(sums, file, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    if path.exists():  # a checkpoint of this step that the resume passed over (damaged): the new one replaces it
        shutil.rmtree(path)
    os.replace(temporary, path)
    descriptor = os.open(path.parent, os.O_RDONLY)  # the rename lives in the parent folder's data: flush it too
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_sharded_checkpoint(path: Path, shard_checksums: bool = True) -> dict:
    """A sharded checkpoint checked and read as far as a resume's checks need it, without its tensors: every file
    against checksums.json (without `shard_checksums`, the shard files' sizes only: ranks that resume together
    checksum them together, verify_shares_together), state.pt read (weights only), and `model` / the optimizer's
    parameter-shaped entries as meta tensors of the stored shapes and dtypes (from DCP's metadata). `sharded` holds
    the folder: train.py loads the tensors once the model is built (load_sharded_state). Raises CheckpointError for
    anything unusable."""
    verify_files(path, shard_checksums)
    payload = described(path)
    if any(key not in payload for key in REQUIRED_KEYS):
        raise CheckpointError(f"checkpoint {path}: its {STATE_FILE} lacks keys; it was not written by this program")
    problem = structure_problem(payload)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged or was not written by this program: {problem}")
    return payload


def described(path: Path) -> dict:
    """state.pt's payload with `model` and the optimizer's tensors as meta tensors (DCP's metadata), and `sharded`."""
    try:
        payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(f"checkpoint {path} cannot be read ({str(error).splitlines()[0]})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("optimizer"), dict):
        raise CheckpointError(f"checkpoint {path}: its {STATE_FILE} lacks keys; it was not written by this program")
    payload["model"] = {}
    for key, stored in metadata.state_dict_metadata.items():
        where, _, name = key.partition("/")
        meta = torch.empty(stored.size, dtype=stored.properties.dtype, device="meta")
        if where == "model":
            payload["model"][name] = meta
        else:
            number, _, entry = name.partition("/")
            payload["optimizer"]["state"].setdefault(int(number), {})[entry] = meta
    payload["sharded"] = str(path)
    return payload


def verify_files(path: Path, shard_checksums: bool = True) -> None:
    """Every file of the folder against checksums.json: the same names and sizes, and the same CRC-32s for the small
    files (state.pt, DCP's .metadata) and, with `shard_checksums`, for the shard files (`__R_0.distcp`)."""
    expected = listed_files(path)
    for name, (size, _) in sorted(expected.items()):
        if (path / name).stat().st_size != size:
            raise CheckpointError(damaged(path, name))
    for name, (_, crc) in sorted(expected.items()):
        if (shard_checksums or not name.endswith(".distcp")) and crc32_of(path / name) != crc:
            raise CheckpointError(damaged(path, name))


def listed_files(path: Path) -> dict:
    """checksums.json's {name: [size, CRC-32]}, refused unless it names exactly the folder's other files."""
    try:
        expected = json.loads((path / CHECKSUMS_FILE).read_text())
        present = {p.name for p in path.iterdir()} - {CHECKSUMS_FILE}
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path}: its {CHECKSUMS_FILE} cannot be read ({error})") from None
    if not isinstance(expected, dict) or set(expected) != present:
        raise CheckpointError(
            f"checkpoint {path} holds other files than its {CHECKSUMS_FILE} lists (missing "
            f"{sorted(set(expected) - present) if isinstance(expected, dict) else '?'}, unexpected "
            f"{sorted(present - set(expected)) if isinstance(expected, dict) else '?'})"
        )
    return expected


def damaged(path: Path, name: str) -> str:
    return (
        f"checkpoint {path} is damaged: {name} does not match the size and CRC-32 written with it (a bit flipped on "
        f"the disk or in a copy, or the file changed in place)"
    )


def verify_shares_together(path: Path) -> None:
    """The shard files' CRC-32s checked by the ranks together, each reading its share once: rank r the files i (in
    name order) with i % D == r, whatever number of ranks wrote them. One gather hands every rank each one's verdict,
    so a damaged file anywhere is the same CheckpointError on every rank (restore.py then passes over the folder on
    all of them alike)."""
    expected = listed_files(path)
    shard_files = sorted(name for name in expected if name.endswith(".distcp"))
    mine = shard_files[dist.get_rank() :: dist.get_world_size()]
    problem = next((damaged(path, name) for name in mine if crc32_of(path / name) != expected[name][1]), None)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    found = next((verdict for verdict in verdicts if verdict is not None), None)
    if found is not None:
        raise CheckpointError(found)


def newest_readable_folder_or_file(
    checkpoint_dir: Path, warn, shard_checksums: bool = True, newest_step: int | None = None
) -> tuple[Path, dict] | None:
    """checkpoint_checks.newest_readable_checkpoint over sharded folders and single files together, newest step
    first (a run may have moved between ddp and fsdp2), at most `newest_step` when given: each bad one passed over
    through `warn`, None without any, CheckpointError when none can be used (`shard_checksums`: as
    read_sharded_checkpoint's)."""
    candidates = [(int(SHARDED_STEP.fullmatch(p.name).group(1)), p) for p in sharded_checkpoints(checkpoint_dir)]
    candidates += [(int(STEP_FILE.fullmatch(p.name).group(1)), p) for p in checkpoint_dir.glob("step_*.pt")]
    if newest_step is not None:  # an older one than a checkpoint the ranks found damaged together
        candidates = [(step, path) for step, path in candidates if step <= newest_step]
    candidates = [path for _, path in sorted(candidates, reverse=True)]
    if not candidates:
        return None
    return first_readable(candidates, lambda path: read_sharded_or_single(path, shard_checksums), checkpoint_dir, warn)


def read_sharded_or_single(path: Path, shard_checksums: bool = True) -> dict:
    """A checkpoint's payload, from a sharded folder or a single file."""
    if path.is_dir():
        return read_sharded_checkpoint(path, shard_checksums)
    check_regular_file(path)
    return read_checkpoint(path)


def load_sharded_state(
    resume: dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    whole_names: dict[str, str] | None = None,
    whole_numbers: list[int] | None = None,
) -> None:
    """The weights and the optimizer's tensors of a sharded checkpoint, read into this run's model (in place) and
    into `resume["optimizer"]` (for load_optimizer_state). Each tensor is allocated as this run holds it: under
    fsdp2 a DTensor shard laid out as its parameter (at any number of ranks), under ddp or on one process the whole
    tensor, on a pipeline stage its own tensors only; dcp.load reads into each the overlapping pieces of the saved
    files. A stage passes its stage as `model` with the whole model's name of each of its tensors (`whole_names`)
    and number of each of its optimizer's parameters (`whole_numbers`, pipeline.py); by default they are the
    model's and the optimizer's own. Refuses weights holding NaN or inf (each rank checks its own tensors; one
    reduction says whether any rank found one)."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    state = model.state_dict()
    names = whole_names if whole_names is not None else {name: name for name in state}
    numbers = whole_numbers if whole_numbers is not None else range(len(parameters))
    wanted = {f"model/{names[name]}": value for name, value in state.items()}
    for number, parameter in zip(numbers, parameters, strict=True):
        for key, value in resume["optimizer"]["state"].get(number, {}).items():
            if torch.is_tensor(value) and value.is_meta:
                wanted[f"optimizer/{number}/{key}"] = torch.zeros_like(parameter, dtype=value.dtype)
    load_pieces(wanted, resume["sharded"], no_dist=not dist.is_initialized())
    model.load_state_dict({name: wanted[f"model/{names[name]}"] for name in state})
    for key, value in wanted.items():
        where, _, name = key.partition("/")
        if where == "optimizer":
            number, _, entry = name.partition("/")
            resume["optimizer"]["state"][int(number)][entry] = value
    local = [value.to_local() if isinstance(value, DTensor) else value for value in model.state_dict().values()]
    found = any(t.is_floating_point() and not t.isfinite().all() for t in local)
    broken = torch.tensor(float(found), device=local[0].device)  # on the device: NCCL reduces nothing else
    if dist.is_initialized():
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)
    if broken.item():
        raise CheckpointError(f"checkpoint {resume['sharded']}: its weights hold NaN or inf; {OLDER_CHECKPOINT}")
    resume["model"] = {}


def load_pieces(wanted: dict, path: Path, no_dist: bool) -> None:
    """dcp.load into `wanted`; in one process (no_dist) without DCP's UserWarning that it assumes one process,
    which every one-process read (a resume, sample.py, export.py) would print on stderr, where errors go."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(wanted, checkpoint_id=path, no_dist=no_dist)


def whole_state(path: Path) -> dict:
    """A sharded checkpoint as the single file holds it (model and optimizer with whole tensors, the optimizer's
    state numbered by parameter), read in one process without a process group: for tests, scripts and a user who
    wants one file (torch.save the result)."""
    payload = read_sharded_checkpoint(path)
    wanted = {f"model/{name}": torch.zeros_like(meta, device="cpu") for name, meta in payload["model"].items()}
    for number, entries in payload["optimizer"]["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value) and value.is_meta:
                wanted[f"optimizer/{number}/{key}"] = torch.zeros_like(value, device="cpu")
    load_pieces(wanted, path, no_dist=True)
    for key, value in wanted.items():
        where, _, name = key.partition("/")
        if where == "model":
            payload["model"][name] = value
        else:
            number, _, entry = name.partition("/")
            payload["optimizer"]["state"][int(number)][entry] = value
    del payload["sharded"]
    return payload
