"""A gallery of real gradient-accumulation bugs, each measured next to the correct update on the same data.

    python scripts/teaching/pitfalls.py [--json] [--png PATH]

Every pitfall is a pair of twins. The buggy twin is the mistake written out plainly, as people write it; the
correct twin is this project's `optimizer_step` (or its data order), so the gallery tests our loop as well.
Most pairs are judged against an independent reference: PyTorch's own token-mean cross-entropy
(`reduction="mean"`, `ignore_index=-100`) over one big float64 batch made of every micro-batch of the step.
Rows 26 to 31 (pitfall_cases_rl.py) are RL aggregation bugs of GRPO-family losses, judged against the float64
gradient of the objective written from its definition.

The table on stdout (or, with --json, a list of {"pitfall", "metric", "buggy", "correct", "cosine",
"norm_ratio", "reference"}) shows one number per twin. Where the twins are gradients or updates, two more
numbers split the error into its direction and its scale: the cosine between the buggy and the correct
vector (1 = same direction) and the ratio of their norms (1 = same length). A bug with cosine 1 is "only a
scale", which SGD feels as another learning rate and Adam absorbs only while it stays constant and the gradient stays
well above its eps; a cosine below 1 changes where the model goes.
`reference` says what the correct column is compared with. The figure (--png, default pitfalls.png) draws
the rows in panels by kind of metric: relative errors, cosines, norm ratios, bytes and counts each on an
axis of their own. The exit status is 1 when a correct twin disagrees with its reference or a buggy twin
fails to show its bug, so the gallery doubles as a test. It took 47 s wall on this project's 2-core CPU
shared with other jobs (load average 0.5 to 3.9; measured once, 2026-12-01, before rows 23 to 25 joined);
nine pitfalls need 2 gloo ranks (three of them as 2 pipeline stages), which it spawns once, and row 31 spawns
2 more.
"""

import argparse
import json
import sys
import textwrap
from pathlib import Path

import torch

# Run as `python scripts/teaching/pitfalls.py`, Python puts only this file's folder on sys.path: the repository
# root goes first, so the gallery's other files import as scripts.teaching.*, as the tests import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.pitfall_cases_one_process import SINGLE_PROCESS_PITFALLS
from scripts.teaching.pitfall_cases_rl import OBJECTIVE_ERROR, RL_PITFALLS
from scripts.teaching.pitfall_cases_two_ranks import two_rank_pitfalls
from scripts.teaching.pitfall_setup import (
    ALLREDUCE_BYTES,
    GRADIENT_ERROR,
    LOSS_ERROR,
    LR_ERROR,
    RANK_DIVERGENCE,
    ROWS_NOT_ONCE,
    SAVED_BYTES,
    UPDATE_ERROR,
    Measurement,
)

# What a correct twin's residue is printed as. Its digits depend on the order in which the CPU's kernels add
# (vector width, blocking), so they differ from machine to machine while the order of magnitude does not: a
# float64 reordering costs a few ulps (1.1e-16 relative) of the largest entry, 5e-16 at most on the machines
# measured, and 1e-14 leaves a factor of 20. Adam's update divides by sqrt(v) + eps, which magnifies the
# same residue for small-gradient entries: 1.1e-12 and 3.1e-13 on two machines, bound 1e-11. The checks
# (pitfall_setup.py) keep their wider tolerances; these bounds only decide what the table and the guide print.
ROUNDING_BOUND = {
    GRADIENT_ERROR: 1e-14,
    OBJECTIVE_ERROR: 1e-14,
    LR_ERROR: 1e-14,
    LOSS_ERROR: 1e-14,
    UPDATE_ERROR: 1e-11,
}


# ---------------------------------------------------------------------------------------------------------
# The gallery: run, print, draw.
# ---------------------------------------------------------------------------------------------------------


def pitfall_number(measurement: Measurement) -> int:
    return int(measurement.pitfall.split(".")[0])


def run_gallery() -> list[Measurement]:
    measurements = two_rank_pitfalls() + [pitfall() for pitfall in SINGLE_PROCESS_PITFALLS + RL_PITFALLS]
    return sorted(measurements, key=pitfall_number)


def verdict(measurement: Measurement) -> str:
    if not measurement.correct_agrees:
        return "FAIL: correct twin disagrees"
    if not measurement.bug_shown:
        return "FAIL: bug not shown"
    return "ok"


def number(value: float) -> str:
    """Counts (bytes, rows) in full, anything else to 3 significant digits."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3g}"


def correct_cell(metric: str, value: float) -> str:
    """The correct column as the table prints it: a rounding-level residue as its bound ("< 1e-14"), since its
    digits are the CPU's reduction order (the same row gave 2.54e-16 on an AMD EPYC and 5.09e-16 on an Intel
    Xeon); an exact 0 or a count as it is."""
    bound = ROUNDING_BOUND.get(metric)
    if bound is not None and 0 < value < bound:
        return f"< {bound:.0e}"
    return number(value)


def optional_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def table(measurements: list[Measurement]) -> str:
    header = ("pitfall", "metric", "buggy", "correct", "cosine", "norm ratio", "check")
    lines = [
        (
            m.pitfall,
            m.metric,
            number(m.buggy),
            correct_cell(m.metric, m.correct),
            optional_number(m.cosine),
            optional_number(m.norm_ratio),
            verdict(m),
        )
        for m in measurements
    ]
    widths = [max(len(line[column]) for line in [header, *lines]) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    )


# The figure's panels: each kind of metric on an axis of its own, so bytes, rows and ratios never share a scale.
RELATIVE_ERRORS = (GRADIENT_ERROR, OBJECTIVE_ERROR, UPDATE_ERROR, LR_ERROR, LOSS_ERROR, RANK_DIVERGENCE)
BYTES = (ALLREDUCE_BYTES, SAVED_BYTES)
COUNTS = (ROWS_NOT_ONCE,)


# Figures are read on a projector: every text at least FONT_PT points at the saved size (the figure's inches
# at its dpi), titles TITLE_PT. tests/test_teaching_figures.py checks every text of the drawn figures.
FONT_PT, TITLE_PT = 11, 12
# The guide shows a figure at most as wide as its column: GitHub's file view sets markdown in a column of about
# 900 px and shrinks a wider image to fit. Drawn at 72 dpi and at most this wide, a point of the figure is a
# pixel on the page, so FONT_PT points stay FONT_PT pixels where the guide shows them.
GUIDE_WIDTH_PX, DPI = 900, 72
ERROR_FLOOR, ERROR_CEILING = 1e-18, 1e4  # the error panel's log axis
COUNTS_TITLE_CHARS = 30  # the counts panel's title, wrapped to fit its third of the figure's width


def matplotlib_defaults() -> None:
    """Axis labels and tick labels without an explicit size take matplotlib's default: make it FONT_PT."""
    import matplotlib

    matplotlib.rcParams.update({"font.size": FONT_PT, "axes.titlesize": TITLE_PT, "legend.fontsize": FONT_PT})


def exact_marker_text(metric: str, value: float) -> str | None:
    """What a correct twin at rounding level or exactly 0 is drawn as: a marker and this text, never a bar, since
    a bar from the axis's floor would give its length a meaning it does not have. None for any other value.
    Only an exact 0 (identical computations) is called exact; a rounding-level value is a bound (guide, section 9)."""
    if value == 0:
        return "0 (exact)"
    bound = ROUNDING_BOUND.get(metric)
    if bound is not None and value < bound:
        return f"< {bound:.0e} (rounding)"
    return None


def draw(measurements: list[Measurement], png_path: str):
    """Five panels, stacked to fit the guide's column. On top, one line per pitfall measured as a relative error,
    named with its metric: the buggy twin as a bar (log scale), the correct twin as a bar too unless it is
    at rounding level or 0, which is a marker at its bound with the text "< 1e-14 (rounding)" or "0 (exact)".
    Below, for the rows with vectors, the buggy twin's direction (cosine with the correct vector) and scale
    (norm ratio, log scale), each a bar from the ideal 1 to the value, so that 0.000977 and 5.94 read as
    deviations to opposite sides; red only where the buggy twin deviates, grey where it equals the ideal. At
    the bottom the rows measured in bytes, and in rows of data. Returns the figure."""
    from matplotlib.figure import Figure  # imported here: only drawing needs matplotlib

    matplotlib_defaults()

    errors = [m for m in measurements if m.metric in RELATIVE_ERRORS]
    vectors = [m for m in errors if m.cosine is not None]
    byte_rows = [m for m in measurements if m.metric in BYTES]
    count_rows = [m for m in measurements if m.metric in COUNTS]
    figure = Figure(
        figsize=(GUIDE_WIDTH_PX / DPI, 0.62 * len(errors) + 0.36 * len(vectors) + 4.6), layout="constrained"
    )
    panels = figure.subplot_mosaic(
        [["error", "error"], ["cosine", "scale"], ["bytes", "counts"]],
        height_ratios=[0.62 * len(errors), 0.36 * len(vectors) + 0.8, 2.6],
        width_ratios=[1.6, 1],
    )

    def twin_bars(axes, rows, floor=None):
        """Each row's buggy twin (red, above) and correct twin (green, below): bars, or a marker and text where
        the correct twin is exact."""
        positions = range(len(rows))
        buggy = [max(m.buggy, floor) if floor else m.buggy for m in rows]
        bars = axes.barh([p - 0.2 for p in positions], buggy, height=0.4, color="tab:red")
        axes.bar_label(bars, labels=[number(m.buggy) for m in rows], padding=3, fontsize=FONT_PT)
        exact = {p: exact_marker_text(m.metric, m.correct) for p, m in zip(positions, rows, strict=True)}
        barred = [p for p in positions if exact[p] is None]
        if barred:
            bars = axes.barh(
                [p + 0.2 for p in barred], [rows[p].correct for p in barred], height=0.4, color="tab:green"
            )
            axes.bar_label(bars, labels=[number(rows[p].correct) for p in barred], padding=3, fontsize=FONT_PT)
        marked = [p for p in positions if exact[p] is not None]
        if marked:
            # The marker sits at the bound (for 0: at the floor of a log axis); the text says what it stands for.
            at = [ROUNDING_BOUND[rows[p].metric] if rows[p].correct else (floor or 0) for p in marked]
            axes.plot(at, [p + 0.2 for p in marked], "<", color="tab:green", markersize=9, linestyle="none")
            for x, p in zip(at, marked, strict=True):
                axes.annotate(
                    exact[p], (x, p + 0.2), xytext=(8, 0), textcoords="offset points", va="center", fontsize=FONT_PT
                )

    axes = panels["error"]
    twin_bars(axes, errors, ERROR_FLOOR)
    axes.set_xscale("log")
    axes.set_xlim(ERROR_FLOOR, ERROR_CEILING)
    axes.set_yticks(range(len(errors)), [f"{m.pitfall}\n({m.metric})" for m in errors], fontsize=FONT_PT)
    axes.set_ylim(len(errors) - 0.5, -0.5)  # the first pitfall on top
    axes.set_title("relative error against the reference (log): buggy twin red, correct twin green", fontsize=TITLE_PT)

    for key, field, title in (
        ("cosine", "cosine", "direction: cos(buggy, correct)"),
        ("scale", "norm_ratio", "scale: |buggy| / |correct| (log)"),
    ):
        axes = panels[key]
        values = [getattr(m, field) for m in vectors]
        # A bar from the ideal 1 to the value (left of 1 below it, right above it); "1" where it is 1.
        colours = ["lightgrey" if abs(v - 1) < 5e-4 else "tab:red" for v in values]
        bars = axes.barh(range(len(values)), [v - 1 for v in values], left=1, height=0.6, color=colours)
        axes.bar_label(bars, labels=[f"{v:.3g}" for v in values], padding=3, fontsize=FONT_PT)
        axes.set_yticks(range(len(vectors)), [str(pitfall_number(m)) for m in vectors])
        axes.set_ylim(len(vectors) - 0.5, -0.5)
        axes.set_ylabel("gallery row", fontsize=FONT_PT)
        axes.set_title(title, fontsize=TITLE_PT)
    panels["cosine"].set_xlim(0.2, 1.3)
    panels["cosine"].axvline(1.0, color="grey", linewidth=0.8)
    panels["scale"].set_xscale("log")
    panels["scale"].set_xlim(1e-7, 1e4)
    panels["scale"].axvline(1.0, color="grey", linewidth=0.8)

    for key, rows, unit in (("bytes", byte_rows, "bytes"), ("counts", count_rows, "rows")):
        axes = panels[key]
        twin_bars(axes, rows)
        axes.set_xlim(0, 1.45 * max(max(m.buggy, m.correct) for m in rows))
        axes.set_xlabel(unit, fontsize=FONT_PT)
        axes.invert_yaxis()
    panels["bytes"].set_yticks(range(len(byte_rows)), [f"{m.pitfall}\n{m.metric}" for m in byte_rows], fontsize=FONT_PT)
    panels["counts"].set_yticks([])  # one row: named in the title
    # Wrapped to the narrow right panel: an unwrapped title runs past the figure's right edge and is cut off.
    panels["counts"].set_title(
        "\n".join(textwrap.fill(f"{m.pitfall}: {m.metric}", COUNTS_TITLE_CHARS) for m in count_rows), fontsize=FONT_PT
    )
    for axes in panels.values():
        axes.tick_params(labelsize=FONT_PT)
    figure.suptitle("Gradient-accumulation pitfalls: the buggy twin against the correct one", fontsize=TITLE_PT)
    figure.savefig(png_path, dpi=DPI)  # 72 dots per inch: a point is a pixel
    # The figure has a handful of flat colours: a 64-colour palette keeps them all and the file small.
    from PIL import Image  # matplotlib's own dependency

    Image.open(png_path).convert("RGB").quantize(colors=64).save(png_path, optimize=True)
    return figure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print the measurements as a JSON list instead of the table"
    )
    parser.add_argument("--png", default="pitfalls.png", help="where to write the figure (default: %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one intra-op thread: the spawned ranks use the same two cores
    measurements = run_gallery()
    if args.json:
        print(json.dumps([m.as_json() for m in measurements], indent=1))
    else:
        print(table(measurements))
    draw(measurements, args.png)
    return 0 if all(verdict(m) == "ok" for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
