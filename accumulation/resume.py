"""Resuming a run: which checkpoint to continue from, what it must share with this run, and the state
(random-number generators included) that makes the continuation bit-identical.

A run's position is its counters: the data order is a pure function of (seed, step, global batch), so the
step count says which examples come next. What else must be restored is the model, the optimizer, the
scheduler, the GradScaler and every rank's random-number generator (dropout draws from it).
"""

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from accumulation.build import build_optimizer
from accumulation.checkpoint import (
    CheckpointError,
    check_model_state,
    check_optimizer_state,
    check_weights_finite,
    newest_readable_checkpoint,
    step_checkpoints,
)
from accumulation.config import Config, ConfigError, config_from_dict, config_to_dict
from accumulation.data import DATA_ORDER, DataSummary
from accumulation.distributed import DistributedContext
from accumulation.fsdp import full_model_state_dict, full_optimizer_state_dict
from accumulation.models import model_fingerprint

# Settings a resumed run must share with the checkpoint: they decide the model's shape and which examples
# each step sees; and the optimizer's own settings, which travel inside its state dict, so that a changed
# value would be silently replaced by the stored one. Everything else (max_steps, logging cadence,
# micro_batch_size and so the number of ranks, the schedule's shape, grad_clip, precision) may change. The own
# keys of a registered model or data source (accumulation/registry.py) must all match too (own_differences), and
# the model's fingerprint (model_fingerprint: e.g. a model folder's config.json) with them.
MUST_MATCH_ON_RESUME = [
    ("model", "name"),
    ("model", "n_layer"),
    ("model", "n_head"),
    ("model", "d_model"),
    ("model", "objective"),
    ("data", "source"),
    ("data", "seq_len"),
    ("data", "task"),
    ("data", "val_fraction"),
    ("batch", "global_batch_size"),
    ("batch", "tail"),
    ("run", "seed"),
    ("optim", "name"),
    ("optim", "lr"),
    ("optim", "weight_decay"),
    ("optim", "momentum"),
    ("optim", "beta2"),
]

STOPPED_FILE = "STOPPED"  # written when optim.on_nonfinite or max_consecutive_skips stops a run

# Dropout draws from the global generator, seeded per rank, far from any seed a user passes. (The data order
# draws from no torch generator: its keys are hashed from the seed and the epoch, accumulation/data.py.)
DROPOUT_SEED_OFFSET = 2**40


def seed_dropout(seed: int, rank: int, steps: int = 0) -> None:
    """A fresh dropout stream for `rank`: at the start of a run (steps = 0), or after a resume with another
    number of ranks, where the saved per-rank streams no longer fit (steps = where the run resumes)."""
    torch.manual_seed(seed * 1_000_003 + DROPOUT_SEED_OFFSET + steps * 1009 + rank)


@dataclass
class ExpectedShapes:
    """The shapes a checkpoint's state must have to fit this run: the model's state dict, name -> shape, and
    the optimizer's parameters, group by group in the order its state dict numbers them."""

    model: dict[str, torch.Size]
    optimizer: list[list[torch.Size]]

    @classmethod
    def of(cls, config: Config, model: torch.nn.Module) -> "ExpectedShapes":
        """Read from `model` (build it on the meta device: shapes without memory) and the optimizer that
        build_optimizer makes for it, so the grouping is the one training uses."""
        optimizer = build_optimizer(config.optim, model, torch.device("meta"))
        return cls(
            model={name: tensor.shape for name, tensor in model.state_dict().items()},
            optimizer=[[parameter.shape for parameter in group["params"]] for group in optimizer.param_groups],
        )


def find_resume_point(
    config: Config, data: DataSummary, shapes: ExpectedShapes, run_dir: Path, warn, say
) -> dict | None:
    """The checkpoint to continue from, or None for a fresh run. Refuses to mix two runs in one directory,
    and a checkpoint whose settings, training data (`data`: its fingerprint and its files' stamps), model or
    optimizer state (`shapes`) differ from this run's, or whose weights are not finite. Unreadable
    checkpoints skipped for an older one are reported through `warn`; "resuming from" through `say`."""
    checkpoint_dir = run_dir / "checkpoints"
    stopped = run_dir / STOPPED_FILE
    if config.run.resume == "auto" and stopped.exists():
        raise ConfigError(
            f"run.resume: {run_dir} was {stopped.read_text().strip()}; fix the cause and delete {stopped} to "
            f"continue from its last checkpoint, or start a new run.name"
        )
    found = newest_readable_checkpoint(checkpoint_dir, warn) if config.run.resume == "auto" else None
    if found is None:
        leftovers = [name for name in ("metrics.jsonl", "tensorboard") if (run_dir / name).exists()]
        # A checkpoints folder without a checkpoint file is not a run: it is what a first attempt leaves when
        # it is killed while writing its step-0 checkpoint (the temporary file was never renamed).
        if step_checkpoints(checkpoint_dir) or (checkpoint_dir / "latest.pt").exists():
            leftovers.append("checkpoints")
        if leftovers:
            raise ConfigError(
                f"run.name: {run_dir} already holds a run ({', '.join(leftovers)}); continue it with "
                f"run.resume=auto, or choose another run.name, or delete the directory"
            )
        return None
    path, payload = found
    try:
        stored = config_from_dict(payload["config"])
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {path} holds a config this program does not accept ({error})") from None
    differences = [
        f"{section}.{key} {getattr(getattr(stored, section), key)!r} -> {getattr(getattr(config, section), key)!r}"
        for section, key in MUST_MATCH_ON_RESUME
        if getattr(getattr(stored, section), key) != getattr(getattr(config, section), key)
    ]
    differences += own_differences(stored, config)
    if payload.get("model_fingerprint", "") != model_fingerprint(config.model):
        differences.append(
            f"model fingerprint {payload.get('model_fingerprint', '')!r} -> {model_fingerprint(config.model)!r}"
        )
    check_token_files_unchanged(path, payload["data"].get("files", ()), data.file_stamps)
    if payload["data"].get("fingerprint") != data.fingerprint:
        differences.append(f"training data fingerprint {payload['data'].get('fingerprint')} -> {data.fingerprint}")
    if payload["data"].get("order") != DATA_ORDER:  # written by a program version that ordered the rows otherwise
        differences.append(f"data order {payload['data'].get('order')} -> {DATA_ORDER}")
    if differences:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run: {'; '.join(differences)}; "
            f"use the original settings, another run.name, or run.resume=never in a new directory"
        )
    if payload["counters"]["steps"] > config.run.max_steps:
        raise ConfigError(
            f"run.max_steps: the checkpoint {path} is at step {payload['counters']['steps']}, "
            f"beyond max_steps={config.run.max_steps}; give a larger run.max_steps to extend the run"
        )
    check_model_state(path, payload["model"], shapes.model)
    check_weights_finite(path, payload["model"])
    check_optimizer_state(path, payload["optimizer"], shapes.optimizer)
    say(f"resuming from {path} at step {payload['counters']['steps']}")
    return payload


def own_differences(stored: Config, config: Config) -> list[str]:
    """ "model.path 'a' -> 'b'" for each own key of the chosen model or data source that differs (the stored
    config chose the same pieces: model.name and data.source are compared above)."""
    differences = []
    for section_name in ("model", "data"):
        before, now = getattr(stored, section_name).own, getattr(config, section_name).own
        if before is None or now is None or type(before) is not type(now):
            continue
        for name, value in vars(now).items():
            if getattr(before, name) != value:
                differences.append(f"{section_name}.{name} {getattr(before, name)!r} -> {value!r}")
    return differences


def check_token_files_unchanged(path: Path, stored: list | tuple, current: tuple) -> None:
    """Refuse a resume over token files changed since the checkpoint (accumulation/token_files.py's
    file_stamps: size, modification time, sampled blocks), naming the first changed file. The resumed steps
    would read other tokens than the interrupted run would have, and nothing would say so. A checkpoint of an
    older version, without stamps, is left to the fingerprint."""
    for before, now in zip(stored, current, strict=False):
        if before.get("path") != now["path"]:
            continue  # other files: data.source differs, which the settings' comparison reports
        compared = {"bytes": "size (bytes)", "mtime_ns": "modified (ns)", "sampled_sha256": "sampled blocks"}
        changed = [key for key in compared if before.get(key) != now[key]]
        if not changed:
            continue
        changes = [f"{compared[key]} {before.get(key)} -> {now[key]}" for key in changed]
        on_purpose = "to train on the changed file on purpose, start a new run (another run.name, or run.resume=never"
        on_purpose += " in a new directory)"
        if changed == ["mtime_ns"]:  # the same size and sampled blocks: perhaps only copied; the command ends the line
            seconds, nanoseconds = divmod(before["mtime_ns"], 10**9)
            on_purpose += (
                f"; if the file was only copied (cp without -p, rsync without -t), give it back its modification "
                f"time: touch -d @{seconds}.{nanoseconds:09d} {shlex.quote(now['path'])}"
            )
        raise CheckpointError(
            f"{now['path']} has changed since checkpoint {path} was written ({'; '.join(changes)}), so the "
            f"resumed steps would read other tokens than the steps before; {on_purpose}"
        )


def check_ranks_agree_on_resume(context: DistributedContext, resume: dict | None, run_dir: Path) -> None:
    """Every rank reads the checkpoint itself. Where nodes do not share the run directory, ranks on another
    node find no checkpoint and would start afresh beside a resuming rank 0: refused instead."""
    if context.world_size == 1:
        return
    steps_seen = [None] * context.world_size
    dist.all_gather_object(steps_seen, None if resume is None else resume["counters"]["steps"])
    if len(set(steps_seen)) > 1:
        seen = ", ".join(
            f"rank {rank} {'none' if steps is None else f'step {steps}'}" for rank, steps in enumerate(steps_seen)
        )
        raise CheckpointError(
            f"the ranks found different checkpoints in {run_dir / 'checkpoints'} ({seen}); "
            f"run.out_dir must be on storage that every node shares"
        )


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


def restore_rng_states(saved: dict, context: DistributedContext, config: Config, steps: int) -> None:
    """Exact continuation when the number of ranks is unchanged; with another D each rank starts a fresh
    stream from (seed, steps, rank), since its examples (and so its dropout masks) are regrouped anyway."""
    per_rank = saved["per_rank"]
    if len(per_rank) == context.world_size:
        torch.set_rng_state(per_rank[context.rank]["cpu"])
        if context.device.type == "cuda" and "cuda" in per_rank[context.rank]:
            torch.cuda.set_rng_state(per_rank[context.rank]["cuda"], context.device)
    else:
        seed_dropout(config.run.seed, context.rank, steps)


def checkpoint_payload(
    config: Config, data: DataSummary, model, optimizer, scheduler, scaler, counters, skips_in_a_row, context
) -> dict:
    """Everything a resume needs, with the keys CONTRACT.md names and `skips_in_a_row` (the skipped steps just
    before this one, which optim.max_consecutive_skips counts: a streak does not restart at a resume).
    `model` is the unwrapped module."""
    return {
        "model": full_model_state_dict(model),  # whole tensors under fsdp2 too (gathered to rank 0)
        "optimizer": full_optimizer_state_dict(optimizer),
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
