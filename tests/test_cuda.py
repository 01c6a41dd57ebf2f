"""The CUDA paths. Tests marked `cuda` run the quick checks of scripts/checks/gpu_check.py where a GPU is and are
reported as skipped elsewhere (tests/conftest.py): on every documented install (the CPU machines this
project runs on) all 6 are skipped, so the checks whose property is not CUDA's own have CPU twins below. The
whole check is `python scripts/checks/gpu_check.py`."""

import pytest
import torch

from scripts.checks import gpu_check, gpu_perf
from testkit.syncs import synchronising_calls


def test_without_a_gpu_the_check_prints_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    output = capsys.readouterr()
    assert output.out.count("\n") == 1 and "no CUDA GPU" in output.out and output.err == ""


def test_the_sync_audit_counts_synchronising_calls_not_pytorchs_notice_about_the_mode():
    """What set_sync_debug_mode("warn") says on a GPU (PyTorch's words, torch 2.11): once the notice that the mode
    is a prototype, then a warning per synchronising call. Only the second kind is a sync."""
    notice = (
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations "
        "(Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:876.)"
    )
    sync = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:151.)"
    assert synchronising_calls([notice, sync]) == [sync]
    assert synchronising_calls([notice]) == []


def test_without_a_gpu_the_perf_table_is_one_line_and_exit_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--perf"]) == 0
    output = capsys.readouterr()
    assert output.out.count("\n") == 1 and "no CUDA GPU" in output.out and output.err == ""


def test_the_perf_command_measures_gpu_8x_at_the_issues_shape(tmp_path):
    command = gpu_perf.perf_command(tmp_path, [*gpu_perf.PERF_MODES["compiled-chunked"], "model.loss=plain"])
    assert command[1].endswith("scripts/benchmarks/bench.py") and command[command.index("--config") + 1].endswith(
        "gpu_8x.toml"
    )
    assert "--json" in command and command[command.index("--accumulation-steps") + 1] == "4"
    assert {"batch.micro_batch_size=16", "batch.global_batch_size=64", f"data.source={tmp_path}"} <= set(command)
    assert command[-3:] == ["model.compile=true", "model.loss=chunked", "model.loss=plain"]  # the user's win
    assert set(gpu_perf.PERF_MODES) == {"eager-plain", "eager-chunked", "compiled-plain", "compiled-chunked"}


@pytest.mark.integration  # runs scripts/benchmarks/bench.py in processes of its own
@pytest.mark.slow
def test_the_perf_table_keeps_the_rows_it_has_when_a_mode_times_out(monkeypatch, capsys):
    """--perf-toy-cpu: the script itself on the CPU at a toy size (the model of a few thousand weights, no GPU).
    The eager chunked mode gives its row; the compiled one, given 1 s, times out (compiling takes far longer):
    its line says so, the table and the total are still printed, and the exit status says a row is missing."""
    monkeypatch.setattr(gpu_perf, "PERF_TIMEOUT_S", {"eager": 600, "compiled": 1})
    status = gpu_check.main(["--perf-toy-cpu", "--perf-modes", "eager-chunked,compiled-chunked"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    [eager] = [line for line in lines if line.startswith("eager-chunked ")]
    [compiled] = [line for line in lines if line.startswith("compiled-chunked ")]
    seconds_ours, seconds_nanogpt, ratio = (float(value) for value in eager.split()[1:4])
    assert seconds_ours > 0 and seconds_nanogpt > 0 and ratio == pytest.approx(seconds_ours / seconds_nanogpt, 1e-2)
    assert "timed out after 1 s" in compiled
    assert lines[-1].startswith("total ")


@pytest.mark.compile
def test_the_perf_table_has_a_row_for_every_mode_on_the_cpu_at_a_toy_size(monkeypatch, capsys):
    """All four modes, compiled ones included (minutes of compiling on a busy 2-core CPU)."""
    monkeypatch.setattr(gpu_perf, "PERF_TIMEOUT_S", {"eager": 900, "compiled": 1800})
    status = gpu_check.main(["--perf-toy-cpu"])
    output = capsys.readouterr().out
    assert status == 0, output
    for mode in gpu_perf.PERF_MODES:
        [line] = [line for line in output.splitlines() if line.startswith(mode + " ")]
        assert float(line.split()[3]) > 0, line


@pytest.mark.parametrize(
    ("chunked", "vocab_size", "chunk_positions"), [(False, 256, 0), (True, 256, 0), (True, 1000, 96)]
)
def test_the_equivalence_checks_logic_passes_on_the_cpu_in_fp32(monkeypatch, chunked, vocab_size, chunk_positions):
    """The check's own code (the reference, the step, the chunked pair, several chunks per micro-batch as
    bf16_chunked_loss_50304 runs them) on the CPU; pinning needs CUDA, so it is left out here. On a GPU the same
    function runs bf16, fp16 and the chunked loss in bf16, the last also at V = 50,304."""
    monkeypatch.setattr(gpu_check, "pinned", lambda micro_batches: micro_batches)
    passed, figures = gpu_check.equivalence(
        "fp32", torch.device("cpu"), chunked=chunked, vocab_size=vocab_size, chunk_positions=chunk_positions
    )
    assert passed, figures


# CPU twins of the cuda-marked cases whose property is not CUDA's own: the same check functions on the CPU,
# which autocasts bf16 and fp16 and runs a GradScaler and fused AdamW there too. Not twinned: the sync audit
# (host-device synchronisation exists on a GPU only) and the real out-of-memory recovery (the CPU has no
# allocator that fails that way; step.py's shrink path is tested with an injected error in tests/test_oom.py).
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cpu_twin_one_autocast_step_equals_the_float64_reference(monkeypatch, dtype):
    monkeypatch.setattr(gpu_check, "pinned", lambda micro_batches: micro_batches)
    passed, figures = gpu_check.equivalence(dtype, torch.device("cpu"))
    assert passed, figures


def test_cpu_twin_an_fp16_overflow_with_fused_adamw_is_skipped_by_the_scaler(monkeypatch):
    monkeypatch.setattr(gpu_check, "pinned", lambda micro_batches: micro_batches)
    passed, figures = gpu_check.check_fp16_overflow(torch.device("cpu"))
    assert passed, figures


def test_an_unknown_check_is_a_usage_error(capsys):
    assert gpu_check.main(["--only", "sync_audit,warp_drive"]) == 2
    assert "unknown check warp_drive" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("check", ["bf16_equivalence", "fp16_equivalence", "fp32_equivalence"])
def test_one_step_on_cuda_equals_the_float64_reference(check):
    passed, figures = gpu_check.CHECKS[check](torch.device("cuda", 0))
    assert passed, figures


@pytest.mark.cuda
def test_a_bf16_step_on_cuda_synchronises_at_most_once():
    passed, figures = gpu_check.check_sync_audit(torch.device("cuda", 0))
    assert passed, figures


@pytest.mark.cuda
def test_an_fp16_overflow_with_fused_adamw_is_skipped_by_the_scaler():
    passed, figures = gpu_check.check_fp16_overflow(torch.device("cuda", 0))
    assert passed, figures


@pytest.mark.cuda
def test_a_real_out_of_memory_is_recovered_exactly():
    passed, figures = gpu_check.check_oom_recovery(torch.device("cuda", 0))
    assert passed, figures
