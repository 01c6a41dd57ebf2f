"""The CUDA paths. Tests marked `cuda` run the quick checks of scripts/checks/gpu_check.py where a GPU is and are
reported as skipped elsewhere (tests/conftest.py); the whole check is `python scripts/checks/gpu_check.py`."""

import pytest
import torch

from scripts.checks import gpu_check


def test_without_a_gpu_the_check_prints_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    output = capsys.readouterr()
    assert output.out.count("\n") == 1 and "no CUDA GPU" in output.out and output.err == ""


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
