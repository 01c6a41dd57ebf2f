"""scripts/benchmarks/bench_pipeline.py at a toy size, both of its launches (2 gloo ranks for the bubble, 4 for
the 2 x 2 mesh and DDP): the counts of what the pipeline sends between its stages and among a stage's replicas,
in bytes, asserted exactly; the bubble only as a fraction that exists (times depend on the machine and its
load, so its value is never asserted)."""

import pytest

from scripts.benchmarks.bench_pipeline import Sizes, measure, table, two_stage_model

# A benchmark's runs, 2 then 4 gloo ranks on 2 shared cores: 196 s here at a load average of about 15. The
# integration tier; the 2 x 2 mesh's one all-reduce per stage is also tests/test_pipeline.py's, by default.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOY = Sizes(width=32, blocks_per_stage=1, seq_len=8, micro_batch_size=2, accumulation_steps=(2, 4), repeats=1)


@pytest.fixture(scope="module")
def results() -> dict:
    return measure(TOY, timeout_s=240)


def test_stages_send_one_activation_forward_and_one_gradient_back_per_micro_batch(results):
    """Stage 0 sends each micro-batch's activation at the cut (m x seq_len x width fp32) and nothing back;
    stage 1 sends the gradient of that same tensor back and nothing forward."""
    activation_bytes = TOY.micro_batch_size * TOY.seq_len * TOY.width * 4
    assert TOY.activation_bytes == activation_bytes
    for figures in results["mesh_per_rank"]:
        sent_forward, sent_back = (activation_bytes, 0) if figures["stage"] == 0 else (0, activation_bytes)
        assert figures["p2p_forward_bytes_per_micro_batch"] == sent_forward, figures
        assert figures["p2p_backward_bytes_per_micro_batch"] == sent_back, figures


def test_each_stage_all_reduces_its_own_gradient_once_per_update_among_its_replicas(results):
    """DDP inside the pipeline stage: the A - 1 backward passes before the last stay local, the last one
    all-reduces the stage's gradient once over its 2 replicas; DDP of the whole model sends the whole gradient.
    So a pipeline rank sends its stage's share, and the stages together send what one DDP rank does."""
    stage_bytes = [sum(p.numel() * 4 for p in stage.parameters()) for stage in two_stage_model(TOY)]
    per_rank = results["mesh_per_rank"]
    assert sorted(r["stage"] for r in per_rank) == [0, 0, 1, 1]
    for figures in per_rank:
        assert figures["stage_grad_bytes"] == stage_bytes[figures["stage"]]
        assert figures["grad_bytes_per_update"] == stage_bytes[figures["stage"]], figures
        assert figures["ddp_grad_bytes_per_update"] == sum(stage_bytes), figures


def test_a_pipeline_rank_holds_less_than_a_ddp_rank(results):
    """Half the parameters and AdamW state, and one stage's activations, against the whole model's: the most any
    pipeline rank holds stays below what every DDP rank holds (the bytes of the tensors, from the profiler)."""
    per_rank = results["mesh_per_rank"]
    assert max(r["pipeline_peak_bytes"] for r in per_rank) < min(r["ddp_peak_bytes"] for r in per_rank)


def test_the_table_prints_each_count_as_a_ratio_to_its_target_and_a_bubble_per_run(results):
    assert set(results["bubble"]) == {"1F1B A=2", "1F1B A=4", "GPipe A=4"}
    assert all(0 <= fraction < 1 for fraction in results["bubble"].values())  # a fraction of the step, not a time
    ratios = {name: ratio for name, _, _, ratio in table(results)}
    assert {name for name in ratios if name.startswith("bubble")} == {f"bubble {run}" for run in results["bubble"]}
    for name in (
        "p2p_forward_bytes_per_micro_batch",
        "p2p_backward_bytes_per_micro_batch",
        "grad_bytes_per_update stage 0",
        "grad_bytes_per_update stage 1",
        "grad_bytes_per_update ddp",
    ):
        assert ratios[name] == "1.000", (name, ratios)
