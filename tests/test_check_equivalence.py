"""scripts/checks/check_equivalence.py (its logic: accumulation/checker/): PASS on the loop (one process, and
two gloo ranks: forked from the forkserver, and under torchrun in the integration tier) on a corpus whose rows
hold very different token counts; FAIL on a wrong normalization; exit status 2 on a bad config."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accumulation import checker
from accumulation.checker import run as checker_run
from accumulation.run import build
from accumulation.step import token_cross_entropy_sum
from testkit.ranks import run_main_on_ranks
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
    status, stdout, _ = run_checker_with_stderr(tmp_path, arguments, ranks, capsys)
    return status, stdout


def on_forked_ranks(arguments: list[str], ranks: int) -> tuple[int, str, str]:
    """The checker's main on `ranks` gloo ranks forked with torchrun's environment (testkit/ranks.py): (the
    exit status, which every rank must share, rank 0's stdout, every rank's stderr)."""
    per_rank = run_main_on_ranks("accumulation.checker:main", arguments, world_size=ranks)
    status = per_rank[0][0]
    assert status in (0, 1) and all(s == status for s, _, _ in per_rank), per_rank  # a crash, or ranks apart
    return status, per_rank[0][1], "".join(err for _, _, err in per_rank)


def run_checker_with_stderr(
    tmp_path: Path, arguments: list[str], ranks: int, capsys, launched: bool = False
) -> tuple[int, str, str]:
    """More than one rank: forked ranks, or with `launched` the script under torchrun, as a user runs it."""
    corpus = short_documents_corpus(tmp_path / "corpus")
    arguments = [*TINY_CONFIG, f"data.source={corpus}", *arguments]
    if ranks == 1:
        status = checker.main(arguments)
        captured = capsys.readouterr()
        return status, captured.out, captured.err
    if not launched:
        return on_forked_ranks(arguments, ranks)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    completed = subprocess.run(
        launcher + [str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120, env=environment, cwd=tmp_path
    )
    assert completed.returncode in (0, 1), completed.stdout + completed.stderr  # anything else is a crash
    return completed.returncode, completed.stdout, completed.stderr


def reported_relative_error(stdout: str) -> float:
    return float(re.search(r"max relative error ([0-9.e+-]+)", stdout).group(1))


def checker_line(stdout: str, name: str) -> str:
    """What follows '<name>: ' on the checker's line for one check: its figures, then 'ok' or 'FAIL: why'."""
    return re.search(rf"^{re.escape(name)}: (.*)$", stdout, re.MULTILINE).group(1)


# Every line the checker prints for one check, in order; a check that fails alone leaves every other one "ok".
CHECK_LINES = [
    "rows",
    "examples() vs the raw examples",
    "supervised_counts vs the raw examples' targets",
    "supervised_counts vs the labels of examples()",
    "forward deterministic",
    "rows independent",
    "loss_sum_fn is a sum",
    "loss pairs label j with output j",
    "loss leaves the positions labelled -100 out",
    "examples",
    "supervised targets",
    "loss",
    "gradient norm",
    "gradient",
]


def failing_lines(stdout: str) -> list[str]:
    """The checks whose line says FAIL (each must say ok, n/a and why, or FAIL)."""
    verdicts = {name: checker_line(stdout, name) for name in CHECK_LINES}
    assert all(v.endswith(": ok") or v == "ok" or "FAIL: " in v or "n/a: " in v for v in verdicts.values()), stdout
    return [name for name, verdict in verdicts.items() if "FAIL: " in verdict]


# Two ranks forked (the default tier) and under torchrun (the integration tier).
RANKS_AND_LAUNCH = [(1, False), (2, False), pytest.param(2, True, marks=pytest.mark.integration)]


@pytest.mark.parametrize("ranks, launched", RANKS_AND_LAUNCH)
def test_the_loop_passes(tmp_path, capsys, ranks, launched):
    status, stdout, _ = run_checker_with_stderr(tmp_path, [], ranks, capsys, launched)
    assert status == 0, stdout
    assert f"x ranks {ranks};" in stdout
    assert stdout.splitlines()[-1] == "PASS"
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]
    assert failing_lines(stdout) == []
    assert "loss path: the loop ran model.loss = auto as plain: the model's outputs into" in stdout
    assert re.search(r"gradient: max relative error \S+ \(A = 1, D = 1 in fp32: [0-9.e+-]+;", stdout), stdout


@pytest.mark.parametrize("ranks, launched", RANKS_AND_LAUNCH)
def test_an_injected_mean_of_means_fails(tmp_path, capsys, ranks, launched):
    arguments = ["--inject-bug", "mean-of-means"]
    status, stdout, stderr = run_checker_with_stderr(tmp_path, arguments, ranks, capsys, launched)
    assert status == 1, stdout
    assert stdout.splitlines()[-1] == "FAIL"
    # It fails on the gradient itself (this bug leaves the counts and the fork's promises alone), and by far;
    # the A = 1, D = 1 step beside it is within the tolerance, so the line blames the accumulation.
    assert reported_relative_error(stdout) > 100 * checker.RELATIVE_TOLERANCE["fp32"]
    assert failing_lines(stdout) == ["loss", "gradient norm", "gradient"]
    assert checker_line(stdout, "gradient").endswith("accumulation, not rounding")
    if launched:
        # torchrun's failure summary shows the first failing check instead of advice on enabling tracebacks.
        # Every rank returns status 1 at once, but whether torchrun still sees the second rank running (and stops
        # it with SIGTERM) depends on which of them its monitor polls first: on a loaded machine it sometimes
        # does, so only rank 0's line is certain.
        assert "exitcode  : 1 " in stderr, stderr
        assert "traceback : check_equivalence FAIL: loss: the logged loss is off" in stderr, stderr


IMAGE_CLASSIFIER_CONFIG = str(REPO / "configs" / "image_classifier.toml")


def test_a_mean_of_means_on_micro_batches_of_equal_target_counts_is_refused_not_passed(tmp_path, capsys):
    """One label per row (the image classifier fork: labels (rows,)), or one micro-batch (A·D = 1): every
    micro-batch holds the same number of targets, the mean of means is the global mean, and the self-test would
    PASS with the bug in. It says n/a instead, exit 2 (neither PASS nor FAIL), one line, nothing on stdout."""
    status = checker.main(["--config", IMAGE_CLASSIFIER_CONFIG, "--inject-bug", "mean-of-means"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "", captured.out
    assert len(captured.err.splitlines()) == 1
    assert "n/a: every micro-batch holds the same number of targets" in captured.err
    assert "the mean of means equals the global mean on these rows" in captured.err
    corpus = short_documents_corpus(tmp_path / "corpus")
    one_micro_batch = [*TINY_CONFIG, f"data.source={corpus}", "batch.micro_batch_size=8"]
    assert checker.main([*one_micro_batch, "--inject-bug", "mean-of-means"]) == 2
    assert "(221 in each of 1)" in capsys.readouterr().err


def test_the_chunked_loss_passes_and_a_mean_of_means_through_it_fails(tmp_path, capsys):
    """The checker runs the step as train.py would with model.loss = "chunked" (hidden states, chunked loss)."""
    (tmp_path / "pass").mkdir()
    (tmp_path / "fail").mkdir()
    status, stdout = run_checker(tmp_path / "pass", ["model.loss=chunked"], 1, capsys)
    assert status == 0 and reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"], stdout
    assert "loss path: the loop ran model.loss = chunked as chunked: the final hidden states" in stdout
    status, stdout = run_checker(tmp_path / "fail", ["model.loss=chunked", "--inject-bug", "mean-of-means"], 1, capsys)
    assert status == 1 and reported_relative_error(stdout) > 100 * checker.RELATIVE_TOLERANCE["fp32"]
    assert failing_lines(stdout) == ["loss", "gradient norm", "gradient"]


def test_under_model_loss_auto_the_checker_checks_the_loss_train_py_chooses(tmp_path, capsys, monkeypatch):
    """model.loss = "auto" (the default) is decided by decided_model_config, the decision train.py takes too: plain
    on the CPU. Where it decides chunked (a GPU whose free memory is short), the checker must check that loss, not
    the plain one: here the decision is made to say chunked."""
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 0 and "loss path: the loop ran model.loss = auto as plain: the model's outputs" in stdout
    decide = build.decided_model_config  # build_training's decision, which train.py takes too
    chunked = lambda *arguments: dataclasses.replace(decide(*arguments), loss="chunked")  # noqa: E731
    monkeypatch.setattr(build, "decided_model_config", chunked)
    (tmp_path / "chunked").mkdir()
    status, stdout = run_checker(tmp_path / "chunked", [], 1, capsys)
    assert status == 0 and reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"], stdout
    assert "loss path: the loop ran model.loss = auto as chunked: the final hidden states" in stdout


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
    status, stdout, _ = on_forked_ranks([*SMALL_SFT, *arguments], ranks)
    return status, stdout


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


class OutputsThrough(torch.nn.Module):
    """A fork's model as a test builds it: the configured model, its outputs passed through `last` (no
    parameters of its own, so the weights and their order stay the model's)."""

    def __init__(self, model: torch.nn.Module, last):
        super().__init__()
        self.model, self.last = model, last

    def forward(self, inputs):
        return self.last(self.model(inputs))


def build_model_with_outputs_through(monkeypatch, last) -> None:
    real_build_model = checker_run.build_model

    def build_model(model_config, vocab_size, *, seq_len, seed):
        return OutputsThrough(real_build_model(model_config, vocab_size, seq_len=seq_len, seed=seed), last())

    monkeypatch.setattr(checker_run, "build_model", build_model)


def test_dropout_that_model_dropout_does_not_reach_is_switched_off_and_named(tmp_path, capsys, monkeypatch):
    """A fork's own Dropout module, which model.dropout = 0 does not reach (a Hugging Face config's resid_pdrop
    is one): the checker sets its p to 0 after the build, says so, and PASSes."""
    build_model_with_outputs_through(monkeypatch, lambda: torch.nn.Dropout(0.3))
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "dropout off: 1 Dropout module (p 0.3 -> 0)" in stdout
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


class Noise(torch.nn.Module):
    """Randomness in the forward that is no Dropout module: outputs scaled by a fresh 1 + U(0, 0.3) each call."""

    def forward(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * (1 + 0.3 * torch.rand_like(outputs))


def test_randomness_that_is_no_dropout_fails_as_not_deterministic(tmp_path, capsys, monkeypatch):
    """The loop, the reference and the A = 1, D = 1 baseline each draw other noise, so the baseline lands far
    from float64: the floor must not widen the allowed error past the cap, the gradient line must
    fail, and the row line must name the randomness, not an operation across rows."""
    build_model_with_outputs_through(monkeypatch, Noise)
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert checker_line(stdout, "forward deterministic").startswith(
        "FAIL: this model is not deterministic between two identical forwards"
    )
    assert "gradient" in failing_lines(stdout)
    allowed = float(re.search(r"allowed ([0-9.e+-]+),", checker_line(stdout, "gradient")).group(1))
    assert allowed <= checker_run.ROUNDING_FLOOR_CAP
    rows_line = checker_line(stdout, "rows independent")
    assert "randomness in the forward" in rows_line and "GroupNorm" not in rows_line


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
    status, stdout, _ = on_forked_ranks([*small, *arguments], ranks)
    return status, stdout


def test_a_mean_loss_fails_even_with_one_micro_batch_on_one_rank(tmp_path, capsys):
    """A·D = 1: the loop and the reference divide the same mean by the same N, so the gradients agree; only
    the additivity test of loss_sum_fn sees that a mean is not a sum."""
    status, stdout = run_checker(tmp_path, ["batch.micro_batch_size=8", "--inject-bug", "mean-loss"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "x accum 1 x ranks 1" in stdout
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]  # hidden from the gradient
    assert failing_lines(stdout) == ["loss_sum_fn is a sum"]
    assert checker_line(stdout, "loss_sum_fn is a sum").endswith(
        "a mean over targets; return the SUM of the supervised targets' losses, never a mean"
    )


def test_supervised_counts_that_disagree_with_the_labels_fail(tmp_path, capsys):
    (tmp_path / "one_more").mkdir()
    (tmp_path / "right_total").mkdir()
    status, stdout = run_on_mlm(tmp_path / "one_more", ["--inject-bug", "count"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert checker_line(stdout, "supervised_counts vs the raw examples' targets").startswith("FAIL: row ")
    assert checker_line(stdout, "supervised_counts vs the labels of examples()").startswith("FAIL: rank 0, step 0")
    # The loop used N from supervised_counts, as train.py does: every gradient is scaled wrong. Clipped (optim.
    # grad_clip = 1 binds here) its direction is right, and its norm before clipping shows the factor.
    norm_line = checker_line(stdout, "gradient norm")
    assert (
        float(re.search(r"relative error ([0-9.e+-]+)", norm_line).group(1)) > 100 * checker.RELATIVE_TOLERANCE["fp32"]
    )
    assert norm_line.endswith("FAIL: the norm before clipping is off by more than 3.0e-05"), norm_line
    # Every row's count off by one, up and down in turn: the step's N is right, so the gradient is, and only
    # the two checks that compare the counts row by row see it (a comparison of the step's totals passes it).
    status, stdout = run_on_mlm(tmp_path / "right_total", ["--inject-bug", "count-rows"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failing_lines(stdout) == [
        "supervised_counts vs the raw examples' targets",
        "supervised_counts vs the labels of examples()",
    ]
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]


def test_labels_supervised_everywhere_fail(tmp_path, capsys):
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "supervise-all"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert checker_line(stdout, "examples() vs the raw examples").endswith(
        "the raw example has no target there: padding or a prompt left supervised? Give it -100"
    )
    assert checker_line(stdout, "supervised_counts vs the labels of examples()").startswith("FAIL: ")
    assert checker_line(stdout, "supervised_counts vs the raw examples' targets") == "ok"


def test_a_mask_that_differs_between_ranks_fails_on_2_ranks(tmp_path, capsys):
    status, stdout = run_on_mlm(tmp_path, ["--inject-bug", "rank-mask"], 2, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "other rows on another rank" in checker_line(stdout, "rows")


def test_the_rank_mask_self_test_needs_rows_that_change_with_the_step(tmp_path, capsys):
    corpus = short_documents_corpus(tmp_path / "corpus")
    assert checker.main([*TINY_CONFIG, f"data.source={corpus}", "--inject-bug", "rank-mask"]) == 2
    assert "needs rows that change with the step" in capsys.readouterr().err


def test_a_gradient_wrong_by_a_little_fails_on_its_own(tmp_path, capsys, monkeypatch):
    """The gradient handed to the optimizer scaled by 1 + 1e-3 after the step, everything else right: the
    gradient line alone fails, and with it the verdict (33 times the fp32 tolerance of 3e-5)."""
    real_probe = checker_run.first_update_probe

    def scaling_probe(model, fused=False):
        optimizer, handed = real_probe(model, fused)

        def scale(opt, args, kwargs):
            for gradient in handed[0]:
                gradient.mul_(1 + 1e-3)

        optimizer.register_step_post_hook(scale)
        return optimizer, handed

    monkeypatch.setattr(checker_run, "first_update_probe", scaling_probe)
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failing_lines(stdout) == ["gradient"]


def test_a_model_whose_rows_see_each_other_fails_naming_its_batch_norm(tmp_path, capsys):
    status, stdout = run_checker(tmp_path, ["--inject-bug", "batch-norm"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "rows independent" in failing_lines(stdout) and "loss_sum_fn is a sum" not in failing_lines(stdout)
    assert "modules that mix rows: BatchNorm1d at 'batch_norm'" in checker_line(stdout, "rows independent")


def test_a_loss_with_in_batch_negatives_fails_as_a_coupling_not_a_mean(tmp_path, capsys):
    status, stdout = run_checker(tmp_path, ["--inject-bug", "in-batch-negatives"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert "loss_sum_fn is a sum" in failing_lines(stdout) and "rows independent" not in failing_lines(stdout)
    line = checker_line(stdout, "loss_sum_fn is a sum")
    assert "the loss couples examples, e.g. in-batch negatives" in line and "GradCache" in line
    assert "never a mean" not in line


def test_a_loss_that_shifts_the_labels_again_fails_on_its_own(tmp_path, capsys):
    """HF's loss_function on labels that arrive shifted: loop and reference score the same wrong targets, so the
    gradient agrees (as it did, unseen, before this check); only the probe of which output a label reads sees it."""
    status, stdout = run_checker(tmp_path, ["--inject-bug", "double-shift"], 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    assert failing_lines(stdout) == ["loss pairs label j with output j"]
    line = checker_line(stdout, "loss pairs label j with output j")
    assert re.match(r"FAIL: the loss of label (\d+) \(row \d+ of the step\) reads output \d+, not \1", line), line
    assert "shifted twice?" in line


def test_a_float32_loss_on_float64_outputs_is_a_precision_note(tmp_path, capsys, monkeypatch):
    """A loss that computes in float32 whatever it is given (HF's do): its sums over the halves agree to float32
    rounding only (about 6e-8 here), which is no mean; the checker PASSes it and says so in a note."""

    def float32_loss_sum_fn_for(model_config):
        return lambda outputs, labels: token_cross_entropy_sum(outputs.float(), labels)

    monkeypatch.setattr(checker_run, "loss_sum_fn_for", float32_loss_sum_fn_for)
    status, stdout = run_checker(tmp_path, [], 1, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "note: loss_sum_fn returns torch.float32 for torch.float64 outputs" in stdout
