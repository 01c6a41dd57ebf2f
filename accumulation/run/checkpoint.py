"""Checkpoints: what one holds and how it is written (atomically, the newest `keep` kept; its keys: docs/training.md,
"Checkpoints and resume"); reading one back is accumulation/run/restore.py's."""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from accumulation.config.config import Config, config_to_dict
from accumulation.data.sources import DATA_ORDER
from accumulation.data.splits import DataSummary
from accumulation.models.factory import model_fingerprint
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.run_dir import SHARDED_STEP, STEP_FILE, WriteError, disk_full, os_error_in, why_not_written


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def check_weights_finite(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A CheckpointError on every rank when any rank's optimizer parameters (the whole model, its stage or its FSDP2
    shards) hold inf or nan: a collective, run before each checkpoint and after a non-finite step (run/stops.py),
    never on a healthy step; one isfinite pass and one read-back, small beside a checkpoint's copy to the host."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    finite = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in parameters]
    broken = torch.stack(finite).logical_not().any().int() if finite else torch.zeros((), dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)
    if broken.item():
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        mine = [names.get(id(p), "a parameter") for p, ok in zip(parameters, finite, strict=True) if not ok]
        raise CheckpointError(
            f"an update left inf or nan in the weights ({f'first {mine[0]}' if mine else 'on another rank'}), so no "
            f"checkpoint was written with them; the newest checkpoint holds the last finite weights. The update "
            f"overflowed: start a new run with a lower optim.lr (now {config.optim.lr:g}) or optim.weight_decay "
            f"(now {config.optim.weight_decay:g})"
        )


def save_checkpoint(payload: dict, checkpoint_dir: Path, steps: int, keep: int) -> Path:
    """Write step_XXXXXX.pt and point latest.pt at it, then delete all but the newest `keep` step files and sharded
    folders (counted together), each file renamed into place from a temporary file flushed to the disk (a reader
    sees the old or the whole new file, even if this process dies). A failed write removes its temporary files and
    raises WriteError; older ones stay."""
    path = checkpoint_dir / f"step_{steps:06d}.pt"
    temporary, latest_temporary = path.with_name(f".{path.name}.tmp"), checkpoint_dir / ".latest.pt.tmp"
    computing_crcs = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # each entry's CRC-32, which checkpoint_checks.py verifies
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        # latest.pt: a hard link to the same bytes where the filesystem allows one (no second write), else a copy
        latest_temporary.unlink(missing_ok=True)
        try:
            os.link(path, latest_temporary)
        except OSError:
            shutil.copyfile(path, latest_temporary)
        os.replace(latest_temporary, checkpoint_dir / "latest.pt")
        # The renames live in the directory's own data: flush it too, or a power loss can undo them once returned
        descriptor = os.open(checkpoint_dir, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        # A run continued here from fsdp2 or pipeline stages also holds their step_XXXXXX.dcp folders: one count
        folders = [p for p in checkpoint_dir.iterdir() if SHARDED_STEP.fullmatch(p.name)]
        for old in sorted(step_checkpoints(checkpoint_dir) + folders, key=step_of)[:-keep]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    except Exception as error:
        cause = os_error_in(error)
        if cause is None:
            raise  # not the file system: a bug, whose traceback is the useful message
        for leftover in (temporary, latest_temporary):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass  # the folder itself is unreachable: there is nothing to clean up
        try:
            complete = step_checkpoints(checkpoint_dir)  # renamed into place, so complete
        except OSError:
            complete = []
        kept = f"the newest complete checkpoint is {complete[-1].name}" if complete else "no checkpoint exists yet"
        raise WriteError(
            f"checkpoint {path} could not be written: {why_not_written(cause, path.parent, tensor_bytes(payload))}; "
            f"its temporary file was removed and {kept}; {'free space' if disk_full(cause) else 'fix the cause'}, "
            f"and a restart resumes from the newest checkpoint"
        ) from None
    finally:
        torch.serialization.set_crc32_options(computing_crcs)  # a setting of the caller's, left as it was
    return path


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a nested payload: close to its size on disk (the rest is small metadata)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def step_of(checkpoint: Path) -> int:
    """The step a step_XXXXXX.pt file or step_XXXXXX.dcp folder was written at."""
    return int((STEP_FILE.fullmatch(checkpoint.name) or SHARDED_STEP.fullmatch(checkpoint.name)).group(1))


def step_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """The step_XXXXXX.pt files, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if STEP_FILE.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_FILE.fullmatch(p.name).group(1)))


def checkpoint_payload(
    config: Config, data: DataSummary, model, optimizer, scheduler, scaler, counters, skips_in_a_row, context
) -> dict:
    """Everything a resume needs: the keys docs/training.md lists, and `skips_in_a_row` (the streak that
    optim.max_consecutive_skips counts, which a resume continues). `model` is the unwrapped module. Non-finite
    weights are refused here, never written: no later step could repair them."""
    check_weights_finite(config, model, optimizer)
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    single_file = config.dist.strategy != "fsdp2" and config.dist.pipeline_stages == 1  # else sharded_checkpoint.py
    if context.is_main and single_file:  # the file's writer
        model_state, optimizer_state = on_the_host(model_state), on_the_host(optimizer_state)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "counters": vars(counters).copy(),
        "skips_in_a_row": skips_in_a_row,
        "config": config_to_dict(config),
        "model_fingerprint": model_fingerprint(config.model),  # what the model's keys do not show (registry.py)
        "rng": rng_states(context),
        # The data order is a pure function of (seed, step, global batch), so the position is the step
        # count; the fingerprint and the token files' stamps let a resume refuse data changed underneath it.
        "data": {
            "next_step": counters.steps,
            "fingerprint": data.fingerprint,
            "files": list(data.file_stamps),
            "order": DATA_ORDER,
        },
    }


def on_the_host(state: dict) -> dict:
    """A state dict with every tensor (nested ones too) copied to the host: a GPU's checkpoint loads without one."""
    return {
        key: on_the_host(value) if isinstance(value, dict) else value.cpu() if torch.is_tensor(value) else value
        for key, value in state.items()
    }


def rng_states(context: DistributedContext) -> dict:
    """Every rank's random-number-generator states (dropout draws from them), gathered for rank 0 to save."""
    mine = {"cpu": torch.get_rng_state()}
    if context.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(context.device)
    if context.world_size == 1:
        return {"per_rank": [mine]}
    everyone = [None] * context.world_size
    dist.all_gather_object(everyone, mine)
    return {"per_rank": everyone}


# Dropout draws from the global generator, seeded per rank, far from any seed a user passes (the data order uses none).
DROPOUT_SEED_OFFSET = 2**40


def seed_dropout(seed: int, rank: int, steps: int = 0) -> None:
    """A fresh dropout stream for `rank`: at the start of a run (steps = 0), or after a resume with another
    number of ranks, where the saved per-rank streams no longer fit (steps = where the run resumes)."""
    torch.manual_seed(seed * 1_000_003 + DROPOUT_SEED_OFFSET + steps * 1009 + rank)
