"""The guide quotes numbers; each must be one that scripts/teaching/guide_numbers.py computes with the project's code,
and must stand in the sentence that uses it (a bare "3.0" could be satisfied by any other 3.0)."""

import subprocess
import sys
from pathlib import Path

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
    # The table of section 10: one row per A, the bf16 cell then the fp32 cell.
    "float.bf16_accumulation_error_A8": "| 8 | {} |",
    "float.fp32_accumulation_error_A8": " | {} |\n| 32 |",
    "float.bf16_accumulation_error_A32": "| 32 | {} |",
    "float.fp32_accumulation_error_A32": " | {} |\n| 512 |",
    "float.bf16_accumulation_error_A512": "| 512 | {} |",
    "float.fp32_accumulation_error_A512": " | {} |\n\nUp to A = 32",
    "clip.true_gradient_norm": "a true gradient of norm {}, clipped at 1",
    "clip.effective_threshold": "The effective threshold is\n{}, `max_norm / s`.",
    "clip.update_norm_when_clipped_scaled": "once unscaled, has norm {}, where the true gradient",
    "batchnorm.momentum_updates_per_step": "A = 4 micro-batches gives the layer {} momentum updates",
    "tail.drop_steps_per_epoch": "that is {} steps per epoch",
    "tail.drop_rows_left_out_per_epoch": "and {} rows\n  left out of each epoch",
    "tail.partial_steps_per_epoch": "short last step ({} steps per epoch here)",
    "dist.timeout_s_default": "`dist.timeout_s` (default\n{} seconds)",
}


def test_every_number_the_script_prints_stands_in_its_sentence_of_the_guide():
    printed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "teaching" / "guide_numbers.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    guide = (REPO / "docs" / "accumulation.md").read_text()
    values = dict(line.split(": ", 1) for line in printed.strip().splitlines())
    assert values.keys() == SENTENCES.keys()
    for name, value in values.items():
        assert SENTENCES[name].format(value) in guide, f"{name} = {value}: not in its sentence of the guide"


def test_readme_links_the_guide():
    assert "docs/accumulation.md" in (REPO / "README.md").read_text()
