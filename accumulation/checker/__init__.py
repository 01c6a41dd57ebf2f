"""The equivalence checker: that one optimizer step of the loop follows the gradient of the full-batch mean
loss, and that the fork keeps the promises the step relies on.

For anyone who changed the model, the loss, the data or the step: run it with the config you train with,
from the command line or from a fork's own tests:

    python scripts/checks/check_equivalence.py [--config FILE] [section.key=value ...] [--inject-bug BUG] [--step S]
    torchrun --standalone --nproc_per_node=N scripts/checks/check_equivalence.py [same arguments]

The loop side is one optimizer step exactly as train.py runs it: what `build_training` (accumulation/run/build.py,
train.py's own assembly) builds from the config around the model from `build_model` (the loss, the wrapper, the
strategy, the scaler, optim.grad_clip, batch.on_oom's retry), the rows of step 0 as `step_batch` builds them for
train.py (the step's row ids, the rows as step 0 sees them, this rank's A micro-batches of m rows), and the step
with `global_counts`, N summed from the data's `supervised_counts`, as train.py passes it. The gradient is read
when the optimizer is handed it, i.e. after accumulation, DDP's all-reduce, unscaling and clipping (a fused
recording optimizer where the configured one is fused, so that the update is queued on the device as train.py's);
the reference is clipped by its own norm, and the norm before clipping is compared on a line of its own. One
setting is switched off, because no reference could reproduce it: dropout (its random masks): model.dropout, and
after every build each Dropout-family module's p, float attributes named like a dropout and a Hugging Face
config's *_pdrop / *_dropout (reference.switch_off_dropout); the model line says what was switched off.

The reference is computed independently, on rank 0 only. Its rows are rebuilt from the raw examples (each
row's input tokens and its targets, position by position: accumulation/data/rows.py, RawExample) with the
simplest possible code, not with the loop's batching or masking. Then one float64 forward and backward over
all of the step's rows at once, of the configured loss's SUM divided by the number of supervised targets N:
the mean loss of the whole global batch, which is what every update must follow. No micro-batches, no ranks,
no weighting of ours.

A step whose objective the data declares (objective(step) and normaliser(row_ids, step): a GRPO step of
accumulation/rl/on_policy.py, `--step 300` on configs/grpo.toml) is checked against that objective's definition
instead (objective_reference.py): the loop takes N in the declared unit, as train.py does; the reference rebuilds
each row's extras (advantage, old log-probabilities, group) from its raw example, takes every target's own loss
and aggregates them with the mode's explicit means over the whole step, counting N from the definition. Rows
sampled from the model (bind_policy) are sampled from the initial weights, the whole round on every rank.

The checks, one line each, each named when it fails and each independent of m, A and D where it can be:
    rows            every rank builds the step's rows twice: the same in both calls and on every rank (rows
                    are a pure function of (seed, step, row id))
    examples() vs the raw examples
                    inputs and labels position by position; names the first differing row and position, and a
                    shift: labels shifted twice (label j holds token j + 2) or not at all (label j = input j)
    extras of examples() vs the raw examples
                    each extra both state (advantages, old log-probabilities), row by row; n/a without extras
    supervised_counts vs the raw examples' targets, and vs the labels of examples() on every rank (the check
                    train.py makes every step), row by row
    forward deterministic
                    two identical forwards of the step's rows agree (train mode, float64): randomness left in
                    the forward (not a Dropout module) fails it, "not deterministic between two identical forwards"
    rows independent
                    in train mode, the step's rows at once and in two halves give the same outputs (float64);
                    names the BatchNorm-like modules when they do not, the randomness when two identical
                    forwards already differ
    loss_sum_fn is a sum
                    on fixed outputs (the model's, computed once): its value over the step's rows equals the sum of
                    its values over two halves; when it does not, says whether it is a mean (return the SUM) or
                    couples examples (in-batch negatives: no accumulation can reproduce it); a loss that computes
                    in float32 whatever its inputs gets a precision note, not a failure
    loss pairs label j with output j
                    one label kept, the gradient of the loss must land on output j: a loss that shifts labels
                    that arrive shifted (HF's loss_function) reads output j - 1, which no gradient comparison sees;
                    "n/a" and why where there is no position to pair (one label per example: labels [rows]); the
                    label judged is one whose loss alone has a gradient (not a row of advantage 0, a clipped ratio)
    loss leaves the positions labelled -100 out
                    on fixed outputs, noise added only where the label is -100: no row's loss may move. One that
                    supervises them (labels.clamp(min=0) then a sum: padding and prompts trained as token 0) passes
                    every other check, since loop and reference call the same loss and rows split with their padding
    pipeline stages compute the forward
                    with dist.pipeline_stages > 1: the stages of pipeline_split, run one after another, give the
                    model's forward (float64); the loop trains the stages and the reference the forward
    examples, supervised targets, normaliser, loss, gradient
                    the loop's step against the float64 reference, each beside the same step without accumulation
                    (A = 1, D = 1, one batch of all the step's rows, in the loop's precision): an error at that
                    floor is the model's rounding, one above it the accumulation's; the floor widens the
                    allowed error to 4 times itself, never past run.ROUNDING_FLOOR_CAP; the normaliser line
                    names N and its unit on both sides, the reference's counted from the objective's definition
The header also says which loss path the loop ran (plain or chunked, compiled or eager) and which the reference,
and, for a model with frozen parameters (requires_grad off: LoRA's base, a frozen embedding), how many parameters
train and are compared and how many are frozen: those have no gradient, and no check reads them. A promise that
fails explains the loss and gradient lines after it (they name it, not "accumulation, not rounding"); extras that
disagree between examples() and the raw examples stop the check before the loss is run on them.

What a PASS proves: for this config's model, loss, data and batch split (m, A, D), the step's gradient and logged
loss equal the full-batch ones within the precision's tolerance, every rank starts from the same weights, the step
saw the same examples and supervised tokens as the reference, and the promises above hold for the step checked
(step 0 unless --step says). What it does not: anything about dropout, TF32, other steps or trained weights,
the optimizer's update rule, or the correctness of the loss function itself (the reference uses the same loss; it
checks how the loop weights and masks it).

--inject-bug puts a known bug in and must FAIL: in the loop (mean-of-means, mask, wrong-normaliser) or in the
fork's data (count, count-rows, supervise-all, rank-mask on 2 ranks), loss (mean-loss, in-batch-negatives,
double-shift) or model (batch-norm), or with dist.pipeline_stages > 1 in the schedule (scale-grads: PyTorch's
default scale_grads=True); see INJECTABLE_BUGS. Each one's FAIL line names it. A bug the data cannot show is
refused (exit 2, one line) rather than passed: mean-of-means where every micro-batch holds the same number of
targets (one label per row, packed rows, A·D = 1), mask without prompts, rank-mask on rows that do not change with
the step, wrong-normaliser where N's unit is the targets; so is a GRPO step whose every advantage is 0 (no
gradient).

Under torchrun every rank exits with the verdict's status, and each leaves the first failing line in
torchrun's error file, so that torchrun's closing failure summary names the check rather than how to enable
tracebacks (torchrun prints that summary after any non-zero exit; no worker can stop it).

Exit status: 0 PASS, 1 FAIL, 2 bad config or data (one line on stderr).

From Python (a fork's own test, one process; under torchrun every rank calls it):

    from accumulation.checker import main
    assert main(["--config", "configs/mine.toml", "model.n_layer=1"]) == 0

main(argv) returns the exit status and prints the lines above on rank 0. The single checks are functions of
plain tensors, for a test that wants one alone: accumulation.checker.promises (row_independence_message(model,
inputs), additivity_message(loss_sum_fn, outputs, labels), labels_message(...), counts_message(...)) and
accumulation.checker.reference (reference_rows(rows, row_ids, step, seq_len), max_relative_error).

The pieces: run.py (the command, the verdict and the loop's step: loop_step_gradients is where a layout whose step
is not optimizer_step over one wrapped model, such as pipeline stages, plugs in), reference.py (the float64
reference, the A = 1, D = 1 baseline and the gradient probe), objective_reference.py (the reference of a declared
objective), promises.py (the fork's promises, one function each), self_test.py (the injectable bugs).
"""

from accumulation.checker.reference import max_relative_error, reference_rows
from accumulation.checker.run import RELATIVE_TOLERANCE, check, main
from accumulation.checker.self_test import INJECTABLE_BUGS

__all__ = ["INJECTABLE_BUGS", "RELATIVE_TOLERANCE", "check", "main", "max_relative_error", "reference_rows"]
