"""The student's checker: `python -m pytest scripts/teaching/exercises` runs the five coding exercises as
they stand in this folder. Each test fails until its exercise is fixed (docs/exercises.md, 11 to 15)."""

from scripts.teaching.exercises import adam_eps, checks, scaler_order, schedule_clock, token_mean, two_ranks


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
