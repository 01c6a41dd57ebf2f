"""Learning-rate schedules. Their unit is applied optimizer updates: a skipped step does not advance them,
and neither do micro-batches, so the warm-up lasts the same number of updates whatever A and D are."""

import math

import torch


def lr_multiplier(updates: int, name: str, warmup_updates: int, decay_updates: int, min_lr_ratio: float) -> float:
    """The factor on the base learning rate after `updates` applied updates.

    Linear warm-up from 1/(warmup_updates+1) to 1 over `warmup_updates` updates; then either constant, or a
    cosine from 1 down to `min_lr_ratio` reached at `decay_updates` and held after it.
    """
    if updates < warmup_updates:
        return (updates + 1) / (warmup_updates + 1)
    if name == "constant":
        return 1.0
    if name != "cosine":
        raise ValueError(f'unknown schedule {name!r}; expected "cosine" or "constant"')
    if updates >= decay_updates:
        return min_lr_ratio
    progress = (updates - warmup_updates) / max(decay_updates - warmup_updates, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, warmup_updates: int, decay_updates: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose `last_epoch` counts applied updates (the loop calls `.step()` only after one)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda updates: lr_multiplier(updates, name, warmup_updates, decay_updates, min_lr_ratio)
    )


def run_scheduler(optimizer: torch.optim.Optimizer, schedule, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule (config.schedule): its cosine horizon is schedule.decay_updates, or run.max_steps
    (`max_steps`) when that is 0, so a resume that raises run.max_steps stretches it (docs/training.md)."""
    decay_updates = schedule.decay_updates or max_steps
    return build_scheduler(optimizer, schedule.name, schedule.warmup_updates, decay_updates, schedule.min_lr_ratio)
