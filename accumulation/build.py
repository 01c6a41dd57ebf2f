"""What train.py and the scripts derive from a Config in the same way: the checks that need the world size,
the optimizer, the autocast dtype, and the module the optimizer step runs. The model itself is built by
accumulation/models.py."""

import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import accumulation_steps
from accumulation.config import Config, ConfigError
from accumulation.distributed import DistributedContext
from accumulation.fsdp import check_strategy_for_world, shard_model

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_config_for_world(config: Config, world_size: int) -> None:
    """The config checks that depend on the launch: A = G / (m·D) must be whole, and cuda must exist if asked for."""
    try:
        accumulation_steps(config.batch.global_batch_size, config.batch.micro_batch_size, world_size)
    except ValueError as error:
        raise ConfigError(f"batch.micro_batch_size / batch.global_batch_size: {error}") from None
    check_device_available(config)
    check_strategy_for_world(config, world_size)


def check_device_available(config: Config) -> None:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('device: "cuda" was asked for but no CUDA device is available; use device=auto or device=cpu')


def autocast_dtype_for(config: Config) -> torch.dtype | None:
    """The dtype autocast runs matrix products in; None for plain fp32. Parameters and gradients stay fp32."""
    return AUTOCAST_DTYPES[config.precision.dtype]


def build_optimizer(config: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """Weight decay on matrices only; biases and the norms' gains (everything one-dimensional) do not decay."""
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    not_decayed = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": config.optim.weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    if config.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=config.optim.lr, momentum=config.optim.momentum)
    betas = (config.optim.momentum, config.optim.beta2)
    return torch.optim.AdamW(groups, lr=config.optim.lr, betas=betas, fused=device.type == "cuda")


def wrap_for_training(model: torch.nn.Module, config: Config, context: DistributedContext) -> torch.nn.Module:
    """The module the step runs, as train.py runs it: torch.compile first when model.compile is set, then
    DistributedDataParallel over more than one rank (compiled inside DDP, optimizer_step's no_sync still
    skips the all-reduce of every micro-batch but the last). Checkpoints hold the unwrapped `model`. With
    dist.strategy = "fsdp2" the model is sharded in place instead (accumulation/fsdp.py): build the optimizer
    after this call."""
    if config.dist.strategy == "fsdp2":
        return shard_model(model, config, context)
    wrapped = torch.compile(model) if config.model.compile else model
    if context.world_size == 1:
        return wrapped
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return DistributedDataParallel(wrapped, device_ids=device_ids)
