"""A weight held by two pipeline stages (GPT-2's token embedding tied to its output head, a module two stages
share) is refused before anything is written, with one line naming the
weight and the stages: each stage would train its own copy with half the gradient. train.py and the checker
refuse it through the same check (accumulation/parallel/pipeline.py, split_into_stages); untied weights pass."""

import pytest
import torch
from torch import nn

import train
from accumulation import checker
from accumulation.config.config import ConfigError, load_config
from accumulation.models.factory import build_model
from accumulation.parallel.pipeline import check_model_splits, split_into_stages, weights_in_several_stages
from testkit.ranks import pretend_launched
from tests.test_check_equivalence import TINY_CONFIG, short_documents_corpus
from tests.test_train import tiny_settings, uneven_corpus

TIED = "model.name=tests.tied_gpt:tied-gpt"
UNTIED = "model.name=gpt"  # the same GPT, its head a weight of its own
TIED_LINE = "token_embedding.weight = lm_head.weight in stages 0 and 1"


def model_on_meta(*settings: str) -> tuple[nn.Module, object]:
    config = load_config([*settings, "model.n_layer=2", "dist.pipeline_stages=2"])
    with torch.device("meta"):  # as train.py and the checker build it for the check: shapes only
        return build_model(config.model, 256, seq_len=16, seed=0), config


def test_a_tied_embedding_and_head_are_refused_and_their_untied_twin_passes():
    tied, config = model_on_meta(TIED)
    with pytest.raises(ConfigError) as refusal:
        check_model_splits(tied, config)
    message = str(refusal.value)
    assert message.startswith("dist.pipeline_stages: ") and TIED_LINE in message
    assert "untie" in message and "dist.pipeline_stages=1" in message
    untied, config = model_on_meta(UNTIED)
    assert weights_in_several_stages(untied, split_into_stages(untied, 2)) == []
    check_model_splits(untied, config)  # no error


class SharedModule(nn.Module):
    """One Linear in both stages, as a fork that reuses a block at both ends would split it."""

    def __init__(self):
        super().__init__()
        self.shared, self.middle = nn.Linear(4, 4), nn.Linear(4, 4)

    def pipeline_split(self, num_stages: int) -> list[nn.Module]:
        return [nn.Sequential(self.shared, self.middle), nn.Sequential(self.shared)]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_module_shared_by_two_stages_is_found(device):
    with torch.device(device):
        shared = SharedModule()
    assert weights_in_several_stages(shared, shared.pipeline_split(2)) == [
        (["shared.weight"], [0, 1]),
        (["shared.bias"], [0, 1]),
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_train_refuses_a_tied_weight_across_stages_in_one_line_exit_2_nothing_written(
    tmp_path, capsys, monkeypatch, rank
):
    pretend_launched(monkeypatch, world_size=2, rank=rank)  # every rank refuses by itself, before any process group
    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"model.name": TIED.partition("=")[2], "model.n_layer": 2, "dist.pipeline_stages": 2}
    assert train.main(tiny_settings(tmp_path, corpus, **settings)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dist.pipeline_stages: ") and TIED_LINE in lines[0], lines
    assert not (tmp_path / "runs").exists()
    assert not torch.distributed.is_initialized()


def test_the_checker_refuses_a_tied_weight_across_stages_in_one_line_exit_2(tmp_path, capsys, monkeypatch):
    pretend_launched(monkeypatch, world_size=2)
    corpus = short_documents_corpus(tmp_path / "corpus")
    arguments = [*TINY_CONFIG, f"data.source={corpus}", TIED, "model.n_layer=2", "dist.pipeline_stages=2"]
    assert checker.main(arguments) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dist.pipeline_stages: ") and TIED_LINE in lines[0], lines
    assert captured.out == ""
    assert not torch.distributed.is_initialized()
