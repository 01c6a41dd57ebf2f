"""The guide quotes numbers; each must be one that scripts/teaching/guide_numbers.py computes with the project's code,
and must stand in the sentence that uses it (a bare "3.0" could be satisfied by any other 3.0)."""

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.teaching import guide_numbers

REPO = Path(__file__).resolve().parent.parent

# Each printed name, and the words of the guide its value completes.
SENTENCES = {
    "weighting.token_weighted": "(512 · 2 + 1536 · 4) / 2048 = {}",
    "weighting.mean_of_means": "(2 + 4) / 2 = {}",
    "batch.example": "    {}\n\nand nothing is ever rounded",
    "batch.model_parallel": "The right derivation is\n\n    {}",
    "batch.accum_on_8_gpus_wrongly_counted": "Counting all 8 GPUs as data ranks gives A = {},",
    "ddp.true_mean": "have a true mean\nof {};",
    "ddp.without_times_D": "letting DDP average gives {}, half",
    "ddp.with_times_D": "S · D / N gives {}.",
    "schedule.lr_factor_after_10_updates": "factor should be {} but",
    "schedule.lr_factor_if_stepped_per_micro_batch": "but is {}, and",
    "schedule.warmup_done_after_updates_when_wrong": "warm-up is over after {} updates",
    "float.fp32_reorder_relative_difference": "in fp32 differs by {} relative",
    # The ratios of the table of section 10 (its cells are checked row by row below).
    "float.bf16_over_fp32_A8": "a bf16 buffer is {} times\nworse at A = 8",
    "float.bf16_over_fp32_A32": "and {} times worse at A = 32 on one-sign terms",
    "float.bf16_over_fp32_mixed_A8": "on one-sign terms ({} and",
    "float.bf16_over_fp32_mixed_A32": "and {} times on mixed signs)",
    "float.bf16_over_fp32_A512": "{} times worse at A = 512",
    "float.bf16_over_fp32_mixed_A512": "at A = 512 ({} on mixed signs)",
    "float.fp32_mixed_accumulation_error_A512": "with mixed signs it stays at {}, the bf16 rounding",
    "clip.true_gradient_norm": "a true gradient of norm {}, clipped at 1",
    "clip.effective_threshold": "The effective threshold is\n{}, `max_norm / s`.",
    "clip.update_norm_when_clipped_scaled": "once unscaled, has norm {}, where the true gradient",
    "batchnorm.momentum_updates_per_step": "A = 4 micro-batches gives the layer {} momentum updates",
    "tail.drop_steps_per_epoch": "that is {} steps per epoch",
    "tail.drop_rows_left_out_per_epoch": "and {} rows\n  left out of each epoch",
    "tail.partial_steps_per_epoch": "short last step ({} steps per epoch here)",
    "dist.timeout_s_default": "`dist.timeout_s` (default\n{} seconds)",
}


@pytest.mark.parametrize("launched", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_every_number_the_script_prints_stands_in_its_sentence_of_the_guide(capsys, launched):
    """The script's main in this process, or (integration) the script run as a user runs it."""
    if launched:
        printed = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "teaching" / "guide_numbers.py")],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
    else:
        guide_numbers.main()
        printed = capsys.readouterr().out
    guide = (REPO / "docs" / "accumulation.md").read_text()
    values = dict(line.split(": ", 1) for line in printed.strip().splitlines())
    # Section 10's table: for each A, the one-sign then the mixed-sign errors of a bf16 and an fp32 buffer.
    table_cells = [
        f"float.{buffer}_{signs}accumulation_error_A{a}"
        for a in (8, 32, 512)
        for signs in ("", "mixed_")
        for buffer in ("bf16", "fp32")
    ]
    for a in (8, 32, 512):
        row = " | ".join(values[name] for name in table_cells if name.endswith(f"_A{a}"))
        assert f"| {a} | {row} |" in guide, f"section 10's row for A = {a} is not | {a} | {row} |"
    values = {name: value for name, value in values.items() if name not in table_cells or name in SENTENCES}
    assert values.keys() == SENTENCES.keys()
    for name, value in values.items():
        assert SENTENCES[name].format(value) in guide, f"{name} = {value}: not in its sentence of the guide"


def test_readme_links_the_guide():
    assert "docs/accumulation.md" in (REPO / "README.md").read_text()


# The gallery's rows that cite the issue thread or pull request where a project met the bug, read from the row's
# docstring or comment in the pitfall cases; the guide, teaching.md, README and tools.md state their number.
THREAD_CITED_ROWS = (1, 2, 6, 14, 16, 21, 23, 24, 25, 26, 27, 28, 29, 30, 31)


def test_the_count_of_thread_cited_gallery_rows_is_the_same_everywhere_and_matches_the_rows():
    import re

    sources = "".join(
        (REPO / "scripts" / "teaching" / f"pitfall_cases_{part}.py").read_text()
        for part in ("one_process", "two_ranks", "pipeline", "rl")
    )
    # Each row's text runs from its marker ('"""N. ' or '# N. ') to the next row's.
    pieces = re.split(r'(?:"""|# )(\d+)\. ', sources)
    cited = {int(number) for number, text in zip(pieces[1::2], pieces[2::2], strict=True) if "github.com" in text}
    # Row 15 cites TRL doing it right and row 20 nanoGPT's deliberate estimate: not threads where users met a bug.
    assert cited - {15, 20} == set(THREAD_CITED_ROWS)
    count = len(THREAD_CITED_ROWS)
    guide = (REPO / "docs" / "accumulation.md").read_text()
    assert f"{count} rows cite\n   the issue thread or pull request" in guide
    assert f"31 accumulation bugs, {count} of them citing" in (REPO / "docs" / "teaching.md").read_text()
    assert f"31 accumulation bugs ({count} citing" in (REPO / "README.md").read_text()
    assert f"31 accumulation bugs ({count} citing" in (REPO / "docs" / "tools.md").read_text()
