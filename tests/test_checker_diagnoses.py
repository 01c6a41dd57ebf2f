"""The checker names the cause it finds, not the accumulation: a pipeline stage that computes another function
than the model's forward, an extra of a new objective that its raw examples do not state, and the self-test's
loss bugs at a GRPO step (whose loss reads extras). A failing promise explains the gradient line that follows it."""

import torch
import torch.nn as nn

from accumulation.config.registry import register_model
from accumulation.models.gpt import build_gpt
from tests.test_check_equivalence import checker_line, run_checker


class StageWithoutCausalMask(nn.Module):
    """A fork's pipeline stage that runs its blocks without the causal mask's direction: on the reversed sequence,
    so each position attends to the positions after it. Every position-wise layer gives the same as before."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x.flip(1)).flip(1)


def build_gpt_whose_last_stage_drops_the_mask(model_config, vocab_size: int, *, seq_len: int, seed: int):
    model = build_gpt(model_config, vocab_size, seq_len=seq_len, seed=seed)
    split = model.pipeline_split

    def pipeline_split(num_stages: int) -> list[nn.Module]:
        *first, last = split(num_stages)
        return [*first, StageWithoutCausalMask(last)]

    model.pipeline_split = pipeline_split
    return model


register_model("gpt-stage-without-mask", build_gpt_whose_last_stage_drops_the_mask)
STAGE_WITHOUT_MASK = "model.name=tests.test_checker_diagnoses:gpt-stage-without-mask"


def test_a_stage_that_computes_another_function_is_named_not_the_accumulation(tmp_path, capsys):
    """The loop trains the stages, the reference and the A = 1, D = 1 baseline the model's forward: the gradient
    line blamed 'accumulation, not rounding'."""
    arguments = [STAGE_WITHOUT_MASK, "model.n_layer=2", "dist.pipeline_stages=2"]
    status, stdout = run_checker(tmp_path, arguments, 2, capsys)
    assert status == 1 and stdout.splitlines()[-1] == "FAIL", stdout
    stages = checker_line(stdout, "pipeline stages compute the forward")
    assert stages.startswith(
        "FAIL: the 2 pipeline stages of the model's pipeline_split, run one after another, "
        "compute another function than its forward (relative"
    ), stdout
    gradient = checker_line(stdout, "gradient")
    assert "accumulation, not rounding" not in gradient
    assert "explained by 'pipeline stages compute the forward' above" in gradient, gradient
