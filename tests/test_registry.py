"""The fork seam (accumulation/config/registry.py): a model, a loss and a data source registered in the fork's own
module and named by import path in the config, with their own settings checked, listed, stored and compared on resume,
and a fingerprint hook for state the keys do not show. No file of the project is edited for the fork below."""

import dataclasses
import sys
import textwrap

import pytest
import torch

import train
from accumulation.config.config import ConfigError, config_to_toml, load_config
from accumulation.config.help import help_text
from accumulation.models.factory import build_model, loss_sum_fn_for
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import build_training
from accumulation.run.checkpoint import seed_dropout

# A fork in one file: a GRU of a width its own setting multiplies, whose build seeds the global generator (as
# Hugging Face's set_seed does), a fingerprint over a file its other setting names, and a registered loss.
FORK_MODULE = """
import hashlib
import pathlib
from dataclasses import dataclass

import torch

from accumulation.config.config_keys import setting
from accumulation.models.gru import GRULanguageModel
from accumulation.config.registry import register_data, register_loss, register_model
from accumulation.step import token_cross_entropy_sum


@dataclass(frozen=True)
class WideGRUSettings:
    width_multiplier: int = setting(1, "hidden width = model.d_model x this", "factor", at_least=1)
    notes_file: str = setting("", "a file the fingerprint covers; empty = none")


def build(model_config, vocab_size, *, seq_len, seed):
    torch.manual_seed(0)  # what a careless build does: every rank's global generator set alike
    width = model_config.d_model * model_config.own.width_multiplier
    return GRULanguageModel(vocab_size, width, model_config.n_layer, model_config.dropout, seed=seed)


def notes_hash(model_config):
    path = model_config.own.notes_file
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16] if path else ""


def doubled_sum(outputs, labels):
    return 2 * token_cross_entropy_sum(outputs, labels)


register_model("wide-gru", build, settings=WideGRUSettings, fingerprint=notes_hash)
register_loss("doubled", doubled_sum)


def five_token_rows(data_config, *, model_vocab_size, seed):
    from accumulation.data.rows import make_rows
    from accumulation.data.custom import data_from_custom_rows
    from accumulation.data.splits import row_fingerprint

    rows = make_rows([bytes(range(40, 80))] * 4, seq_len=5)
    return data_from_custom_rows(data_config.source, rows, rows, fingerprint=row_fingerprint(rows), vocab_size=256)


register_data("five-token-rows", five_token_rows)
"""

NAME = "model.name=registry_fork:wide-gru"
TINY = ["model.d_model=8", "model.n_layer=1", "batch.global_batch_size=4", "batch.micro_batch_size=2"]


@pytest.fixture
def fork(tmp_path, monkeypatch):
    (tmp_path / "registry_fork.py").write_text(textwrap.dedent(FORK_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("registry_fork", None)


def test_a_forks_own_settings_are_keys_checked_listed_and_written(fork):
    config = load_config([NAME, "model.width_multiplier=3", *TINY])
    assert config.model.own.width_multiplier == 3 and config.model.own.notes_file == ""  # "" = none, its default
    assert build_model(config.model, 256, seq_len=16, seed=1).d_model == 24
    with pytest.raises(ConfigError, match=r"^model.width_multiplier: expected an integer >= 1, got 0$"):
        load_config([NAME, "model.width_multiplier=0"])
    with pytest.raises(ConfigError, match=r"^unknown key model.width_multiplier \(model has: name, "):
        load_config(["model.width_multiplier=3"])  # the GPT has no such key
    with pytest.raises(ConfigError, match=r"^model.name: registry_fork registers no model 'lstm'"):
        load_config(["model.name=registry_fork:lstm"])
    with pytest.raises(ConfigError, match=r"^model.name: cannot import no_such_fork"):
        load_config(["model.name=no_such_fork:x"])
    # The run directory's config.toml holds the own keys in [model], and reads back to an equal config.
    written = fork / "written.toml"
    written.write_text(config_to_toml(config))
    assert 'width_multiplier = 3\nnotes_file = ""\n' in written.read_text()
    assert load_config(["--config", str(written)]) == config
    # --help lists them, with the fork's module named on the command line.
    text = help_text([NAME])
    assert '[model] with model.name = "registry_fork:wide-gru"' in text
    assert "  model.width_multiplier = 1    (an integer >= 1; unit: factor)" in text
    assert '  model.notes_file = ""    (a string ("" = none))' in text


def test_a_registered_loss_is_chosen_by_model_objective(fork):
    config = load_config([NAME, "model.objective=registry_fork:doubled", *TINY])
    logits, labels = torch.randn(2, 3, 5), torch.tensor([[1, -100, 2], [0, 4, -100]])
    expected = 2 * torch.nn.functional.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), reduction="sum")
    assert torch.allclose(loss_sum_fn_for(config.model)(logits, labels), expected)
    with pytest.raises(ConfigError, match=r"^model.objective: registry_fork registers no loss 'halved'"):
        load_config([NAME, "model.objective=registry_fork:halved"])


@pytest.mark.parametrize("rank", [0, 1])
def test_dropout_is_seeded_per_rank_after_the_build(fork, rank):
    """The fork's build calls torch.manual_seed(0); each rank's dropout stream must still be its own."""
    config = load_config([NAME, *TINY, "device=cpu"])
    context = DistributedContext(rank=rank, local_rank=rank, world_size=1, device=torch.device("cpu"), backend=None)
    build_training(config, 256, None, context)
    after_build = torch.get_rng_state()
    seed_dropout(config.run.seed, rank)
    assert torch.equal(after_build, torch.get_rng_state())


def test_resume_compares_the_own_settings_and_the_fingerprint(fork, capsys):
    notes = fork / "notes.txt"
    notes.write_text("first")
    argv = [NAME, f"model.notes_file={notes}", *TINY, f"run.out_dir={fork / 'runs'}", "device=cpu"]
    assert train.main([*argv, "run.max_steps=0"]) == 0  # the initial checkpoint
    assert train.main([*argv, "model.width_multiplier=2", "run.max_steps=0"]) == 2
    assert "model.width_multiplier 1 -> 2" in capsys.readouterr().err
    notes.write_text("edited in place")
    assert train.main([*argv, "run.max_steps=0"]) == 2
    assert "model fingerprint" in capsys.readouterr().err
    notes.write_text("first")
    assert train.main([*argv, "run.max_steps=1", "run.eval_every=0"]) == 0  # the same settings resume
    assert "resuming from" in capsys.readouterr().out


def test_every_built_in_model_is_registered_with_its_rules():
    from accumulation.config.help import registered

    assert {"gpt", "gru", "encoder"} <= set(registered("model"))
    with pytest.raises(ConfigError, match="needs data.task"):
        load_config(["model.name=encoder"])
    assert dataclasses.replace(load_config(["model.name=gru", "model.d_model=130"]).model).d_model == 130


def test_a_registered_source_is_checked_against_data_seq_len_and_keeps_data_val_rows(fork):
    from accumulation.data.rows import DataError
    from accumulation.data.sources import build_data

    config = load_config(["data.source=registry_fork:five-token-rows", "data.seq_len=5", "data.val_rows=3"])
    data = build_data(config.data, model_vocab_size=0, seed=1)
    assert data.val.num_rows == 3 and data.summary.val_rows_read == 3 and data.train.num_rows == 32
    assert "fingerprint" in data.summary.describe() and "layout" not in data.summary.describe()
    config = load_config(["data.source=registry_fork:five-token-rows", "data.seq_len=8"])
    with pytest.raises(DataError, match=r"^data.seq_len: the rows of .* have 5 positions, but data.seq_len is 8"):
        build_data(config.data, model_vocab_size=0, seed=1)


def test_validation_reads_the_images_un_augmented_and_training_augments_them():
    from accumulation.data.sources import build_data, eval_micro_batches, step_batch

    config = load_config(["--config", "configs/image_classifier.toml", "data.images=40", "data.val_fraction=0.5"])
    data = build_data(config.data, model_vocab_size=0, seed=config.run.seed)
    [first] = list(eval_micro_batches(data.val, 20, 1, 0))
    assert torch.equal(first.inputs, data.val.images)  # exactly the stored images: nothing augmented
    batch = step_batch(
        data.train,
        0,
        seed=config.run.seed,
        global_batch_size=20,
        tail="drop",
        micro_batch_size=20,
        world_size=1,
        rank=0,
    )
    stored = data.train.images[batch.row_ids]
    assert not torch.equal(batch.micro_batches[0].inputs, stored)  # step 0's rows are cropped and flipped


# A fork's module that cannot be imported, and the fault each one shows: (module text, what the line must name).
BROKEN_MODULES = {
    "raises": ("import os\n\nraise RuntimeError('no weights here')\n", "RuntimeError: no weights here (at "),
    "syntax": ("def build(:\n    pass\n", "SyntaxError: "),
    "missing-dependency": ("import no_such_package_here\n", "ModuleNotFoundError: No module named 'no_such_package_"),
    "exits": ("import sys\n\nsys.exit(0)\n", "broken_fork exited (sys.exit(0)) while being imported"),
}


@pytest.mark.parametrize("help_asked", [False, True], ids=["train", "help"])
@pytest.mark.parametrize("kind", BROKEN_MODULES)
def test_a_fork_module_that_cannot_be_imported_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, kind, help_asked):
    text, named = BROKEN_MODULES[kind]
    (tmp_path / "broken_fork.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    arguments = ["model.name=broken_fork:mine", f"run.out_dir={tmp_path / 'runs'}", *TINY]
    try:
        status = train.main(["--help", *arguments] if help_asked else arguments)
    finally:
        sys.modules.pop("broken_fork", None)
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith("error: model.name: ") and captured.err.count("\n") == 1, captured.err
    assert "broken_fork" in captured.err and named in captured.err, captured.err
    if kind in ("raises", "syntax"):  # the file and line of the fault
        line = 3 if kind == "raises" else 1
        assert f"broken_fork.py:{line})" in captured.err, captured.err
    assert not (tmp_path / "runs").exists()


def test_help_naming_a_module_that_does_not_exist_is_one_line_and_exit_2(capsys):
    status = train.main(["--help", "model.name=nosuchmodule:x"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "cannot import nosuchmodule" in captured.err, captured.err


# Builds that break the model contract, and a model that keeps it without the optional describe().
CONTRACT_MODULE = """
import torch

from accumulation.config.registry import register_model


class Embedding(torch.nn.Module):
    def __init__(self, vocab_size, width):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)

    def forward(self, inputs):
        return self.embed(inputs)


register_model("str", lambda model_config, vocab_size, *, seq_len, seed: "a model")
register_model("none", lambda model_config, vocab_size, *, seq_len, seed: None)
register_model("tensor", lambda model_config, vocab_size, *, seq_len, seed: torch.zeros(3))
# logits [rows, seq, 7] for a vocabulary of 256: the token cross-entropy finds labels beyond them
register_model("seven-logits", lambda model_config, vocab_size, *, seq_len, seed: Embedding(vocab_size, 7))
register_model("no-describe", lambda model_config, vocab_size, *, seq_len, seed: Embedding(vocab_size, vocab_size))
"""


@pytest.fixture
def contract_fork(tmp_path, monkeypatch):
    (tmp_path / "contract_fork.py").write_text(CONTRACT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("contract_fork", None)


FAILING_PIECES = {
    "returns-str": (["model.name=contract_fork:str"], "build (<lambda>) returned str, not a torch.nn.Module"),
    "returns-none": (["model.name=contract_fork:none"], "returned NoneType, not a torch.nn.Module"),
    "returns-tensor": (["model.name=contract_fork:tensor"], "returned Tensor, not a torch.nn.Module"),
    "outputs-unfit-for-the-loss": (
        ["model.name=contract_fork:seven-logits"],
        "step 0: the loss raised on the model's outputs float32 [2, 16, 7] and the labels int64 [2, 16]: IndexError",
    ),
    "images-into-the-gpt": (
        ["data.source=forks.image_classifier:synthetic-images", "model.n_head=2", "data.image_size=4"],
        "step 0: the model's forward raised on the first micro-batch (inputs float32 [2, 3, 4, 4]): ",
    ),
}


@pytest.mark.parametrize("kind", FAILING_PIECES)
def test_a_piece_that_breaks_the_model_contract_is_one_line_and_nothing_written(contract_fork, capsys, kind):
    settings, named = FAILING_PIECES[kind]
    out_dir = contract_fork / "runs"
    status = train.main([f"run.out_dir={out_dir}", "run.max_steps=1", "data.seq_len=16", *TINY, *settings])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and named in captured.err, captured.err
    assert not out_dir.exists()  # neither the run directory nor the lock file


def test_a_model_without_describe_trains_and_the_banner_counts_its_parameters(contract_fork, capsys):
    arguments = [f"run.out_dir={contract_fork / 'runs'}", "run.max_steps=1", *TINY, "data.seq_len=16"]
    status = train.main([*arguments, "model.name=contract_fork:no-describe"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "model: contract_fork:no-describe: 65,536 parameters;" in captured.out  # 256 x 256 embedding weights
