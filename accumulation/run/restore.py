"""Resuming from a checkpoint: which checkpoint to continue from, what it must share with this run, and the
state (random-number generators included) that makes the continuation bit-identical; on several ranks, that every
rank found the same checkpoint.

A run's position is its counters: the data order is a pure function of (seed, step, global batch), so the
step count says which examples come next. What else must be restored is the model, the optimizer, the
scheduler, the GradScaler and every rank's random-number generator (dropout draws from it).
"""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from accumulation.config.config import Config, ConfigError, config_from_dict, unused_model_keys
from accumulation.counters import Counters
from accumulation.data.sources import DATA_ORDER
from accumulation.data.splits import DataSummary
from accumulation.models.factory import model_fingerprint
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import build_optimizer
from accumulation.run.checkpoint import CheckpointError, seed_dropout, step_checkpoints
from accumulation.run.checkpoint_checks import (
    OLDER_CHECKPOINT,
    check_model_state,
    check_optimizer_state,
    check_training_state,
    check_weights_finite,
    newest_readable_checkpoint,
)
from accumulation.run.logs import metrics_lines
from accumulation.run.optimizer_state import load_optimizer_state
from accumulation.run.run_dir import METRICS_FILE, STOPPED_FILE, few
from accumulation.schedule import run_scheduler

# Settings a resumed run must share with the checkpoint: they decide the model's shape and which examples
# each step sees; and the optimizer's own settings, which travel inside its state dict, so that a changed
# value would be silently replaced by the stored one. Everything else (max_steps, logging cadence,
# micro_batch_size and so the number of ranks, the schedule's shape, grad_clip, precision) may change.
# data.source is not among them: the data's fingerprint (and the token files' stamps) say whether the data is
# the same, so the same files reached by another spelling of the path, or moved, resume.
# The own keys of a registered model or data source (accumulation/config/registry.py) must all match too
# (own_differences), and the model's fingerprint (model_fingerprint: e.g. a model folder's config.json) with them.
MUST_MATCH_ON_RESUME = [
    ("model", "name"),
    ("model", "n_layer"),
    ("model", "n_head"),
    ("model", "d_model"),
    ("model", "objective"),
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


def optimizer_moments(optim) -> tuple[str, tuple[str, ...]]:
    """What the optimizer keeps per parameter once it has applied an update: in words, and its state keys. An
    optimizer not named here is refused: a resume would load its state unchecked."""
    if optim.name == "adamw":
        return "AdamW's moments", ("step", "exp_avg", "exp_avg_sq")
    if optim.name == "sgd":
        return ("SGD's momentum buffers", ("momentum_buffer",)) if optim.momentum != 0 else ("", ())  # or nothing
    raise CheckpointError(
        f'optim.name: the resume check does not know what "{optim.name}" keeps per parameter, so it cannot check a '
        "checkpoint's optimizer state; name its state keys in optimizer_moments (accumulation/run/restore.py)"
    )


def newest_checkpoint(
    checkpoint_dir: Path, warn, together: bool = False, newest_step: int | None = None
) -> tuple[Path, dict] | None:
    """checkpoint_checks.newest_readable_checkpoint; over a folder holding dist.strategy = "fsdp2"'s sharded
    checkpoints, sharded_checkpoint.py's, which reads its folders and single files together, newest step first (at
    most `newest_step`). `together`: the shard files' CRC-32s are left to the ranks, which check them together
    once they have joined (resume_checked_together)."""
    if checkpoint_dir.is_dir() and any(checkpoint_dir.glob("step_*.dcp")):
        from accumulation.run.sharded_checkpoint import newest_readable_folder_or_file

        return newest_readable_folder_or_file(checkpoint_dir, warn, not together, newest_step)
    return newest_readable_checkpoint(checkpoint_dir, warn)


def find_resume_point(
    config: Config,
    data: DataSummary,
    model_on_meta: torch.nn.Module,
    run_dir: Path,
    warn,
    say,
    together: bool = False,
    newest_step: int | None = None,
) -> dict | None:
    """The checkpoint to continue from, or None for a fresh run: a run directory (or its absence) without
    checkpoints, metrics, a STOPPED file or TensorBoard logs. Refuses to mix two runs in one directory,
    and a checkpoint whose settings, training data (`data`: its fingerprint and its files' stamps), model or
    optimizer state (check_state_fits) differ from this run's, or whose weights are not finite. Unreadable
    checkpoints skipped for an older one are reported through `warn`; "resuming from" through `say`.
    `together` and `newest_step`: newest_checkpoint's (None when no checkpoint is at most `newest_step`)."""
    if not any((run_dir / name).exists() for name in ("checkpoints", METRICS_FILE, STOPPED_FILE, "tensorboard")):
        return None
    checkpoint_dir = run_dir / "checkpoints"
    stopped = run_dir / STOPPED_FILE
    if config.run.resume == "auto" and stopped.exists():
        raise ConfigError(
            f"run.resume: {run_dir} was {stopped.read_text().strip()}; fix the cause and delete {stopped} to "
            f"continue from its last checkpoint, or start a new run.name"
        )
    found = newest_checkpoint(checkpoint_dir, warn, together, newest_step) if config.run.resume == "auto" else None
    if found is None and newest_step is not None:
        return None
    if found is None:
        leftovers = [name for name in (METRICS_FILE, "tensorboard") if (run_dir / name).exists()]
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
    # The generic model keys this run's model does not read (model.n_layer for a Hugging Face model) are neither
    # written to its checkpoints nor compared.
    unused = unused_model_keys(config.model.name)
    must_match = [(section, key) for section, key in MUST_MATCH_ON_RESUME if f"{section}.{key}" not in unused]
    # config_from_dict fills in a missing key with its default, and the comparison below would then compare
    # this run's value with that default: every key it compares must be in the file.
    missing = [
        f"{section}.{key}"
        for section, key in must_match
        if not (isinstance(payload["config"].get(section), dict) and key in payload["config"][section])
    ]
    if missing:
        raise CheckpointError(
            f"checkpoint {path}: its config lacks {few(missing)}, which a resume compares with this run's; the "
            f"file is damaged or was written by an older version: resume from an older checkpoint, or start a "
            f"new run.name"
        )
    try:
        stored = config_from_dict(payload["config"])
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {path} holds a config this program does not accept ({error})") from None
    differences = [
        f"{section}.{key} {getattr(getattr(stored, section), key)!r} -> {getattr(getattr(config, section), key)!r}"
        for section, key in must_match
        if getattr(getattr(stored, section), key) != getattr(getattr(config, section), key)
    ]
    differences += own_differences(stored, config)
    if payload.get("model_fingerprint", "") != model_fingerprint(config.model):
        differences.append(
            f"model fingerprint {payload.get('model_fingerprint', '')!r} -> {model_fingerprint(config.model)!r}"
        )
    if payload["data"].get("fingerprint") != data.fingerprint:
        sources = (
            f"data.source {stored.data.source!r} -> {config.data.source!r}, "
            if stored.data.source != config.data.source
            else ""
        )
        differences.append(
            f"training data ({sources}fingerprint {payload['data'].get('fingerprint')} -> {data.fingerprint})"
        )
    if payload["data"].get("order") != DATA_ORDER:  # written by a program version that ordered the rows otherwise
        differences.append(f"data order {payload['data'].get('order')} -> {DATA_ORDER}")
    if differences:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run: {'; '.join(differences)}; "
            f"use the original settings, another run.name, or run.resume=never in a new directory"
        )
    # The same fingerprint: what it samples is unchanged; the stamps see the edits between its samples.
    check_token_files_unchanged(path, payload["data"].get("files", ()), data.file_stamps)
    if payload["counters"]["steps"] > config.run.max_steps:
        raise ConfigError(
            f"run.max_steps: the checkpoint {path} is at step {payload['counters']['steps']}, "
            f"beyond max_steps={config.run.max_steps}; give a larger run.max_steps to extend the run"
        )
    check_state_fits(path, payload, config, model_on_meta)
    metrics_lines(run_dir / METRICS_FILE)  # a damaged line is refused now, before anything is written
    say(f"resuming from {path} at step {payload['counters']['steps']}")
    return payload


def check_state_fits(path: Path, payload: dict, config: Config, model: torch.nn.Module) -> None:
    """Refuse model, optimizer, scheduler and GradScaler state that does not fit this run, compared with
    `model` (built on the meta device: shapes without memory) and the optimizer and schedule that
    build_optimizer and run_scheduler make for it, so everything is as training has it."""
    optimizer = build_optimizer(config.optim, model, torch.device("meta"))
    scheduler = run_scheduler(optimizer, config.schedule, config.run.max_steps)
    check_model_state(path, payload["model"], model.state_dict())
    if "sharded" not in payload:  # a sharded checkpoint's weights are checked as its shards load
        check_weights_finite(path, payload["model"])
    check_optimizer_state(path, payload["optimizer"], [group["params"] for group in optimizer.param_groups])
    fresh = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=True).state_dict(),
    }
    check_training_state(path, payload, fresh, optimizer_moments(config.optim))


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
    """Refuse a resume over token files changed since the checkpoint (accumulation/data/token_files.py's
    file_stamps), naming the first changed file and what shows the change. The resumed steps would read
    other tokens than the interrupted run would have, and nothing would say so. Files are paired by their
    position among the training files, not by their path: the same files under another spelling of
    data.source, or moved, resume. A checkpoint of an older version, without stamps, is left to the
    fingerprint.

    Where both stamps hold the whole file's hash, it decides: equal bytes resume whatever the modification
    time says (a copy without -p), other bytes are refused. Without it (data larger than
    WHOLE_FILE_HASH_MAX_BYTES, or a checkpoint written before it was stored) a changed modification time is
    all there is, and it cannot tell an edit between the sampled blocks from a copy: refused too, since
    resuming would put the run's exactness in the user's word."""
    new_run = "to train on the files as they are now, start a new run (another run.name, or run.resume=never in a "
    new_run += "new directory)"
    for before, now in zip(stored, current, strict=False):
        sizes_or_samples = [
            f"{what} {before.get(key)} -> {now[key]}"
            for key, what in (("bytes", "size (bytes)"), ("sampled_sha256", "sampled blocks' hash"))
            if before.get(key) != now[key]
        ]
        if sizes_or_samples:
            raise CheckpointError(
                f"{now['path']} holds other tokens than when checkpoint {path} was written "
                f"({'; '.join(sizes_or_samples)}), so the resumed steps would read other data than the steps "
                f"before; {new_run}"
            )
        if before.get("sha256") is not None and now.get("sha256") is not None:
            if before["sha256"] != now["sha256"]:
                raise CheckpointError(
                    f"{now['path']} was edited since checkpoint {path} was written (the whole file's hash "
                    f"{before['sha256']} -> {now['sha256']}, the same size), so the resumed steps would read other "
                    f"tokens than the steps before; {new_run}"
                )
            continue  # every byte is the same: the modification time does not matter
        if before.get("mtime_ns") != now["mtime_ns"]:
            unhashed = (
                "data this large is not hashed whole at each start"
                if now.get("sha256") is None
                else "the checkpoint, written by an older version, holds no hash of the whole file"
            )
            raise CheckpointError(
                f"{now['path']} was written since checkpoint {path} was (modified (ns) {before.get('mtime_ns')} -> "
                f"{now['mtime_ns']}), and {unhashed}, so whether its tokens between the sampled blocks are the ones "
                f"the run trained on cannot be checked; {new_run}; to "
                f"resume this one, put back the files the run started with, copied with their modification times "
                f"(cp -p, rsync -a)"
            )


def check_ranks_agree_on_resume(context: DistributedContext, resume: dict | None, run_dir: Path) -> None:
    """Every rank reads the checkpoint itself. Where nodes do not share the run directory, ranks on another
    node find no checkpoint and would start afresh beside a resuming rank 0: refused instead."""
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


def resume_checked_together(resume: dict | None, find_older: Callable[[int], dict | None], warn) -> dict | None:
    """A sharded checkpoint's shard files checked by the ranks together, each its share (sharded_checkpoint.py's
    verify_shares_together); one found damaged is passed over on every rank alike for the newest older checkpoint,
    `find_older(step)` (find_resume_point's, at most that step), checked the same way. Every rank must call this."""
    if resume is None or "sharded" not in resume:
        return resume
    from accumulation.run.sharded_checkpoint import verify_shares_together

    while "sharded" in resume:  # an older checkpoint may be a single file, checked whole before the ranks joined
        try:
            verify_shares_together(Path(resume["sharded"]))
            return resume
        except CheckpointError as problem:
            older = find_older(resume["counters"]["steps"] - 1)
            if older is None:
                raise CheckpointError(
                    f"{problem}; there is no older checkpoint: delete the folder to start afresh or restore a good one"
                ) from None
            warn(f"warning: {problem}; passed over for an older checkpoint")
            resume = older
    return resume


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


def set_learning_rates(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set every parameter group's lr to the schedule's value after `scheduler.last_epoch` applied updates.

    Needed after a resume: the optimizer's state brings back the lr the *old* schedule gave the last step,
    and LambdaLR would apply the new schedule (a longer cosine horizon, another warm-up) only from its next
    step() on, one update too late. With an unchanged schedule this recomputes the same value."""
    for group, base_lr, multiplier in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base_lr * multiplier(scheduler.last_epoch)


def restore_training_state(training, resume: dict, config: Config, context: DistributedContext):
    """A resume's optimizer, scheduler, scaler and random states loaded into train.py's Training; returns the
    counters and the skipped steps in a row (up to optim.max_consecutive_skips; checkpointed with the counters)."""
    # find_resume_point checked the config, the model's shapes and the plain values; PyTorch's own
    # state dicts are checked by their loaders, still before anything is written.
    try:
        # this run's fused/foreach and device; whole tensors cut into this rank's shards under fsdp2
        if "sharded" in resume:  # the weights and the optimizer's tensors, read as this run holds them
            from accumulation.run.sharded_checkpoint import load_sharded_state

            if training.pipeline is None:
                load_sharded_state(resume, training.model, training.optimizer)
            else:  # this stage's tensors only, found under the whole model's names and numbers
                from accumulation.parallel.pipeline import whole_names, whole_numbers

                pipeline = training.pipeline
                numbers = whole_numbers(pipeline, training.optimizer)
                load_sharded_state(resume, pipeline.stage_module, training.optimizer, whole_names(pipeline), numbers)
        saved_optimizer = resume["optimizer"]
        if training.pipeline is not None:  # the whole model's state, numbered as one optimizer: this stage's part
            from accumulation.parallel.pipeline import stage_optimizer_state

            saved_optimizer = stage_optimizer_state(training.pipeline, training.optimizer, saved_optimizer)
        whole = config.dist.strategy == "fsdp2" and "sharded" not in resume  # whole tensors to cut into shards
        load_optimizer_state(training.optimizer, saved_optimizer, sharded=whole)
        training.scheduler.load_state_dict(resume["scheduler"])
        if resume["scaler"]:  # empty when the checkpoint's run had no GradScaler: this one starts afresh
            training.setup.scaler.load_state_dict(resume["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"the checkpoint's optimizer, scheduler or scaler state does not fit this run ({error}); {OLDER_CHECKPOINT}"
        ) from None
    set_learning_rates(training.scheduler)  # the new config's schedule governs the very next step
    counters = Counters(**resume["counters"])
    skips_in_a_row = resume["skips_in_a_row"]
    restore_rng_states(resume["rng"], context, config, counters.steps)
    resume.clear()  # the loaded state lives in the model and optimizer now: the payload's copy is freed
    return counters, skips_in_a_row
