"""Checkpoints: the newest k kept and damaged ones passed over, each rank's dropout stream restored, and the
checkpoint of another run or a malicious pickle refused. train.main runs in this process (fast).

Damaged checkpoints and metrics lines as bad input are in tests/test_bad_input.py; the `started_run` fixture
both use is in tests/conftest.py.
"""

import os
import shlex
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import train
from accumulation.config.config import load_config
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.checkpoint import seed_dropout
from accumulation.run.checkpoint_checks import check_archive
from accumulation.run.restore import restore_rng_states
from accumulation.run.run_dir import LOCK_FILE
from tests.test_train import comparable, final_weights, read_metrics, tiny_settings, uneven_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return uneven_corpus(tmp_path_factory.mktemp("data") / "corpus")


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------


def run_in_process(arguments: list[str], capsys) -> tuple[int, str, str]:
    status = train.main(arguments)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_resume_payload_is_freed_once_loaded(tmp_path, corpus, capsys, monkeypatch):
    """The checkpoint read for a resume (the whole model and optimizer state in host memory) is emptied
    once its state has been loaded, instead of being held for the rest of the run."""
    arguments = tiny_settings(tmp_path, corpus, **{"run.sample_bytes": 0, "run.max_steps": 2})
    assert run_in_process(arguments, capsys)[0] == 0
    payloads = []
    real_find_resume_point = train.find_resume_point

    def keep_a_reference(*args, **kwargs):
        payloads.append(real_find_resume_point(*args, **kwargs))
        return payloads[-1]

    monkeypatch.setattr(train, "find_resume_point", keep_a_reference)
    status, out, _ = run_in_process(arguments + ["run.max_steps=3"], capsys)  # the last value of a key wins
    assert status == 0 and "at step 2" in out
    assert payloads == [{}]


def test_each_rank_continues_its_own_dropout_stream_after_a_resume():
    """The restore half of a 2-rank resume, without launching ranks (the slow torchrun tests run it whole):
    the checkpoint holds one generator state per rank, and rank r must continue stream r. Rank 1 handed
    rank 0's state would draw rank 0's dropout masks: a run that still trains, and no longer the run."""
    config = load_config([])
    saved, expected = {"per_rank": []}, []
    for rank in range(2):  # each rank's stream some draws in, as at a checkpoint
        seed_dropout(config.run.seed, rank)
        torch.rand(7)
        saved["per_rank"].append({"cpu": torch.get_rng_state()})
        expected.append(torch.rand(5))
    assert not torch.equal(expected[0], expected[1])
    for rank in range(2):
        torch.manual_seed(12345)  # whatever the new process drew before the resume
        restore_rng_states(saved, DistributedContext(rank, rank, 2, torch.device("cpu"), "gloo"), config, steps=3)
        assert torch.equal(torch.rand(5), expected[rank]), rank


def garbage(size_bytes: int) -> bytes:
    """Reproducible random bytes behind a pickle header (protocol 33): the unpickler gets far enough to warn
    about the protocol before it fails, and that warning must not reach the user's terminal."""
    generator = torch.Generator().manual_seed(size_bytes)
    return bytes([0x80, 33]) + bytes(
        torch.randint(0, 256, (size_bytes,), generator=generator, dtype=torch.uint8).tolist()
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock file's: each job that takes the lock writes its own pid there."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def test_the_newest_k_checkpoints_are_kept_and_damaged_ones_are_passed_over(tmp_path, corpus, capsys):
    """keep_checkpoints = 2 keeps step files 3 and 4. Then latest.pt is truncated, step_000004.pt holds
    random bytes and metrics.jsonl ends in half a line, as after a crash: the resume warns about both
    files, continues from step 3 and ends with the same bits and the same metrics as before."""
    arguments = tiny_settings(
        tmp_path, corpus, **{"run.checkpoint_every": 1, "run.keep_checkpoints": 2, "run.sample_bytes": 0}
    )
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest.pt", "step_000003.pt", "step_000004.pt"]
    weights_before, metrics_before = final_weights(run_dir), read_metrics(run_dir)

    latest_bytes = (checkpoints / "latest.pt").read_bytes()
    (checkpoints / "latest.pt").unlink()  # a new file: latest.pt may be a hard link to step_000004.pt
    (checkpoints / "latest.pt").write_bytes(latest_bytes[: len(latest_bytes) // 2])
    (checkpoints / "step_000004.pt").write_bytes(garbage(5000))
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"micro_batches": 20, "ste')

    status, output, error = run_in_process(arguments, capsys)
    assert status == 0, error
    assert f"warning: checkpoint {checkpoints / 'latest.pt'} cannot be read" in error  # warnings: stderr
    assert f"warning: checkpoint {checkpoints / 'step_000004.pt'} cannot be read" in error
    assert "warning" not in output
    assert f"resuming from {checkpoints / 'step_000003.pt'} at step 3" in output
    for key, value in weights_before.items():
        assert torch.equal(final_weights(run_dir)[key], value), key
    assert comparable(read_metrics(run_dir)) == comparable(metrics_before)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest.pt", "step_000003.pt", "step_000004.pt"]


def flip_middle_byte(path: Path) -> str:
    """One bit of the byte in the middle of `path` flipped in place, as a failing disk or a bad transfer does;
    returns the name of the archive entry that byte lies in (a tensor's bytes, in these small checkpoints)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    with zipfile.ZipFile(path) as archive:
        entry = max(
            (info for info in archive.infolist() if info.header_offset < middle), key=lambda info: info.header_offset
        )
    data[middle] ^= 0x10
    with open(path, "r+b") as file:  # in place: latest.pt and its step file are one file (a hard link)
        file.write(data)
    return entry.filename


def test_a_bit_flip_in_a_checkpoint_is_found_and_the_previous_one_used(tmp_path, corpus, capsys):
    """One bit flipped in the middle of latest.pt (a byte of AdamW's moments or a weight): torch.load reads
    it without a word (it does not check the zip archive's CRCs), and the run resumed "from step 4" though it
    no longer was the run. Now the CRCs are checked before loading: latest.pt and step_000004.pt (the same
    file, hard-linked) are each reported naming the damaged entry, the run continues from step 3 and ends
    with the bits of the undamaged run. With no older checkpoint left, it is one line and exit 2."""
    arguments = tiny_settings(
        tmp_path, corpus, **{"run.checkpoint_every": 1, "run.keep_checkpoints": 2, "run.sample_bytes": 0}
    )
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    checkpoints = run_dir / "checkpoints"
    weights_before = final_weights(run_dir)
    entry = flip_middle_byte(checkpoints / "latest.pt")
    torch.load(checkpoints / "latest.pt", weights_only=True)  # what made it silent: torch reads it anyway

    status, output, error = run_in_process(arguments, capsys)
    assert status == 0, error
    for name in ("latest.pt", "step_000004.pt"):
        assert f"warning: checkpoint {checkpoints / name} is damaged: the CRC of its entry {entry} " in error, error
    assert error.count("\n") == 2, error
    assert f"resuming from {checkpoints / 'step_000003.pt'} at step 3" in output
    for key, value in weights_before.items():
        assert torch.equal(final_weights(run_dir)[key], value), key

    for path in checkpoints.iterdir():
        if path.name != "latest.pt":
            path.unlink()
    entry = flip_middle_byte(checkpoints / "latest.pt")
    before = snapshot(run_dir)
    status, output, error = run_in_process(arguments, capsys)
    assert status == 2 and error.count("\n") == 1, error
    assert f"checkpoint {checkpoints / 'latest.pt'} is damaged: the CRC of its entry {entry} " in error, error
    assert "resuming" not in output and snapshot(run_dir) == before


def test_no_flipped_bit_anywhere_in_a_checkpoint_loads_silently(tmp_path):
    """Not only a tensor's bytes: a flip in a header, a name, an offset or the central directory either fails
    the archive's check, or makes torch.load fail, or changes nothing torch.load returns (timestamps,
    padding). Every 9th byte of a small checkpoint, one bit each (the whole file, every byte, bits 0 and 7:
    no silent case either, 70 s on the project's shared 2-core machine)."""
    original = {"model": {"w": torch.arange(6.0)}, "counters": {"steps": 3}, "name": "x"}
    path = tmp_path / "small.pt"
    torch.save(original, path)
    data = path.read_bytes()
    silent = []
    for position in range(0, len(data), 9):
        damaged = bytearray(data)
        damaged[position] ^= 1 << (position % 8)
        path.write_bytes(damaged)
        try:
            check_archive(path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a damaged pickle may warn before it fails
                loaded = torch.load(path, weights_only=True)
        except Exception:
            continue  # found: the run would say so
        if not same_payload(loaded, original):
            silent.append(position)
    assert silent == [], f"flips at these byte positions load silently: {silent}"


def same_payload(one, other) -> bool:
    """Equal nested dicts, with tensors equal in dtype, shape and every value."""
    if isinstance(other, torch.Tensor):
        return isinstance(one, torch.Tensor) and one.dtype == other.dtype and torch.equal(one, other)
    if isinstance(other, dict):
        return (
            isinstance(one, dict)
            and one.keys() == other.keys()
            and all(same_payload(one[key], other[key]) for key in other)
        )
    return type(one) is type(other) and one == other


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model.d_model": 32}, "model.d_model 16 -> 32"),
        ({"batch.global_batch_size": 16}, "batch.global_batch_size 8 -> 16"),
        ({"run.seed": 7}, "run.seed 1337 -> 7"),
        ({"data.seq_len": 8}, "data.seq_len 16 -> 8"),
        ({"optim.lr": 0.1}, "optim.lr 0.003 -> 0.1"),
        ({"optim.name": "sgd"}, "optim.name 'adamw' -> 'sgd'"),
        ("edited data", "training data (fingerprint "),
        ("another data order", "data order feistel-4 -> feistel-8-blake2b"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, capsys, started_run, change, named):
    arguments, run_dir = started_run
    if change == "edited data":  # the same data.source and settings; every file has one more line
        for document in (tmp_path / "corpus").iterdir():
            document.write_text(document.read_text() + "\nedited")
        change = {}
    if change == "another data order":  # a checkpoint of a program version that ordered the rows otherwise
        for path in (run_dir / "checkpoints").glob("*.pt"):
            payload = torch.load(path, weights_only=True)
            torch.save({**payload, "data": {**payload["data"], "order": "feistel-4"}}, path)
        change = {}
    before = snapshot(run_dir)
    status, _, error = run_in_process(arguments + [f"{key}={value}" for key, value in change.items()], capsys)
    assert status == 2
    assert error.count("\n") == 1 and "belongs to a different run" in error and named in error, error
    assert snapshot(run_dir) == before


# Every other setting a resume must share, in one test (one step-0 run to refuse them all: cheap). A resume
# that skipped, say, beta2 would exit 0 with config.toml saying 0.99 while AdamW's loaded state kept 0.95.
MORE_SETTINGS_THAT_MUST_MATCH = [
    ("optim.beta2", 0.99, "0.95 -> 0.99"),
    ("optim.momentum", 0.8, "0.9 -> 0.8"),
    ("optim.weight_decay", 0.0, "0.1 -> 0.0"),
    ("batch.tail", "partial", "'drop' -> 'partial'"),
    ("model.n_layer", 2, "1 -> 2"),
    ("model.n_head", 4, "2 -> 4"),
    ("model.name", "gru", "'gpt' -> 'gru'"),
]


def test_every_setting_that_shapes_the_run_is_compared_on_resume(capsys, started_run):
    arguments, run_dir = started_run
    before = snapshot(run_dir)
    for key, value, change in MORE_SETTINGS_THAT_MUST_MATCH:
        status, _, error = run_in_process(arguments + [f"{key}={value}"], capsys)
        assert status == 2, (key, error)
        assert error.count("\n") == 1 and f"belongs to a different run: {key} {change}" in error, error
    assert snapshot(run_dir) == before


class CreatesAFileWhenUnpickled:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # unpickling calls open(path, "w")
        return (open, (str(self.path), "w"))


class RunsACommandWhenUnpickled:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # unpickling calls os.system("touch path")
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


@pytest.mark.parametrize(
    "attack, reason",
    [
        (CreatesAFileWhenUnpickled, "Unsupported global: GLOBAL io.open was not an allowed global by default"),
        # torch 2.13 words this refusal without "WeightsUnpickler error:": the advice was kept, the reason lost
        (RunsACommandWhenUnpickled, "Trying to load unsupported GLOBAL posix.system whose module posix is blocked"),
    ],
    ids=["open", "os.system"],
)
def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, capsys, started_run, attack, reason):
    """Refused, with the reason, and without PyTorch's advice to load it with weights_only=False or to
    allow the global: the two things that would run it."""
    arguments, run_dir = started_run
    marker = tmp_path / "created_by_the_pickle"
    payload = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    payload["counters"] = attack(marker)
    for path in (run_dir / "checkpoints").iterdir():
        path.unlink()
    torch.save(payload, run_dir / "checkpoints" / "latest.pt")

    status, _, error = run_in_process(arguments, capsys)
    assert status == 2 and error.count("\n") == 1, error
    assert (
        "latest.pt cannot be read (the weights-only loader, which accepts tensors and plain values only, refused it: "
        f"{reason})" in error
    ), error
    assert "weights_only" not in error and "safe_globals" not in error and "trust" not in error, error
    assert not marker.exists()
    # The file is a working attack: an unrestricted load runs it.
    torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
    assert marker.exists()


# A model that arrives in eval mode, as Hugging Face's from_pretrained returns one: the GPT, with dropout.
EVAL_MODE_FORK = """
from accumulation.config.registry import register_model
from accumulation.models.gpt import build_gpt


def build(model_config, vocab_size, *, seq_len, seed):
    return build_gpt(model_config, vocab_size, seq_len=seq_len, seed=seed).eval()


register_model("eval-mode-gpt", build)
"""


def test_a_model_built_in_eval_mode_trains_with_dropout_and_resumes_bit_for_bit(tmp_path, corpus, capsys, monkeypatch):
    """The loop puts the model in train mode before every step. Without that, a fresh run trained with dropout
    only because the step-0 probe ends in train mode, and a resumed run (no probe, no validation before its
    first step) trained the model as built: in eval mode, without dropout, and ended on other weights."""
    (tmp_path / "eval_mode_fork.py").write_text(EVAL_MODE_FORK)
    monkeypatch.syspath_prepend(str(tmp_path))

    def arguments(name: str, **overrides) -> list[str]:
        settings = {"model.name": "eval_mode_fork:eval-mode-gpt", "model.dropout": 0.1, "run.sample_bytes": 0}
        return tiny_settings(tmp_path / name, corpus, **{**settings, **overrides})

    assert run_in_process(arguments("straight"), capsys)[0] == 0
    assert run_in_process(arguments("resumed", **{"run.max_steps": 2}), capsys)[0] == 0
    status, output, error = run_in_process(arguments("resumed"), capsys)
    assert status == 0, error
    assert "at step 2" in output
    assert run_in_process(arguments("no_dropout", **{"model.dropout": 0.0}), capsys)[0] == 0
    straight, resumed, no_dropout = (
        final_weights(tmp_path / name / "runs" / "default") for name in ("straight", "resumed", "no_dropout")
    )
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
    # Dropout did act in the straight run's steps: without it the same steps end on other weights.
    assert any(not torch.equal(no_dropout[name], value) for name, value in straight.items())


def test_an_optimizer_the_resume_check_does_not_know_is_refused_on_resume(tmp_path, corpus, capsys, monkeypatch):
    """Adding an optimizer takes a choice in config_keys.py and a branch in build_optimizer (here: "adamax",
    patched in). Its first session trains; its resume is refused in one line, exit 2, leaving the run directory as
    it was, instead of loading a state the check cannot read (optimizer_moments knew only AdamW and SGD)."""
    from accumulation.config.config_keys import OptimConfig
    from accumulation.run import build, restore

    declaration = OptimConfig.__dataclass_fields__["name"]
    choices = (*declaration.metadata["choices"], "adamax")
    monkeypatch.setattr(declaration, "metadata", {**declaration.metadata, "choices": choices})
    real_build_optimizer = build.build_optimizer

    def with_adamax(optim, model, device):
        if optim.name != "adamax":
            return real_build_optimizer(optim, model, device)
        return torch.optim.Adamax(model.parameters(), lr=optim.lr)

    for module in (build, restore):  # the training's optimizer, and the one the resume check compares with
        monkeypatch.setattr(module, "build_optimizer", with_adamax)
    arguments = tiny_settings(tmp_path, corpus, **{"run.sample_bytes": 0, "run.max_steps": 2, "optim.name": "adamax"})
    assert run_in_process(arguments, capsys)[0] == 0
    run_dir = tmp_path / "runs" / "default"
    before = sorted(path.name for path in run_dir.rglob("*"))
    status, _, err = run_in_process(arguments + ["run.max_steps=3"], capsys)
    assert status == 2
    assert err.splitlines() == [
        'error: optim.name: the resume check does not know what "adamax" keeps per parameter, so it cannot check a '
        "checkpoint's optimizer state; name its state keys in optimizer_moments (accumulation/run/restore.py)"
    ]
    assert sorted(path.name for path in run_dir.rglob("*")) == before
