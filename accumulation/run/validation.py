"""The validation loss: the same token-weighted mean as training's objective, over the validation rows."""

import torch
import torch.distributed as dist

from accumulation.batching import all_reduce_ints, count_supervised_tokens
from accumulation.config.config import Config
from accumulation.data.sources import Data, eval_micro_batches
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.build import Training, autocast_dtype_for


@torch.no_grad()
def validation_loss(
    training: Training, data: Data, config: Config, context: DistributedContext, micro_batch_size: int
) -> float:
    """Token-weighted mean loss over the validation rows: sums of token losses and token counts are added over
    every micro-batch and replica, then divided once (the same weighting as training). The forward and loss are
    training's (Training.evaluation: model.loss as training decided it, uncompiled; the chunked loss keeps a
    micro-batch's logits out of memory here too). `micro_batch_size` is the loop's current m; the value does not
    depend on it when the model treats each row alone in eval mode and the loss is a sum over targets
    (docs/forking.md, "What no loop can make exact"). With pipeline stages the rows go forward through the
    stages; only last stages add loss sums, and the first stage of each replica counts its targets."""
    autocast_dtype = autocast_dtype_for(config.precision)
    own_rows = eval_micro_batches(data.val, micro_batch_size, context.replicas, context.replica)
    if training.pipeline is not None:
        from accumulation.parallel.pipeline import pipelined_loss_sum

        loss_sum, tokens = pipelined_loss_sum(training.pipeline, own_rows, autocast_dtype)
        tokens = tokens if context.layout.is_first_stage else 0
    else:
        training.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=context.device)
        tokens = 0
        forward_module, loss_sum_fn = training.evaluation
        for micro_batch in own_rows:
            with torch.autocast(context.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                batch = micro_batch.to(context.device)
                loss_sum += loss_sum_fn(forward_module(batch.inputs), batch.labels, **batch.extras)
            tokens += count_supervised_tokens(micro_batch.labels)
        training.model.train()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    [tokens_global] = all_reduce_ints([tokens], context.device)
    return loss_sum.item() / max(tokens_global, 1)
