"""scripts/benchmarks/sweep_microbatch.py: one row per micro-batch size, the same gradient for every m (and a visibly
different one when the loss weighting is wrong), a peak-memory measure that sees allocations, and a PNG."""

import json

import pytest
import torch
import torch.nn.functional as F

from accumulation.batching import IGNORE_INDEX
from accumulation.config.config import load_config
from accumulation.data.sources import build_data, step_row_ids
from accumulation.parallel.distributed import DistributedContext
from accumulation.run import build
from scripts.benchmarks import sweep_microbatch
from testkit.memory import peak_memory_bytes_of
from tests.test_check_equivalence import TINY_CONFIG, short_documents_corpus

SINGLE_CPU_PROCESS = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)


def swept_rows(tmp_path, micro_batch_sizes: list[int]) -> list[dict]:
    corpus_folder = short_documents_corpus(tmp_path / "corpus")
    config = load_config([*TINY_CONFIG, f"data.source={corpus_folder}"])
    corpus = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    row_ids = step_row_ids(corpus.train.num_rows, config.batch.global_batch_size, config.run.seed, 0, config.batch.tail)
    rows = sweep_microbatch.planned_rows(config.batch.global_batch_size, micro_batch_sizes, world_size=1)
    sweep_microbatch.sweep(config, corpus, corpus.vocab_size, row_ids, SINGLE_CPU_PROCESS, rows)
    return rows


def test_one_row_per_micro_batch_size_and_the_same_gradient_for_every_m(tmp_path):
    rows = swept_rows(tmp_path, [1, 2, 3, 4, 8])
    assert [row["micro_batch_size"] for row in rows] == [1, 2, 3, 4, 8]
    assert [row["accumulation_steps"] for row in rows] == [8, 4, None, 2, 1]
    assert "micro batch 3 does not divide" in rows[2]["skipped"]
    measured = [row for row in rows if row["skipped"] is None]
    assert all(row["grad_max_relative_difference"] <= sweep_microbatch.RELATIVE_TOLERANCE["fp32"] for row in measured)
    assert sweep_microbatch.gradients_agree(rows, sweep_microbatch.RELATIVE_TOLERANCE["fp32"])
    assert len({row["tokens"] for row in measured}) == 1  # the same examples for every m
    # Activations grow with m while the model stays the same.
    assert measured[-1]["peak_mem_bytes"] > 2 * measured[0]["peak_mem_bytes"]
    table = sweep_microbatch.format_table(rows).splitlines()
    assert [int(line.split()[0]) for line in table[1:]] == [1, 2, 3, 4, 8]


def test_a_wrong_weighting_makes_the_gradient_depend_on_m(tmp_path, monkeypatch):
    """Backpropagating each micro-batch's token MEAN (the classic mistake) weights micro-batches, not
    tokens; on rows of different lengths the sweep must see m change the gradient."""

    def micro_batch_mean(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="mean")

    monkeypatch.setattr(  # in the assembly the sweep shares with train.py
        build,
        "training_forward_and_loss",
        lambda model_config, model, compile=False, loss_sum_fn=None: (model, micro_batch_mean),
    )
    rows = swept_rows(tmp_path, [1, 8])
    assert rows[1]["grad_max_relative_difference"] > 1e-2
    assert not sweep_microbatch.gradients_agree(rows, sweep_microbatch.RELATIVE_TOLERANCE["fp32"])


def test_peak_memory_of_a_known_allocation():
    def allocate_and_free():
        block = torch.ones(1_000_000, dtype=torch.float32)  # 4 MB, freed on return
        return float(block.sum())

    result, peak_bytes = peak_memory_bytes_of(allocate_and_free, torch.device("cpu"))
    assert result == 1_000_000.0
    assert 4_000_000 <= peak_bytes < 4_100_000


def test_the_command_prints_json_rows_and_writes_the_png(tmp_path, capsys):
    corpus_folder = short_documents_corpus(tmp_path / "corpus")
    png = tmp_path / "sweep.png"
    status = sweep_microbatch.main(
        [*TINY_CONFIG, f"data.source={corpus_folder}", "--micro", "1,2,16", "--json", "--png", str(png)]
    )
    assert status == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["micro_batch_size"] for row in rows] == [1, 2, 16]
    assert rows[2]["skipped"] and rows[0]["skipped"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("micro", ["0", "2,x", ""])
def test_a_malformed_micro_list_is_a_usage_error(micro):
    with pytest.raises(SystemExit) as exit_request:
        sweep_microbatch.main([*TINY_CONFIG, "--micro", micro])
    assert exit_request.value.code == 2


def test_micro_batch_sizes_that_all_fail_to_divide_exit_2_with_one_line(capsys):
    assert sweep_microbatch.main([*TINY_CONFIG, "--micro", "3,5"]) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and "--micro" in error and "[1, 2, 4, 8]" in error


def test_a_micro_batch_size_that_does_not_fit_is_marked_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """Above 2 rows per forward the (injected) allocator runs out of memory: m = 4 and 8 are marked, the
    sweep still measures m = 1 and 2 after and between them, and their gradients still agree."""
    build_model = build.build_model  # the assembly's, which the sweep runs as train.py does

    class RaisesAboveTwoRows(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, inputs):
            if inputs.shape[0] > 2:
                raise torch.OutOfMemoryError("injected: more than 2 rows")
            return self.model(inputs)

    monkeypatch.setattr(build, "build_model", lambda *a, **k: RaisesAboveTwoRows(build_model(*a, **k)))
    rows = swept_rows(tmp_path, [4, 1, 8, 2])
    assert [row["skipped"] for row in rows] == [
        sweep_microbatch.OUT_OF_MEMORY,
        None,
        sweep_microbatch.OUT_OF_MEMORY,
        None,
    ]
    assert sweep_microbatch.gradients_agree(rows, sweep_microbatch.RELATIVE_TOLERANCE["fp32"])
    table = sweep_microbatch.format_table(rows)
    assert table.count("does not fit: out of memory") == 2


def test_a_png_into_a_missing_or_read_only_folder_is_refused_before_the_sweep(tmp_path, capsys):
    """The sweep used to run in full and then die in savefig with a traceback, its table never printed. The
    folder is checked first; a figure that still cannot be written (here: its path is a folder) costs only
    the figure, after the table."""
    corpus_folder = short_documents_corpus(tmp_path / "corpus")
    common = [*TINY_CONFIG, f"data.source={corpus_folder}", "--micro", "1,2"]
    assert sweep_microbatch.main([*common, "--png", str(tmp_path / "missing" / "sweep.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "does not exist; create it" in captured.err

    (tmp_path / "a-folder.png").mkdir()
    assert sweep_microbatch.main([*common, "--png", str(tmp_path / "a-folder.png")]) == 1
    captured = capsys.readouterr()
    assert "gradients across m: agree" in captured.out and "figure:" not in captured.out
    assert captured.err.count("\n") == 1 and "the figure could not be written" in captured.err, captured.err
