"""The host off the critical path: what the step queues before its one read-back of device values.

With a fused optimizer (train.py's AdamW on CUDA) the update is queued before the read-back and skipped on the
device when the gradient norm is not finite, so on a GPU the read-back waits for the update too and the host's
bookkeeping overlaps it; the next step's micro-batches are built in the same wait. On the CPU nothing runs
asynchronously, but the order of the calls is the same: these tests record it. The queued update must be the
update the host-decided one makes, bit for bit, skipped steps included. A data error in the step built ahead
surfaces in its own step, after the step before is logged and checkpointed."""

import math
import sys

import pytest
import torch

import train
from accumulation import update_on_device
from accumulation.batching import IGNORE_INDEX, MicroBatch
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.run import batches, build
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from tests.test_checkpoints import run_in_process
from tests.test_pipeline_train import checkpoint
from tests.test_train import read_metrics, tiny_settings, uneven_corpus

CPU = torch.device("cpu")
MODEL = GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16, vocab_size=64)


def micro_batches_of(seed: int, count: int = 2) -> list[MicroBatch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(count):
        inputs = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        labels[k % 2, 3 + k :] = IGNORE_INDEX
        batches.append(MicroBatch(inputs, labels, num_examples=2))
    return batches


def recorded_step(monkeypatch, optimizer_of, events: list[str]):
    """One optimizer_step on a fresh model, recording the update, the host work and each read-back in order."""
    model = GPT(MODEL, seed=3)
    optimizer = optimizer_of(model)
    optimizer.register_step_pre_hook(lambda *args: events.append("update"))
    real_tolist = torch.Tensor.tolist

    def tolist(tensor):
        events.append("read-back")
        return real_tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    result = optimizer_step(
        StepSetup(model, CPU), micro_batches_of(seed=1), optimizer, before_read_back=lambda: events.append("host work")
    )
    monkeypatch.undo()
    return result


def test_with_a_fused_optimizer_the_update_is_queued_before_the_one_read_back(monkeypatch):
    events = []
    result = recorded_step(monkeypatch, lambda model: torch.optim.AdamW(model.parameters(), fused=True), events)
    assert result.applied and events == ["update", "host work", "read-back"]
    # A non-fused optimizer needs the host's decision first: the update comes after the read-back.
    events = []
    result = recorded_step(monkeypatch, lambda model: torch.optim.SGD(model.parameters(), lr=0.1), events)
    assert result.applied and events == ["host work", "read-back", "update"]


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value.clone() for state in optimizer.state.values() for value in state.values()]


@pytest.mark.parametrize("grad_scaler", [False, True])
def test_the_queued_update_equals_the_host_decided_one_and_a_non_finite_step_changes_nothing(grad_scaler, monkeypatch):
    """Three steps with fused AdamW, the second with a nan loss (every gradient nan): queued on the device
    (accumulation/update_on_device.py) and decided on the host after the read-back (that extension declining, as
    it does for FSDP2's shards). Both paths run the same fused kernels, so they agree bit for bit: weights,
    moments, step counters, scale."""

    def run(queued: bool):
        if not queued:
            monkeypatch.setattr(update_on_device, "queue_update_unless_non_finite", lambda *args: False)
        model = GPT(MODEL, seed=3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=grad_scaler)
        results, snapshots = [], []
        for step in range(3):
            factor = math.nan if step == 1 else 1.0
            result = optimizer_step(
                StepSetup(
                    model,
                    CPU,
                    scaler=scaler,
                    loss_sum_fn=lambda outputs, labels, factor=factor: (
                        token_cross_entropy_sum(outputs, labels) * factor
                    ),
                    grad_clip=1.0,
                ),
                micro_batches_of(seed=step),
                optimizer,
            )
            results.append((result.applied, result.skip_reason, result.loss_scale))
            snapshots.append(([p.detach().clone() for p in model.parameters()], optimizer_state(optimizer)))
        return results, snapshots, scaler.get_scale() if grad_scaler else None

    queued, host_decided = run(queued=True), run(queued=False)
    assert queued[0] == host_decided[0]
    assert [applied for applied, _, _ in queued[0]] == [True, False, True]
    assert queued[2] == host_decided[2]
    for (weights, state), (host_weights, host_state) in zip(queued[1], host_decided[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(weights, host_weights, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(state, host_state, strict=True))
    # The skipped step left everything as the first step did: weights, moments and AdamW's step count (1).
    (weights_1, state_1), (weights_2, state_2) = queued[1][0], queued[1][1]
    assert all(torch.equal(a, b) for a, b in zip(weights_1 + state_1, weights_2 + state_2, strict=True))
    steps = [value for value in state_2 if value.dim() == 0]
    assert steps and all(float(value) == 1.0 for value in steps)


def test_train_builds_the_next_steps_micro_batches_before_the_steps_read_back(tmp_path, capsys, monkeypatch):
    """train.py: step s + 1's micro-batches are built inside step s, after its work is queued and before its
    read-back; each step's batch is built once, for its own step, in order."""
    corpus = uneven_corpus(tmp_path / "corpus")
    events = []
    real_optimizer_step, real_step_batch = build.optimizer_step, batches.step_batch

    def step_batch(rows, step, **layout):
        events.append(("batch", step))
        return real_step_batch(rows, step, **layout)

    def optimizer_step(*args, before_read_back, **options):
        def recorded():
            events.append("before read-back")
            before_read_back()

        events.append("step")
        return real_optimizer_step(*args, before_read_back=recorded, **options)

    monkeypatch.setattr(batches, "step_batch", step_batch)
    monkeypatch.setattr(build, "optimizer_step", optimizer_step)
    status, _, err = run_in_process(tiny_settings(tmp_path, corpus, **{"run.max_steps": 3}), capsys)
    assert status == 0, err
    assert events == [
        ("batch", 0),
        "step",
        "before read-back",
        ("batch", 1),
        "step",
        "before read-back",
        ("batch", 2),
        "step",
        "before read-back",  # the last step builds nothing: there is no step 3
    ]


# ------------------------------------------------------------------ A data error in a step built one step ahead

# Rows whose supervised_counts promise one target too many at step 2 only: step 2's batch is built (and its
# check fails) while the device runs step 1.
WRONG_AT_STEP_2 = """
from accumulation.config.registry import register_data
from accumulation.data.rows import make_rows
from accumulation.data.custom import data_from_custom_rows
from accumulation.data.splits import row_fingerprint


class CountsWrongAtStep2:
    def __init__(self, rows):
        self.rows, self.num_rows, self.seq_len = rows, rows.num_rows, rows.seq_len

    def examples(self, row_ids, step):
        return self.rows.examples(row_ids, step)

    def raw_example(self, row_id, step):
        return self.rows.raw_example(row_id, step)

    def supervised_counts(self, row_ids, step):
        counts = self.rows.supervised_counts(row_ids, step)
        return counts + 1 if step == 2 else counts


def build(data_config, *, model_vocab_size, seed):
    rows = make_rows([bytes(range(40, 120))] * 8, seq_len=8)
    train = CountsWrongAtStep2(rows)
    return data_from_custom_rows(data_config.source, train, None, fingerprint=row_fingerprint(rows), vocab_size=256)


register_data("wrong-at-step-2", build)
"""


def test_a_data_error_in_the_step_built_ahead_surfaces_in_its_own_step_after_the_one_before_is_kept(
    tmp_path, capsys, monkeypatch
):
    """Step 2's micro-batches are built during step 1 and their check fails there. The error must wait for step 2:
    step 1 is logged and checkpointed first (a resume after fixing the data loses nothing), then one line naming
    step 2, exit 2. Raised where it was found, step 1 would be lost with it."""
    (tmp_path / "prefetch_fork.py").write_text(WRONG_AT_STEP_2)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = {
        "data.source": "prefetch_fork:wrong-at-step-2",
        "data.seq_len": 8,
        "run.max_steps": 5,
        "run.checkpoint_every": 1,
        "run.log_every": 1,
        "run.eval_every": 0,
        "run.sample_bytes": 0,
    }
    try:
        status = train.main(tiny_settings(tmp_path, tmp_path, **settings))
    finally:
        sys.modules.pop("prefetch_fork", None)
    error = capsys.readouterr().err
    assert status == 2
    assert error.count("\n") == 1 and error.startswith("error: step 2: the labels of row "), error
    run_dir = tmp_path / "runs" / "default"
    assert [line["steps"] for line in read_metrics(run_dir)] == [1, 2]
    assert checkpoint(run_dir, 2)["counters"]["steps"] == 2
    assert not (run_dir / "checkpoints" / "step_000003.pt").exists()
