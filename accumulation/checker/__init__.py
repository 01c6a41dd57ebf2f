"""The equivalence checker: that one optimizer step of the loop follows the gradient of the full-batch mean
loss, and that the fork keeps the promises the step relies on.

For anyone who changed the model, the loss, the data or the step: run it with the config you train with,
from the command line or from a fork's own tests:

    python scripts/checks/check_equivalence.py [--config FILE] [section.key=value ...] [--inject-bug BUG]
    torchrun --standalone --nproc_per_node=N scripts/checks/check_equivalence.py [same arguments]

The loop side is one optimizer step exactly as train.py runs it: the model from `build_model` (the factory
train.py uses), the rows of step 0 as `step_batch` builds them for train.py (the step's row ids, the rows as
step 0 sees them, this rank's A micro-batches of m rows), and `optimizer_step` with the configured loss and
precision and with `global_counts`, N summed from the data's `supervised_counts`, as train.py passes it.
The gradient is read when the optimizer is handed it, i.e. after accumulation, DDP's all-reduce and
unscaling. Two settings are switched off, because no reference could reproduce them: gradient clipping
(it rescales the gradient by the step's own norm) and dropout (its random masks).

The reference is computed independently, on rank 0 only. Its rows are rebuilt from the raw examples (each
row's input tokens and its targets, position by position: accumulation/rows.py, RawExample) with the
simplest possible code, not with the loop's batching or masking. Then one float64 forward and backward over
all of the step's rows at once, of the configured loss's SUM divided by the number of supervised targets N:
the mean loss of the whole global batch, which is what every update must follow. No micro-batches, no ranks,
no weighting of ours.

The fork's promises, checked one by one and named when they fail (each independent of m, A and D):
    rows            every rank builds the step's rows twice: the same in both calls and on every rank (rows
                    are a pure function of (seed, step, row id))
    supervised_counts vs the raw examples' targets, and vs the labels of examples() on every rank (the check
                    train.py makes every step)
    loss_sum_fn     is a sum: its value over the step's rows equals the sum of its values over two halves (a
                    mean is not, and hides behind A·D = 1)

What a PASS proves: for this config's model, loss, data and batch split (m, A, D), the step's gradient and
logged loss equal the full-batch ones within the precision's tolerance, every rank starts from the same
weights, the step saw the same examples and supervised tokens as the reference, and the promises above
hold for step 0. What it does not: anything about clipping, dropout, later steps, the optimizer's update
rule, or the correctness of the loss function itself (the reference uses the same loss; it checks how the
loop weights and masks it).

--inject-bug puts a known bug in and must FAIL: in the loop (mean-of-means, mask) or in the fork's data or
loss (count, supervise-all, rank-mask on 2 ranks, mean-loss); see INJECTABLE_BUGS.

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).

From Python (a fork's own test, one process; under torchrun every rank calls it):

    from accumulation.checker import main
    assert main(["--config", "configs/mine.toml", "model.n_layer=1"]) == 0

The pieces: run.py (the command, the verdict and the loop's step), reference.py (the float64 reference and the
gradient probe), promises.py (the fork's promises, one function each), self_test.py (the injectable bugs).
"""

from accumulation.checker.reference import max_relative_error, reference_rows
from accumulation.checker.run import RELATIVE_TOLERANCE, check, main
from accumulation.checker.self_test import INJECTABLE_BUGS

__all__ = ["INJECTABLE_BUGS", "RELATIVE_TOLERANCE", "check", "main", "max_relative_error", "reference_rows"]
