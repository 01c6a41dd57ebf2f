"""Faults in a fork's code and in a plain launcher, each refused in one line, exit 2, nothing written: a loss
without gradient (found by the step-0 probe, accumulation/probe.py), a model or data build that raises or returns
the wrong thing (accumulation/models/factory.py, accumulation/data/sources.py), and a MASTER_PORT already in use
where rank 0 hosts the rendezvous (accumulation/parallel/torchrun.py). A fork's bug (any exception but a
ValueError) keeps its traceback, printed from the fork's own frame on, above the line.

The forks are this module's own functions, registered as it is imported and named by import path."""

import socket
from pathlib import Path

import pytest

import train
from accumulation.config.registry import register_data, register_loss, register_model
from accumulation.step import token_cross_entropy_sum
from tests.test_train import tiny_settings, uneven_corpus

THIS = "tests.test_fork_and_launch_faults"


def detached_sum(outputs, labels):
    return token_cross_entropy_sum(outputs, labels).detach()  # the fork's mistake: no gradient reaches the model


def float_sum(outputs, labels):
    return token_cross_entropy_sum(outputs, labels).item()


def buggy_model_build(model_config, vocab_size, *, seq_len, seed):
    widths = {}
    return widths["d_model"]  # the fork's bug: a KeyError


def refusing_model_build(model_config, vocab_size, *, seq_len, seed):
    raise ValueError("this model needs model.d_model >= 64")


def buggy_data_build(settings, *, model_vocab_size, seed):
    return len(settings.source) / 0  # the fork's bug: a ZeroDivisionError


def str_data_build(settings, *, model_vocab_size, seed):
    return "rows"


register_loss("detached", detached_sum)
register_loss("float", float_sum)
register_model("buggy", buggy_model_build)
register_model("refusing", refusing_model_build)
register_data("buggy", buggy_data_build)
register_data("str", str_data_build)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


def refused(tmp_path, corpus, capsys, **change) -> tuple[list[str], str]:
    """(the traceback's lines above the one line, the line): exit 2 and nothing written asserted."""
    status = train.main(tiny_settings(tmp_path, corpus, **change))
    error = capsys.readouterr().err
    assert status == 2, error
    assert not (tmp_path / "runs").exists()
    *above, line = error.splitlines()
    assert line.startswith("error: "), error
    return above, line


@pytest.mark.parametrize("loss, returned", [("detached", "Tensor"), ("float", "float")])
def test_a_loss_without_gradient_is_refused_at_step_0(tmp_path, corpus, capsys, loss, returned):
    """Before: the step-0 checkpoint written, then a traceback at the first backward."""
    above, line = refused(tmp_path, corpus, capsys, **{"model.objective": f"{THIS}:{loss}"})
    assert above == [] and line.startswith(f"error: step 0: the loss returned a {returned} without gradient"), line


@pytest.mark.parametrize(
    "change, named, bug_line",
    [
        ({"model.name": f"{THIS}:buggy"}, "model.name: tests.test_fork_and_launch_faults:buggy's build", "widths["),
        ({"model.name": f"{THIS}:refusing"}, "raised ValueError: this model needs model.d_model >= 64 (at ", None),
        ({"data.source": f"{THIS}:buggy"}, "data.source: tests.test_fork_and_launch_faults:buggy's build", "/ 0"),
        ({"data.source": f"{THIS}:str"}, "(str_data_build) returned str, not a Data; return data_from_custom", None),
    ],
)
def test_a_fork_build_that_raises_or_returns_the_wrong_thing_is_one_line(
    tmp_path, corpus, capsys, change, named, bug_line
):
    """Before: a traceback through this program's frames (and for the str, an AttributeError far from the build).
    A bug's traceback starts at the fork's own frame; a ValueError (the fork refusing its input) is the line alone."""
    above, line = refused(tmp_path, corpus, capsys, **change)
    assert named in line, line
    if bug_line is None:
        assert above == [], above
    else:
        assert above[0] == "Traceback (most recent call last):" and __file__ in above[1], above
        assert bug_line in above[2] and not any("train.py" in text or "accumulation/" in text for text in above)
        assert " raised " in line and f"(at {__file__}:" in line, line


def test_a_master_port_in_use_is_one_line_and_leaves_no_lock(tmp_path, corpus, capsys, monkeypatch):
    """A plain launcher (RANK and MASTER_* set, no torchrun agent): rank 0 hosts the rendezvous on MASTER_PORT,
    here held by another program. Before: an 11-line traceback from the store, and run.lock left behind."""
    with socket.socket() as other_program:
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
        port = other_program.getsockname()[1]
        launch = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for name, value in launch.items():
            monkeypatch.setenv(name, str(value))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        above, line = refused(tmp_path, corpus, capsys)
    assert above == [] and line.startswith(f"error: MASTER_PORT={port} is in use on this host"), line
