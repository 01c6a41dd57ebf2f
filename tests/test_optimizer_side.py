"""scripts/teaching/optimizer_side.py, the guide's chapter on the optimizer's side of accumulation, at a tiny
size: the distances that A micro-steps move against one accumulated step, and the classic `loss / A` against
the token-weighted loss, exact on packed rows and at A = 1, off on variable-length rows."""

from scripts.teaching import optimizer_side


def test_micro_steps_move_the_weights_about_a_times_as_far_as_one_accumulated_step():
    ratios = optimizer_side.distances(accumulations=(4,))
    # SGD: each micro-batch's gradient estimates the same gradient, so 4 micro-steps go nearly 4 times as
    # far (less only where the estimates disagree); the script prints 3.94 at this A.
    assert 3.0 < ratios["sgd A=4"] < 4.0 + 1e-9
    # Adam moves each weight by about lr per update on a fresh state: more than one step's distance, at
    # most about A of them (the script prints 3.67).
    assert 1.5 < ratios["adam A=4"] < 4.4


def test_the_classic_loss_is_exact_on_packed_rows_and_at_a_equals_1_and_off_otherwise():
    results = optimizer_side.classic_against_token_weighted(steps=3, accumulations=(1, 4))
    # Float64, 3 updates: the same terms in another order differ by about 1e-16 relative per operation.
    for exact in ("variable-length A=1", "packed A=1", "packed A=4"):
        assert results[exact]["largest_curve_difference"] < 1e-12, exact
    # Variable-length rows, A = 4: the mean of micro-batch means weights tokens unequally; the curves part
    # from the second update on (the script prints 6.0e-04 over 40 updates).
    assert results["variable-length A=4"]["largest_curve_difference"] > 1e-6
