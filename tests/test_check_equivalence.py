"""scripts/checks/check_equivalence.py (its logic: accumulation/checker/): PASS on the loop (one process, and
two gloo ranks under torchrun) on a corpus whose rows hold very different token counts; FAIL on a wrong
normalization; exit status 2 on a bad config."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accumulation import checker
from accumulation.checker import run as checker_run
from tests.conformance.tokens import write_token_folder

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "checks" / "check_equivalence.py"

TINY_CONFIG = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "data.seq_len=32",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "data.val_fraction=0",
]


def short_documents_corpus(folder: Path) -> Path:
    """24 files of 3 to 150 bytes. With seq_len 32 more than half of the 48 rows are shorter than a full
    row (2 to 21 supervised tokens), so micro-batches and ranks differ in token count and a mean of
    micro-batch means differs from the token mean."""
    folder.mkdir()
    for index in range(24):
        length = [3, 9, 20, 33, 70, 150][index % 6]
        (folder / f"doc{index:02d}.txt").write_bytes(bytes(97 + (index * 7 + j) % 26 for j in range(length)))
    return folder


def run_checker(tmp_path: Path, arguments: list[str], ranks: int, capsys) -> tuple[int, str]:
    """(exit status, stdout). One rank runs in this process; more run under torchrun, as a user would."""
    corpus = short_documents_corpus(tmp_path / "corpus")
    arguments = [*TINY_CONFIG, f"data.source={corpus}", *arguments]
    if ranks == 1:
        status = checker.main(arguments)
        return status, capsys.readouterr().out
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    completed = subprocess.run(
        launcher + [str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120, env=environment, cwd=tmp_path
    )
    assert completed.returncode in (0, 1), completed.stdout + completed.stderr  # anything else is a crash
    return completed.returncode, completed.stdout


def reported_relative_error(stdout: str) -> float:
    return float(re.search(r"max relative error ([0-9.e+-]+)", stdout).group(1))


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_loop_passes(tmp_path, capsys, ranks):
    status, stdout = run_checker(tmp_path, [], ranks, capsys)
    assert status == 0, stdout
    assert f"x ranks {ranks};" in stdout
    assert stdout.splitlines()[-1] == "PASS"
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_injected_mean_of_means_fails(tmp_path, capsys, ranks):
    status, stdout = run_checker(tmp_path, ["--inject-bug", "mean-of-means"], ranks, capsys)
    assert status == 1, stdout
    assert stdout.splitlines()[-1] == "FAIL"
    # It fails on the gradient itself (this bug leaves the counts alone), and by far.
    assert reported_relative_error(stdout) > 100 * checker.RELATIVE_TOLERANCE["fp32"]


def test_the_chunked_loss_passes_and_a_mean_of_means_through_it_fails(tmp_path, capsys):
    """The checker runs the step as train.py would with model.loss = "chunked" (hidden states, chunked loss)."""
    (tmp_path / "pass").mkdir()
    (tmp_path / "fail").mkdir()
    status, stdout = run_checker(tmp_path / "pass", ["model.loss=chunked"], 1, capsys)
    assert status == 0 and reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"], stdout
    status, stdout = run_checker(tmp_path / "fail", ["model.loss=chunked", "--inject-bug", "mean-of-means"], 1, capsys)
    assert status == 1 and reported_relative_error(stdout) > 100 * checker.RELATIVE_TOLERANCE["fp32"]


@pytest.mark.parametrize(
    "arguments, named",
    [
        (["model.n_head=3"], "model.d_model"),
        (["batch.global_batch_size=8", "batch.micro_batch_size=3"], "batch.micro_batch_size"),
        (["optim.nonsense=1"], "optim.nonsense"),
        (["data.source=/nonexistent/corpus"], "/nonexistent/corpus"),
    ],
)
def test_a_bad_config_exits_2_with_one_line(capsys, arguments, named):
    assert checker.main(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and named in captured.err


SFT_CONFIG = str(REPO / "configs" / "sft.toml")
SMALL_SFT = ["--config", SFT_CONFIG, "model.n_layer=1", "model.d_model=32", "model.n_head=2"]


def run_on_sft(tmp_path: Path, arguments: list[str], ranks: int, capsys) -> tuple[int, str]:
    """The checker on the prompt/response data of configs/sft.toml (prompt never supervised)."""
    if ranks == 1:
        status = checker.main([*SMALL_SFT, *arguments])
        return status, capsys.readouterr().out
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    completed = subprocess.run(
        launcher + [str(SCRIPT), *SMALL_SFT, *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        cwd=REPO,
    )
    assert completed.returncode in (0, 1), completed.stdout + completed.stderr
    return completed.returncode, completed.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_prompt_masked_data_passes_and_an_injected_mask_bug_fails(tmp_path, capsys, ranks):
    status, stdout = run_on_sft(tmp_path, [], ranks, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    status, stdout = run_on_sft(tmp_path, ["--inject-bug", "mask"], ranks, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    # The loop then counts prompt targets too: more supervised targets than the reference.
    loop, reference = re.search(r"supervised targets: loop ([0-9,]+), reference ([0-9,]+)", stdout).groups()
    assert int(loop.replace(",", "")) > int(reference.replace(",", ""))


def test_the_mask_self_test_needs_prompts(tmp_path, capsys):
    corpus = short_documents_corpus(tmp_path / "corpus")
    assert checker.main([*TINY_CONFIG, f"data.source={corpus}", "--inject-bug", "mask"]) == 2
    assert "needs rows with prompt positions" in capsys.readouterr().err


def test_the_second_model_passes_and_is_named(tmp_path, capsys):
    status, stdout = run_checker(tmp_path, ["model.name=gru"], 1, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "model: GRULanguageModel (gru)" in stdout


def test_a_model_whose_weights_do_not_come_from_the_seed_fails(tmp_path, capsys, monkeypatch):
    """A fork's model that draws its initial weights from the global generator starts differently on each
    rank (dropout seeds it per rank) and in each build: the checker refuses it."""
    real_build_model = checker_run.build_model

    def unseeded_build_model(model_config, vocab_size, *, seq_len, seed):
        model = real_build_model(model_config, vocab_size, seq_len=seq_len, seed=seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.02)  # the global generator, which moves on between builds
        return model

    monkeypatch.setattr(checker_run, "build_model", unseeded_build_model)
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "initial weights" in stdout


# ---------------------------------------------------------------------------------------------------
# The fork's own promises: the masked-LM fork (configs/mlm.toml) with one bug each
# ---------------------------------------------------------------------------------------------------

MLM_CONFIG = str(REPO / "configs" / "mlm.toml")


def run_on_mlm(tmp_path: Path, arguments: list[str], ranks: int, capsys) -> tuple[int, str]:
    """The checker on configs/mlm.toml's masked-LM fork, cut down, on token files written here."""
    tokens = write_token_folder(tmp_path)
    small = ["--config", MLM_CONFIG, "model.n_layer=1", "model.d_model=32", "model.n_head=2", f"data.source={tokens}"]
    if ranks == 1:
        status = checker.main([*small, *arguments])
        return status, capsys.readouterr().out
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    completed = subprocess.run(
        launcher + [str(SCRIPT), *small, *arguments], capture_output=True, text=True, timeout=120, env=environment
    )
    assert completed.returncode in (0, 1), completed.stdout + completed.stderr
    return completed.returncode, completed.stdout


def failed_promise(stdout: str, name: str) -> str:
    """The checker's line for one of the fork's promises: 'ok' or 'FAIL: ...'."""
    return re.search(rf"^{re.escape(name)}: (.*)$", stdout, re.MULTILINE).group(1)


def test_a_mean_loss_fails_even_with_one_micro_batch_on_one_rank(tmp_path, capsys):
    """A·D = 1: the loop and the reference divide the same mean by the same N, so the gradients agree; only
    the additivity test of loss_sum_fn sees that a mean is not a sum."""
    status, stdout = run_checker(tmp_path, ["batch.micro_batch_size=8", "--inject-bug", "mean-loss"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "x accum 1 x ranks 1" in stdout
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]  # hidden from the gradient
    assert failed_promise(stdout, "loss_sum_fn is a sum").startswith("FAIL: ")


def test_supervised_counts_that_disagree_with_the_labels_fail(tmp_path, capsys):
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "count"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failed_promise(stdout, "supervised_counts vs the raw examples' targets").startswith("FAIL: row ")
    assert failed_promise(stdout, "supervised_counts vs the labels of examples()").startswith("FAIL: rank 0, step 0")
    # The loop used N from supervised_counts, as train.py does: every gradient is scaled wrong.
    assert reported_relative_error(stdout) > 100 * checker.RELATIVE_TOLERANCE["fp32"]


def test_labels_supervised_everywhere_fail(tmp_path, capsys):
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "supervise-all"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failed_promise(stdout, "supervised_counts vs the labels of examples()").startswith("FAIL: ")
    assert failed_promise(stdout, "supervised_counts vs the raw examples' targets") == "ok"


def test_a_mask_that_differs_between_ranks_fails_on_2_ranks(tmp_path, capsys):
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "rank-mask"], 2, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "other rows on another rank" in failed_promise(stdout, "rows")


def test_the_rank_mask_self_test_needs_rows_that_change_with_the_step(tmp_path, capsys):
    corpus = short_documents_corpus(tmp_path / "corpus")
    assert checker.main([*TINY_CONFIG, f"data.source={corpus}", "--inject-bug", "rank-mask"]) == 2
    assert "needs rows that change with the step" in capsys.readouterr().err
