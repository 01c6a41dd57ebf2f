"""The run's logs under faults: metrics.jsonl never keeps a half line, a full disk is one line for the metrics
file and for TensorBoard alike, and the TensorBoard event files hold exactly the points of metrics.jsonl."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from accumulation.config.config import load_config
from accumulation.counters import Counters
from accumulation.parallel.distributed import DistributedContext
from accumulation.run import logs, sinks
from accumulation.run.run_dir import WriteError
from scripts.checks import plant_bugs
from testkit.disk import fill_disk, small_disk

REPO = Path(__file__).resolve().parent.parent

SINGLE_PROCESS = DistributedContext(0, 0, 1, torch.device("cpu"), None)


def tensorboard_points(run_dir: Path, axis: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of one TensorBoard axis as TensorBoard itself reads it (purged points dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard" / axis), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def assert_tensorboard_matches_metrics(run_dir: Path) -> None:
    """One point per step and numeric field against steps, and per step and loss against supervised tokens, the
    values of metrics.jsonl stored as float32 (TensorBoard's simple_value)."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = {}
    for line in metrics:
        for tag, value in sinks.tagged(line, "data").items():
            expected.setdefault(tag, []).append((line["steps"], float(np.float32(value))))
    assert tensorboard_points(run_dir, "by_steps") == expected
    by_tokens = tensorboard_points(run_dir, "by_tokens")
    for name, tag in sinks.TOKEN_AXIS_TAGS.items():
        points = [(line["tokens"], float(np.float32(line[name]))) for line in metrics if line.get(name) is not None]
        assert by_tokens.get(tag, []) == points, tag


def test_keep_metrics_up_to_drops_later_steps_and_a_half_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"steps": step, "loss": 1.0}) + "\n" for step in (1, 2, 3)]
    path.write_text("".join(lines) + '{"steps": 4, "lo')  # a process killed in the middle of writing step 4
    logs.keep_metrics_up_to(path, 3)
    assert path.read_text() == "".join(lines)
    logs.keep_metrics_up_to(path, 2)
    assert path.read_text() == "".join(lines[:2])


def test_a_metrics_line_is_on_a_full_disk_whole_or_not_at_all(tmp_path):
    """A real full disk: the kernel takes part of the line, then refuses the rest. The part is cut off
    again, so the file ends with the last whole line, and the error is one line naming the file."""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        metrics_file = sinks.MetricsFile(disk / "metrics.jsonl")
        metrics_file.write({"steps": 1})
        fill_disk(disk, leave_free_bytes=0)
        # tmpfs counts whole pages: the file's first page still has room for part of a long line
        with pytest.raises(WriteError) as raised:
            metrics_file.write({"steps": 2, "padding": "x" * 20_000})
        metrics_file.close()
        assert (disk / "metrics.jsonl").read_text() == '{"steps": 1}\n'
        message = str(raised.value)
        assert message.startswith(f"{disk / 'metrics.jsonl'} could not be written: the disk is full")
        assert "\n" not in message


def test_rewriting_metrics_on_a_full_disk_leaves_the_file_unchanged(tmp_path):
    with small_disk(tmp_path / "disk", 2**20) as disk:
        path = disk / "metrics.jsonl"
        text = "".join(json.dumps({"steps": step, "padding": "x" * 3000}) + "\n" for step in range(1, 30))
        path.write_text(text)
        fill_disk(disk, leave_free_bytes=0)
        with pytest.raises(WriteError, match="could not be rewritten for the resume: the disk is full"):
            logs.keep_metrics_up_to(path, 20)
        assert path.read_text() == text
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "metrics.jsonl"]  # no temporary file


def test_a_full_disk_under_tensorboard_is_one_line_without_a_traceback(tmp_path, capfd):
    """TensorBoard's writer thread fails first; its error comes back at a later call as one WriteError, and
    the thread's own traceback stays off the terminal."""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        run_logs = logs.RunLogs(load_config(["log.sinks=tensorboard"]), None, disk, SINGLE_PROCESS, print)
        run_logs.open(Counters(), resumed=False)
        fill_disk(disk, leave_free_bytes=0)
        record = {**vars(Counters()), "loss": 1.0, "val_loss": 1.0, "lr": 1.0, "grad_norm": 1.0}
        with pytest.raises(WriteError) as raised:
            for step in range(1, 5000):
                run_logs.write_metrics({**record, "steps": step, "tokens": step})
                run_logs.flush()
        assert str(raised.value).startswith(f"TensorBoard events in {disk / 'tensorboard'} could not be written")
        assert "the disk is full" in str(raised.value)
        assert "Traceback" not in capfd.readouterr().err


def test_tensorboard_after_a_resume_from_an_earlier_checkpoint_equals_metrics(tmp_path, capsys):
    """In-process form of the kill below (which runs in the integration tier): the run's events of steps 3 and 4
    are on disk, its newest checkpoint is step 2's, as a kill during the step-4 save leaves it; the resume must
    drop the old points of steps 3 and 4 on both axes and end with one point per step, equal to metrics.jsonl."""
    import train
    from tests.test_train import tiny_settings, uneven_corpus

    corpus = uneven_corpus(tmp_path / "corpus")
    settings = {"run.checkpoint_every": 2, "run.keep_checkpoints": 5, "run.sample_bytes": 0}
    arguments = tiny_settings(tmp_path, corpus, **settings, **{"schedule.decay_updates": 6})
    assert train.main([*arguments, "run.max_steps=4"]) == 0
    run_dir = tmp_path / "runs" / "default"
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step_000004.pt").unlink()  # as if the step-4 save had never been published
    (checkpoints / "latest.pt").write_bytes((checkpoints / "step_000002.pt").read_bytes())
    assert [step for step, _ in tensorboard_points(run_dir, "by_steps")["loss/train"]] == [1, 2, 3, 4]
    assert train.main([*arguments, "run.max_steps=6"]) == 0
    assert "at step 2" in capsys.readouterr().out
    assert_tensorboard_matches_metrics(run_dir)
    assert [step for step, _ in tensorboard_points(run_dir, "by_steps")["loss/train"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.integration
def test_tensorboard_after_a_kill_and_a_resume_equals_metrics(tmp_path):
    """Killed while the step-4 checkpoint was being saved: the events of steps 3 and 4 are already on disk
    (the logs are flushed before each checkpoint), the resume continues from step 2, so both axes must drop
    the old points of steps 3 and 4 (purge_step) and end with one point per step, equal to metrics.jsonl."""
    from tests.test_signals import run_with_faults
    from tests.test_train import run_train, tiny_settings, uneven_corpus

    corpus = uneven_corpus(tmp_path / "corpus")
    arguments = tiny_settings(
        tmp_path, corpus, **{"run.max_steps": 6, "run.checkpoint_every": 2, "run.sample_bytes": 0}
    )
    fault_log = tmp_path / "faults.jsonl"
    killed = run_with_faults(arguments, [{"attempt": 0, "rank": 0, "kill_before_rename": 4}], fault_log)
    assert killed.returncode == -9 and fault_log.exists(), killed.stderr[-2000:]
    run_dir = tmp_path / "runs" / "default"
    assert [step for step, _ in tensorboard_points(run_dir, "by_steps")["loss/train"]] == [1, 2, 3, 4]
    resumed = run_train(arguments)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout
    assert_tensorboard_matches_metrics(run_dir)
    assert [step for step, _ in tensorboard_points(run_dir, "by_steps")["loss/train"]] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_older_ones_stay(tmp_path):
    """torch.save on a real full disk fails inside its zip writer; the error is one line naming the file,
    the space needed and that the disk is full; its temporary file goes; the older checkpoints stay whole."""
    from accumulation.run.checkpoint import save_checkpoint

    payload = {"model": {"weight": torch.zeros(40_000)}, "counters": {"steps": 0}}  # 160 kB of tensors
    with small_disk(tmp_path / "disk", 2**20) as disk:
        folder = disk / "checkpoints"
        save_checkpoint(payload, folder, 2, keep=3)
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        fill_disk(disk, leave_free_bytes=80_000)
        with pytest.raises(WriteError) as raised:
            save_checkpoint(payload, folder, 4, keep=3)
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # nothing new, nothing lost
        message = str(raised.value)
        assert message.startswith(f"checkpoint {folder / 'step_000004.pt'} could not be written: the disk is full")
        assert "it needs about 0.2 MB" in message and "the newest complete checkpoint is step_000002.pt" in message
        assert "\n" not in message


def test_any_other_os_error_while_saving_is_one_line_with_the_systems_reason(tmp_path, monkeypatch):
    """Not only a full disk: a failing device (EIO here, injected into torch.save) gets the same treatment,
    with the operating system's words for the reason."""
    import errno

    import accumulation.run.checkpoint as checkpoint

    def failing_save(payload, file):
        file.write(b"partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(WriteError) as raised:
        checkpoint.save_checkpoint({"model": {}}, tmp_path / "checkpoints", 6, keep=3)
    assert str(raised.value) == (
        f"checkpoint {tmp_path / 'checkpoints' / 'step_000006.pt'} could not be written: Input/output error; its "
        f"temporary file was removed and no checkpoint exists yet; fix the cause, and a restart resumes from the "
        f"newest checkpoint"
    )
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.integration  # plant_bugs.py runs pytest in processes of its own
@pytest.mark.slow
def test_plant_bugs_tells_a_caught_bug_from_a_harmless_change_and_a_vanished_text():
    """scripts/checks/plant_bugs.py's verdicts, by what the tests do with a planted change (not by the texts of its
    list, which code may reword freely: a bug whose text is gone is reported "not applicable", and the script
    then exits 1). A real bug (the logged loss sum kept attached to autograd) is caught by a step test; a
    changed comment is not; a text not in the file is not applicable, without running anything."""
    test = "tests/test_step.py::test_logged_loss_is_the_exact_global_token_mean"
    old = "loss_sum_local += loss_sum.detach()"
    attached = plant_bugs.Bug("attached", "", "accumulation/step.py", old, "loss_sum_local += loss_sum", [test])
    comment = plant_bugs.Bug("comment", "", "accumulation/step.py", "# Only for the log", "# For the log", [test])
    vanished = plant_bugs.Bug("vanished", "", "accumulation/step.py", "no such text in step.py", "", [test])
    assert plant_bugs.plant(attached)["outcome"] == "caught"
    assert plant_bugs.plant(comment)["outcome"] == "NOT caught"
    assert plant_bugs.plant(vanished) == {"bug": "vanished", "outcome": "not applicable", "seconds": 0.0}


def test_the_last_line_is_the_steady_state_speed_with_the_warm_up_apart():
    """A first step of 20 s (compiling) must not drag the speed a user gets: 4 steps of 1,000 supervised tokens,
    the first two 20 s and 2 s, the last two 0.5 s each: 2,000 tokens in 1 s = 2.0k tokens/s in steady state."""
    line = logs.speed_line([(1000, 20.0), (1000, 2.0), (1000, 0.5), (1000, 0.5)], wall_seconds=25.0)
    assert line.startswith("speed: 2.0k supervised tokens/s in steady state (2 steps, 0.500 s per step)")
    assert f"the first {logs.WARMUP_STEPS} steps (compiling, warm-up) took 22.0 s" in line
    assert "23.0 s in optimizer steps of 25.0 s wall time" in line
    # Too short for a steady state: all steps together, and said so.
    short = logs.speed_line([(1000, 2.0), (1000, 0.5)], wall_seconds=3.0)
    assert short.startswith("speed: 0.8k supervised tokens/s over all 2 steps, warm-up included (too few steps")


def test_the_run_header_names_the_loss_training_runs_also_when_compiled(capsys):
    """With model.compile on, the step runs the forward and the plain loss as one module (ForwardAndLoss): the
    header must still say "loss plain", the loss training decided, not guess it from which module runs."""
    from types import SimpleNamespace

    from accumulation.config.config import load_config
    from accumulation.data.sources import build_data
    from accumulation.models.factory import build_model
    from accumulation.models.forward_and_loss import ForwardAndLoss
    from accumulation.step import StepSetup, token_cross_entropy_sum

    config = load_config(["model.n_layer=1", "model.d_model=16", "data.seq_len=16"])
    data = build_data(config.data, model_vocab_size=0, seed=0)
    model = build_model(config.model, 256, seq_len=16, seed=0)
    compiled_module = ForwardAndLoss(model, token_cross_entropy_sum)
    training = SimpleNamespace(  # the module the step runs is not the model; the loss is the plain one
        model=model,
        model_config=config.model.__class__(**{**vars(config.model), "loss": "plain"}),
        setup=StepSetup(compiled_module, torch.device("cpu"), loss_sum_fn=None),
        compiled=True,
    )
    context = DistributedContext(0, 0, 1, torch.device("cpu"), None)
    logs.RunLogs(config, data, Path("runs"), context, print).header(training, Counters())
    [model_line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model:")]
    assert "loss plain; compile on" in model_line
