"""The coding exercises of docs/exercises.md (11 to 15, 20 to 22): the checker fails on the broken code the student is
given, and passes on the solution printed in docs/exercises_key.md, run exactly as printed there."""

import re
from pathlib import Path

import pytest

from scripts.teaching.exercises import (
    adam_eps,
    checks,
    checks_frontier,
    fsdp_switches,
    pipeline_recipe,
    scaler_order,
    schedule_clock,
    sequence_mean,
    token_mean,
    two_ranks,
)

REPO = Path(__file__).resolve().parent.parent
# exercise -> (the checker, the student's module as given, the name of the function the student fixes)
EXERCISES = {
    "token_mean": (checks.check_token_mean, token_mean, "accumulate"),
    "scaler_order": (checks.check_scaler_order, scaler_order, "update"),
    "schedule_clock": (checks.check_schedule_clock, schedule_clock, "train"),
    "two_ranks": (checks.check_two_ranks, two_ranks, "accumulate"),
    "adam_eps": (checks.check_adam_eps, adam_eps, "update"),
    "pipeline_recipe": (checks_frontier.check_pipeline_recipe, pipeline_recipe, "make_schedule"),
    "fsdp_switches": (checks_frontier.check_fsdp_switches, fsdp_switches, "accumulate"),
    "sequence_mean": (checks_frontier.check_sequence_mean, sequence_mean, "accumulate"),
}


def key_solution(name: str):
    """The function of the key's code block that starts with `# key: <name>`, executed as a module."""
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(rf"```python\n(# key: {name}\n.*?)```", key, flags=re.DOTALL)
    namespace = {}
    exec(compile(source, f"exercises_key.md:{name}", "exec"), namespace)
    return namespace[EXERCISES[name][2]]


# The given schedule_clock steps the scheduler before the optimizer: PyTorch warns about that very mistake.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("name", EXERCISES)
def test_the_checker_fails_on_the_given_code(name):
    check, module, function = EXERCISES[name]
    with pytest.raises(AssertionError):
        check(getattr(module, function))


@pytest.mark.parametrize("name", EXERCISES)
def test_the_checker_passes_on_the_keys_solution(name):
    check, _, _ = EXERCISES[name]
    check(key_solution(name))


# Exercise 12's checker must see each way a loop mishandles the GradScaler, not only the given mistake:
# each variant is the key's solution with one edit, and each must fail.
SCALER_MISTAKES = {
    "no GradScaler at all": [
        ("scaler.scale(loss_sum / tokens).backward()", "(loss_sum / tokens).backward()"),
        ("    scaler.unscale_(optimizer)", "    pass  #"),
        ("scaler.step(optimizer)", "optimizer.step()"),
        ("    scaler.update()", "    pass  #"),
    ],
    "scaler.update() omitted": [("    scaler.update()", "    pass  #")],
    "optimizer.step() instead of scaler.step()": [("scaler.step(optimizer)", "optimizer.step()")],
    "scheduler stepped after a skipped update": [("    if torch.isfinite(grad_norm):", "    if True:")],
}


# A skipped update followed by scheduler.step(): PyTorch warns about that very mistake.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("mistake", SCALER_MISTAKES)
def test_the_scaler_checker_fails_on_each_scaler_mistake(mistake):
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(r"```python\n(# key: scaler_order\n.*?)```", key, flags=re.DOTALL)
    for old, new in SCALER_MISTAKES[mistake]:
        assert old in source, f"the key no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, f"exercises_key.md:scaler_order ({mistake})", "exec"), namespace)
    with pytest.raises(AssertionError):
        checks.check_scaler_order(namespace["update"])


# Exercise 12 has a second right answer: clip the still-scaled gradient at s · max_norm and let scaler.step
# unscale. It differs from the key only by where clip_grad_norm_'s eps of 1e-6 meets the norm, and must pass.
def test_the_scaler_checker_passes_on_the_clip_of_the_scaled_gradient():
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(r"```python\n(# key: scaler_order\n.*?)```", key, flags=re.DOTALL)
    edits = [
        ("    scaler.unscale_(optimizer)", "    pass  #"),
        (
            "clip_grad_norm_(model.parameters(), max_norm)",
            "clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())",
        ),
    ]
    for old, new in edits:
        assert old in source, f"the key no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, "exercises_key.md:scaler_order (clip at s · max_norm)", "exec"), namespace)
    checks.check_scaler_order(namespace["update"])


# Exercise 13's checker must see an optimizer step on the empty step, not only the schedule: this answer
# backpropagates the empty step's zero loss (guarded against 0 / 0) and steps AdamW, whose momentum and
# weight decay then move the weights, while it keeps the schedule right.
def test_the_schedule_checker_fails_on_an_update_from_the_empty_step():
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(r"```python\n(# key: schedule_clock\n.*?)```", key, flags=re.DOTALL)
    edits = [
        ("        if tokens == 0:\n            continue", "        if False:\n            pass"),
        ("(loss_sum / tokens).backward()", "(loss_sum / max(tokens, 1)).backward()"),
        ("        scheduler.step()", "        if tokens > 0:\n            scheduler.step()"),
    ]
    for old, new in edits:
        assert old in source, f"the key no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, "exercises_key.md:schedule_clock (update on the empty step)", "exec"), namespace)
    with pytest.raises(AssertionError, match="empty step"):
        checks.check_schedule_clock(namespace["train"])


# Exercise 14's checker sees each half of the exercise on its own: the key with the × D dropped (the
# gradient is off by 1/2), and the key with no_sync dropped (the gradient is right, the bytes are 4 times).
TWO_RANK_MISTAKES = {
    "× D forgotten": ("(loss_sum * ranks / tokens)", "(loss_sum / tokens)"),
    "no no_sync": (
        "with model.no_sync() if k != last else contextlib.nullcontext():",
        "with contextlib.nullcontext():",
    ),
}


@pytest.mark.parametrize("mistake", TWO_RANK_MISTAKES)
def test_the_two_rank_checker_fails_on_each_half_of_the_exercise(mistake):
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(r"```python\n(# key: two_ranks\n.*?)```", key, flags=re.DOTALL)
    old, new = TWO_RANK_MISTAKES[mistake]
    assert old in source, f"the key no longer holds {old!r}"
    namespace = {}
    exec(compile(source.replace(old, new), f"exercises_key.md:two_ranks ({mistake})", "exec"), namespace)
    with pytest.raises(AssertionError, match="off by" if mistake == "× D forgotten" else "all-reduced"):
        checks.check_two_ranks(namespace["accumulate"])


# Exercises 20 to 22: each checker also fails on realistic wrong answers, each the key's solution with edits,
# and says why (the `match`).
FRONTIER_MISTAKES = {
    "pipeline_recipe": {
        "scale_grads left at its default": (
            [("loss_fn=loss_fn, scale_grads=False)", "loss_fn=loss_fn)")],
            "norm is 0.25 times",  # divided by A = 4 on top of N
        ),
        "× D forgotten": ([("return loss_sum * replicas / tokens", "return loss_sum / tokens")], "norm is 0.5 times"),
    },
    "fsdp_switches": {
        "only the gradient sync switch": (
            [("        model.set_reshard_after_backward(k == last)", "        pass  #")],
            "all-gathered 8 times",
        ),
        "reshard never turned back on": (
            [("model.set_reshard_after_backward(k == last)", "model.set_reshard_after_backward(False)")],
            "still gathered",
        ),
        "× D forgotten": ([("(loss_sum * ranks / tokens)", "(loss_sum / tokens)")], "gradient off by 0.5"),
    },
    "sequence_mean": {
        "the step's token mean (DAPO)": (
            [
                (
                    "((token_losses.sum(dim=1) / lengths).sum() / sequences)",
                    "(token_losses.sum() / sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches))",
                )
            ],
            "gradient off by",
        ),
        "the padded length for |o_i|": (
            [("lengths = (labels != IGNORE_INDEX).sum(dim=1)", "lengths = labels.shape[1]")],
            "gradient off by",
        ),
    },
}


@pytest.mark.parametrize(
    ("name", "mistake"), [(name, mistake) for name, mistakes in FRONTIER_MISTAKES.items() for mistake in mistakes]
)
def test_the_frontier_checkers_fail_on_realistic_wrong_answers(name, mistake):
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(rf"```python\n(# key: {name}\n.*?)```", key, flags=re.DOTALL)
    edits, message = FRONTIER_MISTAKES[name][mistake]
    for old, new in edits:
        assert old in source, f"the key no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, f"exercises_key.md:{name} ({mistake})", "exec"), namespace)
    check, _, function = EXERCISES[name]
    with pytest.raises(AssertionError, match=re.escape(message)):
        check(namespace[function])


# Exercise 15: in float64, dropping the loss scale gives the right Adam update, so the checker also reads .grad
# after the backwards, which must hold loss_scale times the true gradient. Each edit of the key must fail there.
ADAM_MISTAKES = {
    "the loss scale deleted": [
        ("(loss_sum / tokens * loss_scale).backward()", "(loss_sum / tokens).backward()"),
        ("        parameter.grad /= loss_scale", "        pass  #"),
    ],
    "the loss scaled and divided back before the backward": [
        ("(loss_sum / tokens * loss_scale).backward()", "(loss_sum / tokens * loss_scale / loss_scale).backward()"),
        ("        parameter.grad /= loss_scale", "        pass  #"),
    ],
}


@pytest.mark.parametrize("mistake", ADAM_MISTAKES)
def test_the_adam_checker_fails_when_the_loss_is_not_scaled(mistake):
    key = (REPO / "docs" / "exercises_key.md").read_text()
    [source] = re.findall(r"```python\n(# key: adam_eps\n.*?)```", key, flags=re.DOTALL)
    for old, new in ADAM_MISTAKES[mistake]:
        assert old in source, f"the key no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, f"exercises_key.md:adam_eps ({mistake})", "exec"), namespace)
    with pytest.raises(AssertionError, match=re.escape(".grad after the backwards is off by")):
        checks.check_adam_eps(namespace["update"])
