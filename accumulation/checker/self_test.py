"""The checker's self-test: known bugs it must FAIL on (`--inject-bug NAME`). SELF-TEST ONLY, every line.

The loss bugs wrap the configured loss and hand it the rows' extras as they come (a GRPO step's advantages, old
log-probabilities and row weights), so they apply to a loss that reads extras as to one that reads the labels alone.

Bugs in the loop only (the reference stays right) show that the comparison sees the loop go wrong; bugs a fork
makes in its data or loss (loop and reference both get them) show that the checks of the fork's promises see
them.
"""

import torch

from accumulation.batching import IGNORE_INDEX, all_reduce_ints, count_supervised_tokens, micro_batch_slices
from accumulation.checker.objective_reference import declared_objective
from accumulation.config.config import Config, ConfigError
from accumulation.data.rows import DataError, RawExample, Rows, RowSet, row_hooks
from accumulation.data.sources import StepBatch
from accumulation.parallel.distributed import DistributedContext

# Bugs in the loop only (the reference stays right): the checker must see the loop go wrong.
LOOP_BUGS = {
    "mean-of-means": "the loop weights every micro-batch equally (each micro-batch's mean loss)",
    "mask": "the loop supervises the prompt positions too (the prompt mask is ignored)",
    "wrong-normaliser": "the loop divides by the step's supervised targets, not by the N its objective declares "
    "(a GRPO sequence mean divided by the completion tokens)",
}
# Bugs a fork makes in its data or loss (loop and reference both get them): the checker's own tests of the
# fork's promises must catch them.
FORK_BUGS = {
    "count": "the data's supervised_counts promises one target more per row than its labels hold",
    "count-rows": "the data's supervised_counts moves a target from every second row to the row before (N is right)",
    "supervise-all": "the data's labels give every position a target (its own input token), not only the masked",
    "rank-mask": "the data's mask depends on the rank (each rank draws it as if at step + rank)",
    "mean-loss": "loss_sum_fn returns the mean over the micro-batch's targets, not their sum",
    "double-shift": "loss_sum_fn shifts the labels again (as HF's loss_function does), though they arrive shifted",
    "batch-norm": "the model normalises its outputs with a BatchNorm over the rows of each batch (train mode)",
    "in-batch-negatives": "loss_sum_fn adds a contrastive term whose negatives are the other rows of the batch",
}
# Of FORK_BUGS, those in the data's rows (BuggyRows), in the loss, and in the model.
DATA_BUGS = ("count", "count-rows", "supervise-all", "rank-mask")
LOSS_BUGS = ("mean-loss", "in-batch-negatives", "double-shift")
MODEL_BUGS = ("batch-norm",)
# A bug of the pipelined loop only (dist.pipeline_stages > 1).
PIPELINE_BUGS = {
    "scale-grads": "the pipeline schedule keeps PyTorch's default scale_grads=True, dividing the gradient by A again",
}
INJECTABLE_BUGS = {**LOOP_BUGS, **FORK_BUGS, **PIPELINE_BUGS}


def refuse_a_bug_this_data_cannot_show(
    bug: str | None, rows: Rows, row_ids: torch.Tensor, step: int, micro_batch_targets: list[int]
) -> None:
    """A DataError when the self-test's bug would change nothing on this data (so a PASS would mean nothing).
    micro_batch_targets: the supervised targets of each of the step's A·D micro-batches, every replica's."""
    if bug == "mean-of-means" and len(set(micro_batch_targets)) == 1:
        # Each micro-batch's mean times the average count is its sum when every count is the average.
        raise DataError(
            f"--inject-bug mean-of-means: n/a: every micro-batch holds the same number of targets "
            f"({micro_batch_targets[0]} in each of {len(micro_batch_targets)}), so the mean of means equals the "
            "global mean on these rows and no check can see the bug; run it on rows whose target counts differ "
            "(documents of different lengths, e.g. --config configs/sft.toml) with A·D > 1"
        )
    if bug == "mask":
        if not isinstance(rows, RowSet):
            raise DataError("--inject-bug mask rewrites a RowSet's prompt mask; this data's rows are not a RowSet")
        if torch.equal(every_real_target(rows)[row_ids], rows.supervised[row_ids]):
            raise DataError(
                "--inject-bug mask needs rows with prompt positions, and step 0 of this data has none; "
                "run it on prompt/response data, e.g. --config configs/sft.toml"
            )
    if bug in DATA_BUGS and declared_objective(rows, step) is not None:
        raise DataError(
            f"--inject-bug {bug} wraps the data's rows, which would hide the objective step {step} declares; run it "
            "on a step without one (e.g. an SFT step of configs/grpo.toml, --step 0)"
        )
    declared_unit = row_hooks(rows).normaliser(row_ids, step)[1]
    if bug == "wrong-normaliser" and declared_unit == "targets":
        raise DataError(
            "--inject-bug wrong-normaliser needs a step whose objective counts N in another unit than supervised "
            "targets, and this one does not; run it on a GRPO step, e.g. --config configs/grpo.toml --step 300"
        )
    if bug == "count-rows" and len(row_ids) % 2:
        raise DataError("--inject-bug count-rows keeps N right only for an even number of rows per step")
    if bug == "double-shift" and rows.examples(row_ids[:1], step)[1].dim() != 2:
        raise DataError("--inject-bug double-shift shifts labels along the positions; this data has one label per row")
    if bug == "rank-mask":
        at_first, at_second = rows.examples(row_ids, step), rows.examples(row_ids, step + 1)
        if all(torch.equal(a, b) for a, b in zip(at_first, at_second, strict=True)):
            raise DataError(
                "--inject-bug rank-mask needs rows that change with the step, and this data's do not; "
                "run it on masked-LM data, e.g. --config configs/mlm.toml"
            )


def check_bug_fits_the_layout(bug: str | None, config: Config) -> None:
    """A ConfigError for a self-test bug the layout cannot show: scale-grads needs pipeline stages, and the loop
    bugs rewrite optimizer_step's inputs, which the pipelined step does not run."""
    pipelined = config.dist.pipeline_stages > 1
    if bug in PIPELINE_BUGS and not pipelined:
        raise ConfigError(f"--inject-bug {bug} is a bug of the pipeline schedule: set dist.pipeline_stages > 1")
    if bug in LOOP_BUGS and pipelined:
        raise ConfigError(f"--inject-bug {bug} is a bug of optimizer_step: use dist.pipeline_stages = 1")


def targets_per_micro_batch(
    batch: StepBatch, global_batch_size: int, micro_batch_size: int, replicas: int
) -> list[int]:
    """The supervised targets of each micro-batch of the step, every replica's, from supervised_counts and the
    loop's layout (micro_batch_slices; a partial step's padding rows hold none)."""
    return [
        int(batch.supervised_counts[positions].sum())
        for replica in range(replicas)
        for positions in micro_batch_slices(global_batch_size, micro_batch_size, replicas, replica)
    ]


def every_real_target(rows: RowSet) -> torch.Tensor:
    """SELF-TEST ONLY: the supervision mask with the prompt forgotten: every target of the row's real tokens."""
    return torch.arange(rows.seq_len) < (rows.lengths[:, None].long() - 1)


def mean_of_means_loss(loss_sum_fn, micro_batches, context: DistributedContext):
    """SELF-TEST ONLY: the classic accumulation mistake as a loss. Each micro-batch backpropagates its MEAN
    loss, rescaled by the average token count per micro-batch so that the overall size of the gradient stays
    right: every micro-batch then weighs the same, whatever its token count, which is wrong whenever the
    counts differ. The step multiplies by D / N, so the gradient becomes that of the mean of micro-batch means."""
    [tokens_global] = all_reduce_ints([sum(count_supervised_tokens(mb.labels) for mb in micro_batches)], context.device)
    tokens_per_micro_batch = tokens_global / (len(micro_batches) * context.world_size)

    def micro_batch_mean_times_average_count(outputs: torch.Tensor, labels: torch.Tensor, **extras) -> torch.Tensor:
        tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)  # an empty micro-batch still adds exactly zero
        return loss_sum_fn(outputs, labels, **extras) / tokens * tokens_per_micro_batch

    return micro_batch_mean_times_average_count


def mean_loss(loss_sum_fn):
    """SELF-TEST ONLY: a fork's loss that returns the MEAN over the micro-batch's supervised targets."""

    def mean(outputs: torch.Tensor, labels: torch.Tensor, **extras) -> torch.Tensor:
        return loss_sum_fn(outputs, labels, **extras) / (labels != IGNORE_INDEX).sum().clamp(min=1)

    return mean


def in_batch_negatives_loss(loss_sum_fn):
    """SELF-TEST ONLY: a fork's loss with an InfoNCE term: each row's mean output is scored against every row's of
    the same batch, its own the positive, the others its negatives, as contrastive losses do. Each row's term
    reads the other rows, so the loss of a batch is not the sum of the losses of its parts."""

    def with_negatives(outputs: torch.Tensor, labels: torch.Tensor, **extras) -> torch.Tensor:
        # Each row's outputs averaged over its supervised positions: the bug couples rows, and reads no padding.
        supervised = (labels != IGNORE_INDEX).reshape(len(outputs), -1, 1).to(outputs.dtype)
        per_position = outputs.reshape(len(outputs), -1, outputs.shape[-1])
        pooled = (per_position * supervised).sum(dim=1) / supervised.sum(dim=1).clamp(min=1)  # [rows, classes]
        similarity = pooled @ pooled.T  # [rows, rows]: row i against every row of the batch
        own = torch.arange(len(outputs), device=outputs.device)
        contrastive = torch.nn.functional.cross_entropy(similarity, own, reduction="sum")
        targets_per_row = (labels != IGNORE_INDEX).sum() / len(outputs)  # on the scale of the token losses
        return loss_sum_fn(outputs, labels, **extras) + targets_per_row * contrastive

    return with_negatives


def shifted_again_loss(loss_sum_fn):
    """SELF-TEST ONLY: a fork's loss that shifts labels which arrive shifted already: output j is scored against
    label j + 1, i.e. token j + 2 (HF's loss_function with labels from our data). An extra given per position (a
    GRPO row's old log-probabilities, [rows, seq]) moves with its label; one per row stays."""

    def shifted_again(outputs: torch.Tensor, labels: torch.Tensor, **extras) -> torch.Tensor:
        per_position = {name: value[:, 1:] for name, value in extras.items() if value.shape[:2] == labels.shape}
        return loss_sum_fn(outputs[:, :-1], labels[:, 1:], **{**extras, **per_position})

    return shifted_again


class RowsNormalisedTogether(torch.nn.Module):
    """SELF-TEST ONLY: a fork's model whose outputs pass through a BatchNorm (no parameters of its own): in train
    mode each output feature is normalised by its mean and variance over the batch's rows and positions, so a
    row's outputs depend on the rows beside it."""

    def __init__(self, model: torch.nn.Module, features: int):
        super().__init__()
        self.model = model
        self.batch_norm = torch.nn.BatchNorm1d(features, affine=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.model(inputs)
        normalised = self.batch_norm(outputs.reshape(-1, outputs.shape[-1]).to(self.batch_norm.running_mean.dtype))
        return normalised.reshape(outputs.shape).to(outputs.dtype)


class BuggyRows:
    """SELF-TEST ONLY: a fork's data with one of FORK_BUGS, around the configured rows. Its raw examples are
    the data's own (what each row was meant to be); examples() and supervised_counts() carry the bug."""

    def __init__(self, rows: Rows, bug: str, rank: int):
        self.rows, self.bug, self.rank = rows, bug, rank
        self.num_rows, self.seq_len = rows.num_rows, rows.seq_len

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple:
        if self.bug == "rank-mask":  # a mask seeded with the rank: other masks on each rank for the same row
            return self.rows.examples(row_ids, step + self.rank)
        inputs, labels, *extras = self.rows.examples(row_ids, step)
        if self.bug == "supervise-all":
            labels = torch.where(labels == IGNORE_INDEX, inputs, labels)
        return inputs, labels, *extras

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        if self.bug == "rank-mask":
            return self.rows.supervised_counts(row_ids, step + self.rank)
        if self.bug == "count-rows":  # +1, -1, +1, -1, ...: every row's count wrong, their sum right for an even count
            counts = self.rows.supervised_counts(row_ids, step).clone()
            counts[0::2] += 1
            counts[1::2] -= 1
            return counts
        return self.rows.supervised_counts(row_ids, step) + (1 if self.bug == "count" else 0)

    def raw_example(self, row_id: int, step: int) -> RawExample:
        return self.rows.raw_example(row_id, step)
