"""Does it matter in training? The same run with the correct step and with three buggy normalizations.

    python scripts/teaching/loss_curves.py [--steps 300] [--png docs/figures/loss_curves.png] [--json]

Supervised fine-tuning on data/sft_arithmetic.jsonl (configs/sft.toml: one prompt/response per row, only the
response supervised, 3 to 85 supervised tokens per row) with a smaller GPT, on 2 gloo ranks the script
spawns itself, global batch 32 = micro 4 x accum 4 x ranks 2, AdamW with the config's warm-up, cosine decay
and clipping at 1.0. Four runs from the same initial weights on the same examples, step by step, and a fifth for scale:

  correct                      the project's optimizer_step: each rank backpropagates S_rk · D / N
  mean of micro-batch means    each micro-batch's mean loss / A (the classic loop; gallery row 1)
  per-rank N                   S_rk / N_r with each rank's own token count (gallery row 2)
  ×D forgotten                 S_rk / N, no × D: the gradient is half the true one (gallery row 15)
  correct, other data order    the correct step on the examples of run.seed + 1: how far two correct
                               runs land apart by chance, the yardstick for the differences above

Every run logs the same quantity, the step's exact global token-mean loss, so the curves are comparable;
the validation loss (token mean over the validation split) is measured at the end. The table on stdout
(or --json) gives each run's final numbers and their difference from the correct run; the figure shows the
training curves (a moving average over SMOOTHING steps) and each run's difference from the correct one.
About three minutes for 300 steps on 2 CPU cores.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accumulation.build import build_optimizer
from accumulation.config import load_config
from accumulation.data import build_data, eval_micro_batches, step_batch
from accumulation.models import build_model
from accumulation.schedule import build_scheduler
from accumulation.step import all_reduce_ints, count_supervised_tokens, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks

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
VARIANTS = ("correct", "mean of micro-batch means", "per-rank N", "×D forgotten", "correct, other data order")
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


def train_all_variants(rank: int, world_size: int, steps: int) -> dict:
    """Runs on each rank: the four runs one after the other; returns each run's losses."""
    config = load_config(CONFIG_ARGUMENTS)
    data = build_data(config)
    batch = config.batch
    curves = {}
    for variant in VARIANTS:
        model = build_model(config, data.vocab_size)  # the same initial weights for every run and rank
        wrapped = DistributedDataParallel(model)
        optimizer = build_optimizer(config, model, CPU)
        schedule = config.schedule
        scheduler = build_scheduler(optimizer, schedule.name, schedule.warmup_updates, steps, schedule.min_lr_ratio)
        losses = []
        for step in range(steps):
            seed = config.run.seed + 1 if variant == "correct, other data order" else config.run.seed
            micro_batches = step_batch(
                data.train,
                step,
                seed=seed,
                global_batch_size=batch.global_batch_size,
                tail=batch.tail,
                micro_batch_size=batch.micro_batch_size,
                world_size=world_size,
                rank=rank,
            ).micro_batches
            if variant.startswith("correct"):
                result = optimizer_step(wrapped, micro_batches, optimizer, device=CPU, grad_clip=config.optim.grad_clip)
                losses.append(result.loss)
            else:
                losses.append(global_token_mean(wrapped, micro_batches))
                buggy_step(wrapped, micro_batches, optimizer, variant, config.optim.grad_clip)
            scheduler.step()  # every step applies its update here: no GradScaler, no empty step
        curves[variant] = {
            "train": losses,
            "val": validation_loss(model, data, batch.micro_batch_size, rank, world_size),
        }
    return curves


def summary(curves: dict) -> list[dict]:
    rows = []
    for variant, curve in curves.items():
        final_train = sum(curve["train"][-FINAL_WINDOW:]) / len(curve["train"][-FINAL_WINDOW:])
        rows.append({"variant": variant, "final_train_loss": final_train, "val_loss": curve["val"]})
    correct = rows[0]
    for row in rows:
        row["train_minus_correct"] = row["final_train_loss"] - correct["final_train_loss"]
        row["val_minus_correct"] = row["val_loss"] - correct["val_loss"]
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def draw(curves: dict, png_path: str) -> None:
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    figure = Figure(figsize=(11, 4), layout="constrained")
    loss_axes, difference_axes = figure.subplots(1, 2)
    window = min(SMOOTHING, len(curves["correct"]["train"]))
    correct = moving_average(curves["correct"]["train"], window)
    for variant, curve in curves.items():
        smoothed = moving_average(curve["train"], window)
        steps = range(1, len(smoothed) + 1)
        style = {"color": "grey", "linestyle": "--"} if variant == "correct, other data order" else {}
        loss_axes.plot(steps, smoothed, label=f"{variant} (val {curve['val']:.3f})", linewidth=1.2, **style)
        differences = [s - c for s, c in zip(smoothed, correct, strict=True)]
        difference_axes.plot(steps, differences, linewidth=1.2, **style)
    loss_axes.set_xlabel("optimizer updates")
    loss_axes.set_ylabel(f"training loss (token mean, average of {window} steps)")
    loss_axes.legend(fontsize=8)
    difference_axes.axhline(0.0, color="grey", linewidth=0.8)
    difference_axes.set_xlabel("optimizer updates")
    difference_axes.set_ylabel("minus the correct run")
    figure.suptitle("SFT arithmetic, 2 ranks, global 32 = micro 4 x accum 4 x ranks 2, AdamW", fontsize=10)
    figure.savefig(png_path, dpi=90)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--png", default="loss_curves.png", help="where to write the figure (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the final numbers as JSON instead of a table")
    args = parser.parse_args(argv)

    curves = run_on_ranks(train_all_variants, WORLD_SIZE, args=(args.steps,), timeout_s=3600)[0]
    rows = summary(curves)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'run':<28}{'final train loss':>18}{'val loss':>10}{'train - correct':>17}{'val - correct':>15}")
        for row in rows:
            print(
                f"{row['variant']:<28}{row['final_train_loss']:>18.4f}{row['val_loss']:>10.4f}"
                f"{row['train_minus_correct']:>+17.4f}{row['val_minus_correct']:>+15.4f}"
            )
    draw(curves, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
