"""Does it matter in training? The same run with the correct step and with three buggy normalizations.

    python scripts/teaching/loss_curves.py [--steps 300] [--seeds 3] [--png docs/figures/loss_curves.png] [--json]

Supervised fine-tuning on data/sft_arithmetic.jsonl (configs/sft.toml: one prompt/response per row, only the
response supervised, 3 to 85 supervised tokens per row) with a smaller GPT, on 2 gloo ranks the script
spawns itself, global batch 32 = micro 4 x accum 4 x ranks 2, AdamW with the config's warm-up, cosine decay
and clipping at 1.0. Four runs per seed, from the same initial weights on the same examples, step by step:

  correct                      the project's optimizer_step: each rank backpropagates S_rk · D / N
  mean of micro-batch means    each micro-batch's mean loss / A (the classic loop; gallery row 1)
  per-rank N                   S_rk / N_r with each rank's own token count (gallery row 2)
  ×D forgotten                 S_rk / N, no × D: the gradient is half the true one (gallery row 15)

and all four again for each of --seeds values of run.seed (initial weights and data order both change).
The seeds are the yardstick: how far two correct runs land apart by chance, against how far a bug moves a
run from the correct run on the same seed. Every run logs the same quantity, the step's exact global
token-mean loss, so the curves are comparable; the validation loss (token mean over the validation split)
is measured at the end. The table on stdout (or --json) gives, per run, the validation loss of each seed
and the paired difference from the correct run of the same seed; the figure shows the training curves of
the first seed (a moving average over SMOOTHING steps) and each bug's paired difference on every seed.
The run time grows with steps x seeds: see docs/accumulation.md, section 11, for a measured one.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import all_reduce_ints, count_supervised_tokens
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, eval_micro_batches, step_batch
from accumulation.models.factory import build_model
from accumulation.run.build import build_optimizer
from accumulation.schedule import build_scheduler
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks

# Run as `python scripts/teaching/loss_curves.py`, Python puts only this file's folder on sys.path: the
# repository root goes first, so that the figures' shared sizes import as scripts.teaching.figures.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.figures import FONT_PT, TITLE_PT, matplotlib_defaults

REPO = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
CONFIG_ARGUMENTS = [
    "--config",
    str(REPO / "configs" / "sft.toml"),
    f"data.source={REPO / 'data' / 'sft_arithmetic.jsonl'}",  # the config's relative path, from anywhere
    "batch.micro_batch_size=4",  # A = 32 / (4 · 2) = 4: micro-batches of 4 rows, whose token counts vary
    "model.n_layer=1",
    "model.d_model=48",
    "model.n_head=2",
]
VARIANTS = ("correct", "mean of micro-batch means", "per-rank N", "×D forgotten")
SMOOTHING = 25  # steps in the moving average of the figure
FINAL_WINDOW = 50  # the final training loss is the mean over the last this many steps
CPU = torch.device("cpu")


def buggy_step(model, micro_batches, optimizer, variant: str, grad_clip: float) -> None:
    """One accumulation group written the way each bug writes it; everything else as optimizer_step does it
    (no_sync on all but the last micro-batch, one clip of the whole gradient, one update)."""
    tokens_local = sum(count_supervised_tokens(mb.labels) for mb in micro_batches)
    [tokens_global] = all_reduce_ints([tokens_local], CPU)
    last = len(micro_batches) - 1
    for k, mb in enumerate(micro_batches):
        with model.no_sync() if k < last else contextlib.nullcontext():
            loss_sum = token_cross_entropy_sum(model(mb.inputs), mb.labels)  # S_rk
            if variant == "mean of micro-batch means":
                loss = loss_sum / max(count_supervised_tokens(mb.labels), 1) / len(micro_batches)
            elif variant == "per-rank N":
                loss = loss_sum / max(tokens_local, 1)
            elif variant == "×D forgotten":
                loss = loss_sum / tokens_global
            else:
                raise ValueError(f"unknown variant {variant!r}")
            loss.backward()  # DDP averages over the D ranks at the last micro-batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def global_token_mean(model, micro_batches) -> float:
    """The step's token-mean loss over all ranks, at the weights the step started from (for the buggy runs,
    which do not compute it: one extra forward without gradients)."""
    with torch.no_grad():
        loss_sum = sum(float(token_cross_entropy_sum(model.module(mb.inputs), mb.labels)) for mb in micro_batches)
    tokens = sum(count_supervised_tokens(mb.labels) for mb in micro_batches)
    summed = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
    dist.all_reduce(summed)
    return float(summed[0] / summed[1])


def validation_loss(model, data, micro_batch_size: int, rank: int, world_size: int) -> float:
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for mb in eval_micro_batches(data.val, micro_batch_size, world_size, rank):
            loss_sum += float(token_cross_entropy_sum(model(mb.inputs), mb.labels))
            tokens += count_supervised_tokens(mb.labels)
    summed = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
    dist.all_reduce(summed)
    return float(summed[0] / summed[1])


def train_all_variants(rank: int, world_size: int, steps: int, seeds: int) -> dict:
    """Runs on each rank: every variant on every seed, one after the other; returns {variant: [one
    {"train": losses, "val": loss} per seed]}."""
    first_seed = load_config(CONFIG_ARGUMENTS).run.seed
    curves = {variant: [] for variant in VARIANTS}
    for seed in range(first_seed, first_seed + seeds):
        config = load_config([*CONFIG_ARGUMENTS, f"run.seed={seed}"])
        for variant in VARIANTS:
            curves[variant].append(train_one(config, variant, steps, rank, world_size))
    return curves


def train_one(config, variant: str, steps: int, rank: int, world_size: int) -> dict:
    """One run of `variant` on this rank: its training losses per step and its final validation loss."""
    data = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    batch = config.batch
    # the same initial weights for every run and rank
    model = build_model(config.model, data.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    wrapped = DistributedDataParallel(model)
    optimizer = build_optimizer(config.optim, model, CPU)
    schedule = config.schedule
    scheduler = build_scheduler(optimizer, schedule.name, schedule.warmup_updates, steps, schedule.min_lr_ratio)
    losses = []
    for step in range(steps):
        micro_batches = step_batch(
            data.train,
            step,
            seed=config.run.seed,
            global_batch_size=batch.global_batch_size,
            tail=batch.tail,
            micro_batch_size=batch.micro_batch_size,
            world_size=world_size,
            rank=rank,
        ).micro_batches
        if variant == "correct":
            result = optimizer_step(StepSetup(wrapped, CPU, grad_clip=config.optim.grad_clip), micro_batches, optimizer)
            losses.append(result.loss)
        else:
            losses.append(global_token_mean(wrapped, micro_batches))
            buggy_step(wrapped, micro_batches, optimizer, variant, config.optim.grad_clip)
        scheduler.step()  # every step applies its update here: no GradScaler, no empty step
    return {"train": losses, "val": validation_loss(model, data, batch.micro_batch_size, rank, world_size)}


def summary(curves: dict) -> list[dict]:
    """Per variant: each seed's final training loss (mean of the last FINAL_WINDOW steps) and validation
    loss, and the paired differences from the correct run of the same seed."""
    rows = []
    for variant, runs in curves.items():
        train = [sum(run["train"][-FINAL_WINDOW:]) / len(run["train"][-FINAL_WINDOW:]) for run in runs]
        rows.append({"variant": variant, "final_train_loss": train, "val_loss": [run["val"] for run in runs]})
    correct = rows[0]
    for row in rows:
        for key, difference in (("final_train_loss", "train_minus_correct"), ("val_loss", "val_minus_correct")):
            row[difference] = [value - base for value, base in zip(row[key], correct[key], strict=True)]
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def draw(curves: dict, png_path: str):
    """Left: the training curves of the first seed. Right: each bug's paired difference from the correct run
    of the same seed, one thin line per seed, and the correct runs' own spread across seeds for scale."""
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    matplotlib_defaults()  # every text at least FONT_PT: the figure is read on a projector
    figure = Figure(figsize=(15, 6), layout="constrained")
    loss_axes, difference_axes = figure.subplots(1, 2)
    window = min(SMOOTHING, len(curves["correct"][0]["train"]))
    correct = [moving_average(run["train"], window) for run in curves["correct"]]
    for (variant, runs), colour in zip(curves.items(), ("black", "tab:red", "tab:orange", "tab:blue"), strict=True):
        smoothed = [moving_average(run["train"], window) for run in runs]
        updates = range(1, len(smoothed[0]) + 1)
        validation = ", ".join(f"{run['val']:.3f}" for run in runs)
        loss_axes.plot(updates, smoothed[0], color=colour, linewidth=1.2, label=f"{variant} (val {validation})")
        if variant == "correct":
            continue
        for seed_index, (run, base) in enumerate(zip(smoothed, correct, strict=True)):
            differences = [value - reference for value, reference in zip(run, base, strict=True)]
            difference_axes.plot(
                updates, differences, color=colour, linewidth=0.9, label=variant if seed_index == 0 else None
            )
    spread = [max(values) - min(values) for values in zip(*correct, strict=True)]
    difference_axes.fill_between(
        updates, [-s for s in spread], spread, color="grey", alpha=0.25, label="± spread of correct runs across seeds"
    )
    loss_axes.set_xlabel("optimizer updates")
    loss_axes.set_ylabel(f"training loss (nats per token, {window}-step mean)")
    loss_axes.set_title("first seed; val = validation loss of each seed", fontsize=TITLE_PT)
    loss_axes.legend(fontsize=FONT_PT)
    difference_axes.axhline(0.0, color="grey", linewidth=0.8)
    difference_axes.set_xlabel("optimizer updates")
    difference_axes.set_ylabel("bug − correct, same seed (nats per token)")
    difference_axes.legend(fontsize=FONT_PT)
    seeds = len(curves["correct"])
    figure.suptitle(
        f"SFT arithmetic, 2 ranks, global 32 = micro 4 x accum 4 x ranks 2, AdamW, {seeds} seeds", fontsize=TITLE_PT
    )
    figure.savefig(png_path, dpi=90)
    return figure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="run.seed values per variant (default: %(default)s)")
    parser.add_argument("--png", default="loss_curves.png", help="where to write the figure (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the final numbers as JSON instead of a table")
    args = parser.parse_args(argv)

    curves = run_on_ranks(train_all_variants, WORLD_SIZE, args=(args.steps, args.seeds), timeout_s=7200)[0]
    rows = summary(curves)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'run':<28}{'val loss per seed':>26}{'val - correct per seed':>30}{'train - correct, mean':>23}")
        for row in rows:
            validation = " ".join(f"{value:.4f}" for value in row["val_loss"])
            paired = " ".join(f"{value:+.4f}" for value in row["val_minus_correct"])
            train = sum(row["train_minus_correct"]) / len(row["train_minus_correct"])
            print(f"{row['variant']:<28}{validation:>26}{paired:>30}{train:>+23.4f}")
    draw(curves, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
