"""The student's checker: `python -m pytest scripts/teaching/exercises` runs the eight coding exercises as
they stand in this folder. Each test fails until its exercise is fixed (docs/exercises.md, 11 to 15 and 20 to
22)."""

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


def test_token_mean():
    checks.check_token_mean(token_mean.accumulate)


def test_scaler_order():
    checks.check_scaler_order(scaler_order.update)


def test_schedule_clock():
    checks.check_schedule_clock(schedule_clock.train)


def test_two_ranks():
    checks.check_two_ranks(two_ranks.accumulate)


def test_adam_eps():
    checks.check_adam_eps(adam_eps.update)


def test_pipeline_recipe():
    checks_frontier.check_pipeline_recipe(pipeline_recipe.make_schedule)


def test_fsdp_switches():
    checks_frontier.check_fsdp_switches(fsdp_switches.accumulate)


def test_sequence_mean():
    checks_frontier.check_sequence_mean(sequence_mean.accumulate)
