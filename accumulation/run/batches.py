"""Each step's micro-batches, built on the host one step ahead of the device (train.py's StepBatches)."""

from accumulation.batching import GlobalCounts, MicroBatch
from accumulation.config.config import Config
from accumulation.data.rows import row_hooks
from accumulation.data.sources import Data, DataError, check_supervised_counts, step_batch
from accumulation.parallel.distributed import DistributedContext


class StepBatches:
    """Each step's micro-batches, built one step ahead so that on a GPU the host builds, checks and pins them while
    the device computes (docs/data.md, "Built one step ahead")."""

    def __init__(self, config: Config, data: Data, context: DistributedContext) -> None:
        self.config, self.data, self.context = config, data, context
        self.built = {}  # (step, m) -> (micro-batches, global counts)

    def take(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        ready = self.built.pop((step, micro_batch_size), None)
        self.built.clear()
        return ready if ready is not None else self.micro_batches(step, micro_batch_size)

    def peek(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        """A step's micro-batches without taking them: built now (a DataError raises here) and kept for take()."""
        if (step, micro_batch_size) not in self.built:
            self.built[(step, micro_batch_size)] = self.micro_batches(step, micro_batch_size)
        return self.built[(step, micro_batch_size)]

    def build(self, step: int, micro_batch_size: int) -> None:
        # Rows sampled from the model at this step (RL rollouts, rl/on_policy.py) wait for the step before's update.
        if step >= self.config.run.max_steps or row_hooks(self.data.train).sampled_at(step):
            return
        try:
            self.built[(step, micro_batch_size)] = self.micro_batches(step, micro_batch_size)
        except DataError:
            pass  # raised again when that step takes its batch, after this step is logged and checkpointed

    def micro_batches(self, step: int, micro_batch_size: int) -> tuple[list[MicroBatch], GlobalCounts]:
        config, context = self.config, self.context
        # What each row holds at this step (a fresh mask) comes from the data. Every rank holds the whole step's
        # row ids and counts N on the host by itself: no collective, and nothing waits, before the forward.
        batch = step_batch(
            self.data.train,
            step,
            seed=config.run.seed,
            global_batch_size=config.batch.global_batch_size,
            tail=config.batch.tail,
            micro_batch_size=micro_batch_size,
            world_size=context.replicas,  # D: the stages of one replica run the same rows
            rank=context.replica,
        )
        check_supervised_counts(batch)
        micro_batches = batch.micro_batches
        if context.device.type == "cuda":  # page-locked host memory lets the copies run asynchronously
            micro_batches = [micro_batch.pinned() for micro_batch in micro_batches]
        return micro_batches, batch.global_counts  # N in the unit of the step's objective (data/sources.py)
