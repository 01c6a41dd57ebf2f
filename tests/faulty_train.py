"""train.py with an injected fault, for tests/test_disrupted_runs.py only: the real program, killed or stalled
at a chosen point of a chosen torchrun attempt, so that a test can check what survives.

    ACCUMULATION_FAULTS='[{"attempt": 0, "rank": 1, "kill_before_micro_batch": [3, 1]}]' \
        torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m tests.faulty_train [train.py arguments]

Each fault names the attempt it strikes (torchrun's TORCHELASTIC_RESTART_COUNT: 0 first, then 1 after the
first restart, ...; or "any" for the first attempt that reaches it, once: a fault already in the fault log is
not repeated), the rank, and one of
    "kill_before_micro_batch": [S, K]   SIGKILL just before the forward of micro-batch K (from 0) of step S
    "kill_before_rename": S             SIGKILL while the checkpoint of step S is saved: its temporary file is
                                        complete, the rename that would publish it has not happened
    "hang_at_step": S                   sleep instead of running step S, as a stuck rank does
    "raise_at_step": S                  raise a RuntimeError (a bug) instead of running step S
    "signal_before_micro_batch": [S, K, NAME, TO]
                                        send signal NAME ("SIGTERM", "SIGUSR1") just before the forward of
                                        micro-batch K of step S, TO "self" (this rank) or "agent" (torchrun's
                                        agent, which passes SIGTERM on to every worker); the forward waits
                                        until this rank has received its signal, so the stop lands in step S
    "signal_during_save": [S, NAME]     send signal NAME to this rank while the checkpoint of step S is saved
                                        (its temporary file complete, not yet renamed), then let the save go on
    "sleep_before_start": SECONDS       sleep before train.py starts: this rank is the slowest to start up
Steps count from 1, as in metrics.jsonl. Just before striking, the fault is appended as one JSON line to the
file named by ACCUMULATION_FAULT_LOG, so that a test can check it really fired. With ACCUMULATION_STEP_LOG
set, rank 0 appends the number of every step it completes to that file (scripts/checks/chaos_soak.py counts the
steps that faults made it run again).

train.py itself is not changed: three functions it imports, and the stop signals' handler, are wrapped
before it runs as __main__.
"""

import json
import os
import runpy
import signal
import time
from pathlib import Path

import accumulation.data.sources
import accumulation.run.checkpoint
import accumulation.run.signals
import accumulation.step

TRAIN_PY = Path(__file__).resolve().parent.parent / "train.py"


def this_process_fault() -> dict:
    """The faults for this attempt and rank, merged into one dict (of different kinds); empty when none."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    mine = [fault for fault in json.loads(os.environ.get("ACCUMULATION_FAULTS", "[]")) if fault["rank"] == rank]
    pending = [fault for fault in mine if fault["attempt"] == "any" and not fired(fault)]
    merged = {}
    for fault in [fault for fault in mine if fault["attempt"] == attempt] + pending[:1]:  # "any": the next one only
        merged.update(fault)
    return merged


def fired(fault: dict) -> bool:
    """Whether the fault log already holds `fault` (it struck in an earlier attempt)."""
    path = Path(os.environ.get("ACCUMULATION_FAULT_LOG", "/nonexistent"))
    logged = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return any(all(entry.get(key) == value for key, value in fault.items()) for entry in logged)


def log_fault(fault: dict, **observed) -> None:
    with open(os.environ["ACCUMULATION_FAULT_LOG"], "a") as log:
        log.write(json.dumps({**fault, **observed, "unix_time": time.time()}) + "\n")


def kill_this_process(fault: dict, **observed) -> None:
    log_fault(fault, **observed)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind, as when a node loses power


def send_signal(fault: dict, name: str, to: str = "self") -> None:
    log_fault(fault)
    os.kill(os.getppid() if to == "agent" else os.getpid(), getattr(signal, name))


def send_signal_and_wait_for_it(fault: dict, name: str, to: str) -> None:
    """Send the signal, then wait until this rank's handler has run: the agent passes a signal on after a
    moment, and the test must know in which step the stop lands."""
    send_signal(fault, name, to)
    deadline = time.monotonic() + 30
    while not stop_signal_received and time.monotonic() < deadline:
        time.sleep(0.01)  # a signal interrupts the sleep, and its handler runs in this thread


stop_signal_received = False
real_handle = accumulation.run.signals.StopRequest._handle


def handle_and_note(stop_request, signum, frame):
    global stop_signal_received
    stop_signal_received = True
    real_handle(stop_request, signum, frame)


FAULT = this_process_fault()
STEP_LOG = os.environ.get("ACCUMULATION_STEP_LOG")
real_optimizer_step = accumulation.step.optimizer_step
real_step_row_ids = accumulation.data.sources.step_row_ids
real_save_checkpoint = accumulation.run.checkpoint.save_checkpoint
step_running = 0  # the step whose examples were fetched last, counted from 1: the one about to run


def step_row_ids_noting_the_step(num_rows, global_batch_size, seed, step, tail):
    global step_running
    step_running = step + 1
    return real_step_row_ids(num_rows, global_batch_size, seed, step, tail)


def optimizer_step_with_fault(setup, micro_batches, optimizer, **options):
    step = step_running
    if FAULT.get("hang_at_step") == step:
        log_fault(FAULT)
        # A stuck rank never reaches the step boundary where a stop request is acted on, so with train.py's
        # handler it dies only of the agent's SIGKILL 30 s after the SIGTERM (docs/faults.md, "Preemption"). The tests
        # need not wait for that: SIGTERM's default action ends this one at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(3600)  # the other ranks wait for this one in their next collective
    if FAULT.get("raise_at_step") == step:
        log_fault(FAULT)
        raise RuntimeError(f"injected failure at step {step}")
    hook = None
    strike = None
    if FAULT.get("kill_before_micro_batch", [None])[0] == step:
        victim = FAULT["kill_before_micro_batch"][1]

        def strike():
            kill_this_process(FAULT)

    if FAULT.get("signal_before_micro_batch", [None])[0] == step:
        _, victim, name, to = FAULT["signal_before_micro_batch"]

        def strike():
            send_signal_and_wait_for_it(FAULT, name, to)

    if strike is not None:
        forwards_started = 0

        def before_forward(module, inputs):
            nonlocal forwards_started
            if forwards_started == victim:  # the micro-batches before it have run forward and backward
                strike()
            forwards_started += 1

        hook = setup.module.register_forward_pre_hook(before_forward)
    try:
        result = real_optimizer_step(setup, micro_batches, optimizer, **options)
    finally:
        if hook is not None:
            hook.remove()
    if STEP_LOG and int(os.environ.get("RANK", "0")) == 0:
        with open(STEP_LOG, "a") as log:
            log.write(f"{step}\n")
    return result


def save_checkpoint_with_fault(payload, checkpoint_dir, steps, keep):
    if FAULT.get("kill_before_rename") == steps:
        # The first os.replace of a save publishes the complete temporary file of the step: die instead.
        def replace(source, destination):
            kill_this_process(FAULT, unpublished=Path(source).name, unpublished_bytes=os.path.getsize(source))

        os.replace = replace
    if FAULT.get("signal_during_save", [None])[0] == steps:
        real_replace = os.replace

        def replace_after_signal(source, destination):
            os.replace = real_replace  # once: the save's first rename
            send_signal(FAULT, FAULT["signal_during_save"][1])
            real_replace(source, destination)

        os.replace = replace_after_signal
    return real_save_checkpoint(payload, checkpoint_dir, steps, keep)


if "sleep_before_start" in FAULT:
    log_fault(FAULT)
    time.sleep(FAULT["sleep_before_start"])

# train.py binds these names when it is imported, so they are replaced in their modules first.
accumulation.step.optimizer_step = optimizer_step_with_fault
accumulation.data.sources.step_row_ids = step_row_ids_noting_the_step
accumulation.run.checkpoint.save_checkpoint = save_checkpoint_with_fault
accumulation.run.signals.StopRequest._handle = handle_and_note
runpy.run_path(str(TRAIN_PY), run_name="__main__")
