"""The student's checker: `python -m pytest scripts/teaching/exercises` runs the three coding exercises as
they stand in this folder. Each test fails until its exercise is fixed (docs/exercises.md, 11 to 13)."""

from scripts.teaching.exercises import checks, scaler_order, schedule_clock, token_mean


def test_token_mean():
    checks.check_token_mean(token_mean.accumulate)


def test_scaler_order():
    checks.check_scaler_order(scaler_order.update)


def test_schedule_clock():
    checks.check_schedule_clock(schedule_clock.train)
