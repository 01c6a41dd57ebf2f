"""Three pictures for docs/accumulation.md, each drawn from numbers this script computes or measures.

    python scripts/teaching/figures.py [--out docs/figures]

normalization.png  where the sum over micro-batches, DDP's mean over ranks and the × D enter: a worked example
                   (D = 2 ranks, A = 2 micro-batches of uneven token counts), in nats and nats per token.
no_sync_timeline.png  which backward all-reduces: gradient bytes each micro-batch's backward sends, measured
                   with a DDP communication hook on 2 gloo ranks, for the correct loop (no_sync around forward
                   and backward), the forward outside no_sync, and the sync flag set after the forward.
amp_order.png      the GradScaler's call order: the gradient norm after each call of one update (A = 4, loss
                   scale s = 1024, clipping at a tenth of the true norm), for the right order and for
                   clipping before unscale_.

Prints the numbers each figure shows, one `name: value` per line. D is the data-parallel group size (the
ranks that read different examples), which equals the world size only without tensor or pipeline
parallelism.
"""

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.step import token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import counting_allreduce_hook, float64_reference_gradient

MODEL = GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, vocab_size=256)
MICRO_BATCH_SIZE, ACCUMULATION_STEPS, RANKS = 2, 4, 2  # m, A, D
LOSS_SCALE = 2.0**10  # s, a power of two: scaling and unscaling are exact

# The worked example: supervised tokens and mean loss per token (nats) of micro-batch k on rank r.
TOKENS = [[30, 10], [5, 15]]  # N_rk; N = 60
MEAN_LOSS = [[2.0, 3.0], [4.0, 2.5]]  # nats per token


# Figures are read on a projector: every text at least FONT_PT points at the saved size (the figure's inches
# at its dpi), titles TITLE_PT. tests/test_teaching_figures.py checks every text of the drawn figures.
FONT_PT, TITLE_PT = 11, 12


def matplotlib_defaults() -> None:
    """Axis labels and tick labels without an explicit size take matplotlib's default: make it FONT_PT."""
    import matplotlib

    matplotlib.rcParams.update({"font.size": FONT_PT, "axes.titlesize": TITLE_PT, "legend.fontsize": FONT_PT})


def normalization_example() -> dict:
    """What each rank's .grad holds is the gradient of what it backpropagated; follow the loss values (in the
    same units) through the sum over micro-batches and DDP's mean over ranks."""
    ranks = len(TOKENS)
    tokens = sum(map(sum, TOKENS))  # N over all micro-batches of all ranks
    loss_sums = [
        [n * mean for n, mean in zip(n_r, mean_r, strict=True)] for n_r, mean_r in zip(TOKENS, MEAN_LOSS, strict=True)
    ]
    true_mean = sum(map(sum, loss_sums)) / tokens  # L = Σ_r Σ_k S_rk / N, nats per token
    with_d = [sum(s * ranks / tokens for s in row) for row in loss_sums]  # Σ_k S_rk · D / N on each rank
    without_d = [sum(s / tokens for s in row) for row in loss_sums]  # Σ_k S_rk / N
    return {
        "loss_sums": loss_sums,
        "tokens": tokens,
        "true_mean": true_mean,
        "rank_with_d": with_d,
        "rank_without_d": without_d,
        "ddp_mean_with_d": sum(with_d) / ranks,  # DDP's all-reduce averages over the D ranks
        "ddp_mean_without_d": sum(without_d) / ranks,
    }


def draw_normalization(example: dict, png_path: Path):
    from matplotlib.figure import Figure

    matplotlib_defaults()

    figure = Figure(figsize=(15, 5), layout="constrained")
    sums_axes, ranks_axes, mean_axes = figure.subplots(1, 3, width_ratios=[1.4, 1, 1])
    labels = [f"rank {r}\nmicro-batch {k}\n{TOKENS[r][k]} tokens" for r in range(2) for k in range(2)]
    values = [s for row in example["loss_sums"] for s in row]
    colours = ["tab:blue", "tab:blue", "tab:purple", "tab:purple"]  # one per rank; green and red mean right, wrong
    bars = sums_axes.bar(labels, values, color=colours)
    sums_axes.bar_label(bars, fmt="%.1f", fontsize=FONT_PT)
    sums_axes.set_ylabel("loss sum S_rk (nats)")
    sums_axes.set_title("1. each backward: S_rk, then × D / N", fontsize=TITLE_PT)
    sums_axes.tick_params(labelsize=FONT_PT)

    positions = [0, 1]
    width = 0.38
    for offset, key, colour, label in (
        (-width / 2, "rank_with_d", "tab:green", "Σ_k S_rk · D / N (right)"),
        (width / 2, "rank_without_d", "tab:red", "Σ_k S_rk / N (× D forgotten)"),
    ):
        bars = ranks_axes.bar([p + offset for p in positions], example[key], width, color=colour, label=label)
        ranks_axes.bar_label(bars, fmt="%.3f", fontsize=FONT_PT)
    ranks_axes.set_xticks(positions, ["rank 0", "rank 1"])
    ranks_axes.set_ylabel("accumulated on the rank (nats per token)")
    ranks_axes.set_title("2. backward adds: sum over micro-batches", fontsize=TITLE_PT)
    ranks_axes.legend(fontsize=FONT_PT)

    bars = mean_axes.bar(
        ["× D / N", "/ N only"],
        [example["ddp_mean_with_d"], example["ddp_mean_without_d"]],
        color=["tab:green", "tab:red"],
    )
    mean_axes.bar_label(bars, fmt="%.3f", fontsize=FONT_PT)
    mean_axes.axhline(example["true_mean"], color="black", linestyle="--", linewidth=1)
    mean_axes.text(1.45, example["true_mean"], " L = Σ S / N", va="bottom", ha="right", fontsize=FONT_PT)
    mean_axes.set_ylabel("after DDP's all-reduce (nats per token)")
    mean_axes.set_title("3. DDP averages over the D = 2 ranks", fontsize=TITLE_PT)
    figure.suptitle(
        f"Where × D enters: N = {example['tokens']} tokens over all micro-batches and ranks; D = data-parallel "
        "ranks (not the world size)",
        fontsize=TITLE_PT,
    )
    figure.savefig(png_path, dpi=90)
    return figure


def micro_batches(seed: int) -> list[MicroBatch]:
    """A micro-batches of m rows; each row supervises a random prefix of 1 to seq_len tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(ACCUMULATION_STEPS):
        shape = (MICRO_BATCH_SIZE, MODEL.seq_len)
        inputs, targets = (torch.randint(MODEL.vocab_size, shape, generator=generator) for _ in range(2))
        supervised = torch.randint(1, MODEL.seq_len + 1, (MICRO_BATCH_SIZE, 1), generator=generator)
        labels = torch.where(torch.arange(MODEL.seq_len) < supervised, targets, IGNORE_INDEX)
        batches.append(MicroBatch(inputs, labels, MICRO_BATCH_SIZE))
    return batches


def gpt() -> GPT:
    return GPT(MODEL, seed=0).double()


def loss_sum(model: torch.nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
    """S_k: the sum of the token losses of one micro-batch, in nats."""
    return token_cross_entropy_sum(model(micro_batch.inputs), micro_batch.labels)


def per_backward_bytes(rank: int, world_size: int) -> dict:
    """On each rank: the gradient bytes each backward all-reduces, for three ways to write the group."""
    batches = micro_batches(seed=rank)  # each rank its own examples
    last = len(batches) - 1
    sent = {}
    for loop in ("no_sync around forward and backward", "forward outside no_sync", "sync flag set after forward"):
        model = DistributedDataParallel(gpt())
        state = {"bytes": 0}
        model.register_comm_hook(state, counting_allreduce_hook)
        per_backward = []
        for k, mb in enumerate(batches):
            before = state["bytes"]
            if loop == "no_sync around forward and backward":
                with model.no_sync() if k < last else contextlib.nullcontext():
                    loss_sum(model, mb).backward()
            elif loop == "forward outside no_sync":
                loss = loss_sum(model, mb)
                with model.no_sync() if k < last else contextlib.nullcontext():
                    loss.backward()
            else:
                loss = loss_sum(model, mb)
                model.require_backward_grad_sync = k == last  # read by the NEXT forward, not this backward
                loss.backward()
            per_backward.append(state["bytes"] - before)
        sent[loop] = per_backward
    return sent


def draw_timeline(sent: dict, gradient_bytes: int, png_path: Path):
    """One row per loop, one box per backward. Blue: an all-reduce where the correct loop (the first row) has
    one; grey: local, where it is local too; red, only for what is wrong: an all-reduce the correct loop does
    not send, or a missing one."""
    from matplotlib.figure import Figure

    matplotlib_defaults()

    figure = Figure(figsize=(15, 4.6), layout="constrained")
    axes = figure.subplots()
    expected = next(iter(sent.values()))  # the correct loop: no_sync around forward and backward
    for row, per_backward in enumerate(sent.values()):
        for k, num_bytes in enumerate(per_backward):
            right = (num_bytes > 0) == (expected[k] > 0)
            colour = ("tab:blue" if num_bytes > 0 else "lightgrey") if right else "tab:red"
            axes.barh(row, 0.9, left=k + 0.05, color=colour, alpha=0.85)
            if num_bytes > 0:
                label = f"all-reduce\n{num_bytes / 1000:,.0f} kB" + ("" if right else "\n(extra)")
            else:
                label = "local only" + ("" if right else "\n(sync missing)")
            axes.text(k + 0.5, row, label, ha="center", va="center", fontsize=FONT_PT)
        total = sum(per_backward) / 1000
        axes.text(len(per_backward) + 0.1, row, f"{total:,.0f} kB per update", va="center", fontsize=FONT_PT)
    accumulation_steps = len(next(iter(sent.values())))
    axes.set_yticks(range(len(sent)), list(sent), fontsize=FONT_PT)
    axes.set_xticks(
        [k + 0.5 for k in range(accumulation_steps)],
        [f"backward {k + 1}" for k in range(accumulation_steps)],
        fontsize=FONT_PT,
    )
    axes.set_xlim(0, accumulation_steps + 1.9)
    axes.invert_yaxis()
    axes.set_xlabel(f"micro-batches of one update (A = {accumulation_steps}); one gradient = {gradient_bytes:,} bytes")
    axes.set_title(
        "Which backward all-reduces (bytes measured with a DDP communication hook, 2 gloo ranks; red: wrong)",
        fontsize=TITLE_PT,
    )
    figure.savefig(png_path, dpi=90)
    return figure


def gradient_norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float((p.grad**2).sum()) for p in model.parameters() if p.grad is not None))


def amp_call_order() -> dict:
    """The gradient norm after each call of one update, in the right order and with the clip before unscale_.
    Float64 on CPU: the GradScaler's power-of-two scale multiplies and divides exactly."""
    batches = micro_batches(seed=0)
    true_norm = math.sqrt(sum(float((g**2).sum()) for g in float64_reference_gradient(gpt(), batches)))
    max_norm = 0.1 * true_norm
    tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batches)  # N
    orders = {}
    for order in ("right: unscale_, clip, step, update", "wrong: clip before unscale_"):
        model = gpt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
        calls = []
        for k, mb in enumerate(batches):
            scaler.scale(loss_sum(model, mb) / tokens).backward()
            calls.append((f"scale(loss).backward() {k + 1}", gradient_norm(model)))
        steps = ["unscale_", "clip"] if order.startswith("right") else ["clip", "unscale_"]
        for call in steps:
            if call == "unscale_":
                scaler.unscale_(optimizer)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            calls.append((call, gradient_norm(model)))
        # scaler.step unscales now if unscale_ has not run (the wrong order): the norm the update uses.
        used = []
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, used=used, model=model: used.append(gradient_norm(model))
        )
        scaler.step(optimizer)
        calls.append(("step (norm used)", used[0]))
        scaler.update()
        orders[order] = calls
    return {"true_norm": true_norm, "max_norm": max_norm, "scale": LOSS_SCALE, "orders": orders}


def draw_amp_order(amp: dict, png_path: Path):
    from matplotlib.figure import Figure

    matplotlib_defaults()

    figure = Figure(figsize=(14, 6), layout="constrained")
    axes = figure.subplots()
    # The two orders share their first calls, so the right one is drawn wide underneath and the wrong one
    # thin and dashed on top: both stay visible where they coincide.
    for (order, calls), style in zip(
        amp["orders"].items(),
        (
            {"color": "tab:green", "marker": "o", "linewidth": 5, "markersize": 11, "zorder": 2},
            {"color": "tab:red", "marker": "s", "linewidth": 1.8, "linestyle": "--", "markersize": 6, "zorder": 3},
        ),
        strict=True,
    ):
        axes.plot(range(len(calls)), [norm for _, norm in calls], label=order, **style)
    right, wrong = ([name for name, _ in calls] for calls in amp["orders"].values())
    names = [a if a == b else f"{a} (right)\n{b} (wrong)" for a, b in zip(right, wrong, strict=True)]
    axes.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=FONT_PT)
    axes.set_xlabel("the calls of one update, in order")
    axes.set_yscale("log")
    axes.axhline(amp["max_norm"], color="grey", linestyle="--", linewidth=0.8)
    axes.text(0, amp["max_norm"], " max_norm", va="bottom", fontsize=FONT_PT)
    axes.axhline(amp["true_norm"], color="black", linestyle=":", linewidth=0.8)
    axes.text(0, amp["true_norm"], " true gradient norm", va="bottom", fontsize=FONT_PT)
    axes.set_ylabel("norm of .grad (log; gradient of nats per token)")
    axes.set_title(
        f"GradScaler call order, one update of A = 4 micro-batches, s = {amp['scale']:.0f}", fontsize=TITLE_PT
    )
    axes.legend(fontsize=FONT_PT)
    figure.savefig(png_path, dpi=90)
    return figure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for the three PNGs (default: %(default)s)")
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the spawned ranks share the same cores

    example = normalization_example()
    print(f"normalization.true_mean: {example['true_mean']:.4f}")
    print(f"normalization.ddp_mean_with_d: {example['ddp_mean_with_d']:.4f}")
    print(f"normalization.ddp_mean_without_d: {example['ddp_mean_without_d']:.4f}")
    draw_normalization(example, out / "normalization.png")

    sent = run_on_ranks(per_backward_bytes, RANKS)[0]
    gradient_bytes = sum(p.numel() * p.element_size() for p in gpt().parameters())
    for loop, per_backward in sent.items():
        print(f"timeline.{loop}: {' '.join(str(b) for b in per_backward)}")
    draw_timeline(sent, gradient_bytes, out / "no_sync_timeline.png")

    amp = amp_call_order()
    for order, calls in amp["orders"].items():
        print(f"amp.{order}: {' '.join(f'{norm:.3g}' for _, norm in calls)}")
    draw_amp_order(amp, out / "amp_order.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
