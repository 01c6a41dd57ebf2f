"""The checker runs the step train.py runs, clipping included: with optim.grad_clip small enough to bind, the loop's
clipped gradient matches the float64 reference clipped by its own norm, on one process and with FSDP2's norm
shares on 2 gloo ranks; a clip done wrong (each tensor by its own norm, or each rank by its own shard's norm)
fails the gradient line."""

import torch
from torch.distributed.tensor import DTensor

from accumulation import checker
from testkit.ranks import run_main_on_ranks
from tests.test_check_equivalence import (
    TINY_CONFIG,
    checker_line,
    failing_lines,
    on_forked_ranks,
    reported_relative_error,
    run_checker,
    short_documents_corpus,
)

# The tiny model's gradient norm at its initial weights is about 1.7 (measured: 1.68 on step 0's rows), so a clip
# of 0.05 scales the update by about 0.03: the clip binds, and a wrong clip factor moves every entry.
BINDING_CLIP = ["optim.grad_clip=0.05"]
FSDP2 = ["dist.strategy=fsdp2"]
real_clip = torch.nn.utils.clip_grads_with_norm_


def clip_each_tensor_by_its_own_norm(parameters, max_norm, total_norm, foreach=None):
    """A planted bug: each gradient tensor clipped by its own norm instead of the whole gradient's."""
    for parameter in parameters:
        real_clip([parameter], max_norm, torch.linalg.vector_norm(parameter.grad), foreach)


def clip_by_this_ranks_norm(parameters, max_norm, total_norm, foreach=None):
    """A planted bug: the clip factor from this rank's own gradient (its FSDP2 shards), before any reduction over
    the ranks, instead of the whole gradient's norm the boundary's all-reduce assembled."""
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    real_clip(parameters, max_norm, torch.nn.utils.get_total_norm(local), foreach)


def checker_clipping_by_this_ranks_norm(argv: list[str]) -> int:
    """The checker's main on a forked rank whose step clips by the rank's own norm (this rank's module only)."""
    torch.nn.utils.clip_grads_with_norm_ = clip_by_this_ranks_norm
    return checker.main(argv)


def test_the_checker_passes_a_step_whose_clip_binds_and_fails_a_clip_by_each_tensor(tmp_path, capsys, monkeypatch):
    status, stdout = run_checker(tmp_path, BINDING_CLIP, 1, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "gradient clipping at optim.grad_clip = 0.05" in stdout
    clipping = next(line for line in stdout.splitlines() if line.startswith("gradient clipping: "))
    assert "binds: the reference scaled by" in clipping, clipping
    assert reported_relative_error(stdout) < checker.RELATIVE_TOLERANCE["fp32"]

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", clip_each_tensor_by_its_own_norm)
    (tmp_path / "bug").mkdir()
    status, stdout = run_checker(tmp_path / "bug", BINDING_CLIP, 1, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    # The norm before clipping is right: only the clipped gradient shows the wrong factors.
    assert failing_lines(stdout) == ["gradient"], stdout
    assert checker_line(stdout, "gradient norm").endswith(": ok")


def test_fsdp2_norm_shares_feed_the_clip_on_two_ranks_and_a_clip_by_one_rank_s_norm_fails(tmp_path):
    corpus = short_documents_corpus(tmp_path / "corpus")
    arguments = [*TINY_CONFIG, f"data.source={corpus}", *FSDP2, *BINDING_CLIP]
    status, stdout, stderr = on_forked_ranks(arguments, 2)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout + stderr
    clipping = next(line for line in stdout.splitlines() if line.startswith("gradient clipping: "))
    assert "binds" in clipping, clipping

    per_rank = run_main_on_ranks("tests.test_checker_configured_step:checker_clipping_by_this_ranks_norm", arguments)
    status, stdout = per_rank[0][0], per_rank[0][1]
    assert status == 1 and all(s == 1 for s, _, _ in per_rank), per_rank
    assert stdout.splitlines()[-1] == "FAIL" and "gradient" in failing_lines(stdout), stdout


def test_the_checker_runs_the_fused_update_and_the_out_of_memory_retry_as_configured(tmp_path, capsys, monkeypatch):
    """A fused configured optimizer (AdamW fused, as build_optimizer makes it on CUDA; here on the CPU) makes the
    checker's recording optimizer fused too, so the step queues its update on the device; batch.on_oom = "shrink"
    runs the retry's strategy. Both PASS, and each ran."""
    from accumulation import update_on_device
    from accumulation.run import build
    from accumulation.shrink_on_oom import ShrinkOnOutOfMemory

    queued, shrinking = [], []
    real_queue, real_run = update_on_device.queue_update_unless_non_finite, ShrinkOnOutOfMemory.run_micro_batches

    def queue_and_count(*args):
        queued.append(1)
        return real_queue(*args)

    def run_and_count(self, *args):
        shrinking.append(1)
        return real_run(self, *args)

    fused_adamw = lambda optim, model, device: torch.optim.AdamW(model.parameters(), lr=optim.lr, fused=True)  # noqa: E731
    monkeypatch.setattr(build, "build_optimizer", fused_adamw)
    monkeypatch.setattr(update_on_device, "queue_update_unless_non_finite", queue_and_count)
    monkeypatch.setattr(ShrinkOnOutOfMemory, "run_micro_batches", run_and_count)
    status, stdout = run_checker(tmp_path, [*BINDING_CLIP, "batch.on_oom=shrink"], 1, capsys)
    assert status == 0 and stdout.splitlines()[-1] == "PASS", stdout
    assert "batch.on_oom = shrink, a fused optimizer, as configured" in stdout
    assert queued == [1] and shrinking == [1]
