"""What train.py, the checker and the scripts derive from a Config in the same way: the checks that need the world
size or the machine's memory, and `build_training`, the one assembly of everything a step needs (the model, its
loss, the module the step runs, the strategy, the optimizer, the schedule, the scaler and the step function)."""

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import accumulation_steps
from accumulation.config.config import (
    Config,
    ConfigError,
    DistConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    resolved_compile,
    resolved_grad_scaler,
)
from accumulation.data.memory import memory_limits
from accumulation.data.rows import DEFAULT_HOOKS, RowHooks
from accumulation.models.factory import (
    build_model,
    build_model_on_meta,
    builds_in_parts,
    count_parameters,
    decided_model_config,
    loss_sum_fn_for,
    training_forward_and_loss,
)
from accumulation.parallel.distributed import DistributedContext
from accumulation.run.checkpoint import seed_dropout
from accumulation.schedule import run_scheduler
from accumulation.step import DataParallel, StepSetup, Strategy, optimizer_step

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_config_for_world(config: Config, world_size: int) -> None:
    """The config checks that depend on the launch: world size = D × P, A = G / (m·D) must be whole, and cuda must
    exist if asked for."""
    if config.dist.pipeline_stages > 1:
        from accumulation.parallel.mesh import check_layout

        why_not = check_layout(world_size, config.dist.pipeline_stages)
        if why_not is not None:
            raise ConfigError(why_not)
    replicas = world_size // config.dist.pipeline_stages  # D
    try:
        accum = accumulation_steps(config.batch.global_batch_size, config.batch.micro_batch_size, replicas)
    except ValueError as error:
        raise ConfigError(f"batch.micro_batch_size / batch.global_batch_size: {error}") from None
    if config.dist.pipeline_stages > 1:
        from accumulation.parallel.pipeline import check_pipeline_settings

        check_pipeline_settings(config, accum)
    check_device_available(config)
    if config.dist.strategy == "fsdp2":
        from accumulation.parallel.fsdp import check_strategy_for_world

        check_strategy_for_world(config, world_size)


def check_device_available(config: Config) -> None:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('device: "cuda" was asked for but no CUDA device is available; use device=auto or device=cpu')


def autocast_dtype_for(precision: PrecisionConfig) -> torch.dtype | None:
    """The dtype autocast runs matrix products in; None for plain fp32. Parameters and gradients stay fp32."""
    return AUTOCAST_DTYPES[precision.dtype]


def build_optimizer(optim: OptimConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """Weight decay on matrices only; biases and the norms' gains (everything one-dimensional) do not decay."""
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    not_decayed = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": optim.weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
    betas = (optim.momentum, optim.beta2)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, fused=device.type == "cuda")


def wrap_for_training(
    model: torch.nn.Module,
    dist_config: DistConfig,
    context: DistributedContext,
    *,
    compile: bool,
    param_dtype: torch.dtype | None,
    whole_model: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """The module the step runs: `model` (training_forward_and_loss's module) compiled when `compile` is on, then
    in DistributedDataParallel over more than one rank (docs/performance.md). With dist.strategy = "fsdp2" the
    model is sharded in place instead (`whole_model`, the model `model` runs: itself, or the chunked loss's module of
    its hidden states), each of its units compiled when `compile` is on: build the optimizer after this call."""
    if dist_config.strategy == "fsdp2":  # param_dtype: autocast's dtype (autocast_dtype_for), the shards' compute dtype
        from accumulation.parallel.fsdp import shard_model

        shard_model(whole_model or model, context, param_dtype=param_dtype, compile_units=compile)
        return model
    wrapped = torch.compile(model) if compile else model
    if context.world_size == 1:
        return wrapped
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return DistributedDataParallel(wrapped, device_ids=device_ids)


@dataclass
class Training:
    """Everything the training section runs, built once (build_training). Two names for the model: `model` is the
    whole unwrapped model (checkpoints hold its state dict; under pipeline stages built by stages, the other stages'
    parameters on the meta device); `setup.module` is what optimizer_step runs, the model as
    training wraps it (compiled, in DDP, sharded by FSDP2, its loss inside it when compiled, or this rank's
    pipeline stage)."""

    model: torch.nn.Module
    model_config: ModelConfig  # config.model with model.loss decided ("plain" or "chunked")
    compiled: bool
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    setup: StepSetup  # the step's module, device, loss, scaler, clip, autocast dtype and strategy
    step: Callable  # optimizer_step, or with batch.on_oom = "shrink" its out-of-memory retry (same arguments)
    # What validation and the step-0 probe run: (the forward, its loss_sum_fn), training's model.loss uncompiled
    evaluation: tuple[torch.nn.Module, Callable]
    pipeline: object = None  # dist.pipeline_stages > 1: this rank's stage and the schedule (parallel/pipeline.py)


def build_training(
    config: Config,
    vocab_size: int,
    resume: dict | None,
    context: DistributedContext,
    *,
    model: torch.nn.Module | None = None,
    loss_sum_fn: Callable | None = None,
    hooks: RowHooks = DEFAULT_HOOKS,
) -> Training:
    """The model (with a resume's weights), the loss, the module the step runs, the strategy, the optimizer, the
    schedule, the scaler and the step function, as the config says. The checker hands in its own `model` (its
    dropout switched off) and, to test itself, a buggy `loss_sum_fn` in place of the configured one (run on the
    plain path, uncompiled). `hooks`: the training rows' (row_hooks), which hand the step its loss when it depends
    on them (RowHooks.loss_sum_fn: RL rollouts' declared objective)."""
    device = context.device
    whole_resume = resume is not None and "sharded" not in resume  # a ddp checkpoint's whole weights
    # fsdp2 or pipeline stages without whole weights to load: the model in shapes only (the meta device), then each
    # rank initialises its own shards (parallel/fsdp.py, initialise_shards) or its own stage (parallel/pipeline.py,
    # initialise_stage) to a one-process build's values; no rank holds the whole model.
    built_on_meta = False
    if model is None and (config.dist.strategy == "fsdp2" or context.pipelined) and not whole_resume:
        meta_model = build_model_on_meta(config.model, vocab_size, config.data.seq_len)
        if builds_in_parts(meta_model):
            model, built_on_meta = meta_model, True
    if model is None:  # the same initial weights on every rank
        model = build_model(config.model, vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    if not built_on_meta:
        model = model.to(device)
    # Dropout: a different stream on each rank, seeded after the build, so that a build that seeds the global
    # generator itself (Hugging Face's set_seed) cannot leave every rank on one stream.
    seed_dropout(config.run.seed, context.rank)
    if whole_resume:  # whole weights before sharding (sharded ones: restore.py)
        model.load_state_dict(resume["model"])
    compiled = resolved_compile(config, device.type) and loss_sum_fn is None
    if compiled and config.dist.strategy == "fsdp2":  # fsdp2 compiles the model's fsdp_units() (parallel/fsdp.py)
        from accumulation.parallel.fsdp import sharding_units

        compiled = bool(sharding_units(model))  # a model listing none (the GRU) runs eagerly: say so, not "on"
    # model.loss = "auto" decided on the run's device: plain on the CPU, by the GPU's free memory on CUDA
    # (accumulation/models/factory.py); the probe and validation use the same loss.
    model_config = decided_model_config(config, model, device)
    configured_loss_sum_fn = hooks.loss_sum_fn(loss_sum_fn_for(config.model))  # model.objective's, or the rows'
    if loss_sum_fn is None:
        evaluation = training_forward_and_loss(model_config, model, loss_sum_fn=configured_loss_sum_fn)
    else:  # the checker's self-test: its buggy loss on the plain path
        model_config, evaluation = replace(model_config, loss="plain"), (model, loss_sum_fn)
    autocast_dtype = autocast_dtype_for(config.precision)
    pipeline = None
    if context.pipelined:  # this rank's stage (in DDP over its replicas) and the schedule; the plain loss
        from accumulation.parallel.pipeline import build_pipeline, optimizer_order, stand_in_forward

        step_loss_sum_fn = loss_sum_fn or configured_loss_sum_fn
        if built_on_meta:  # step 0's probe: the loss on outputs of the model's shape (no rank can run it whole)
            meta_model = build_model_on_meta(config.model, vocab_size, config.data.seq_len)
            evaluation = (stand_in_forward(meta_model, device), evaluation[1])
        accum = config.batch.global_batch_size // (config.batch.micro_batch_size * context.replicas)
        schedule_name, initial_seed = config.dist.pipeline_schedule, config.run.seed if built_on_meta else None
        pipeline = build_pipeline(model, context.layout, device, step_loss_sum_fn, accum, schedule_name, initial_seed)
        # The optimizer over the stage's parameters alone; checkpoints number them as one over the whole model,
        # whose order an optimizer built over it gives (on the meta device: unfused, the other stages are shapes).
        optimizer = build_optimizer(config.optim, pipeline.stage_module, device)
        whole_optimizer = build_optimizer(config.optim, model, torch.device("meta"))
        pipeline.whole_order = optimizer_order(whole_optimizer, pipeline.names)
        module, strategy = pipeline.wrapped, pipeline
    else:
        if loss_sum_fn is None:  # fsdp2 compiles each of its units, not one region (parallel/fsdp.py, shard_model)
            one_region = compiled and config.dist.strategy != "fsdp2"
            forward_module, step_loss_sum_fn = training_forward_and_loss(
                model_config, model, compile=one_region, loss_sum_fn=configured_loss_sum_fn
            )
        else:
            forward_module, step_loss_sum_fn = evaluation
        # DistributedDataParallel over more than one rank, or (dist.strategy = "fsdp2") the model sharded in place,
        # its parameters then DTensor shards: the optimizer is built after this line, over what the step updates.
        module = wrap_for_training(
            forward_module, config.dist, context, compile=compiled, param_dtype=autocast_dtype, whole_model=model
        )
        if built_on_meta:
            from accumulation.parallel.fsdp import initialise_shards

            initialise_shards(model, device, config.run.seed)
        strategy = step_strategy(config, module, model)
        optimizer = build_optimizer(config.optim, model, device)
    scheduler = run_scheduler(optimizer, config.schedule, config.run.max_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=resolved_grad_scaler(config))
    setup = StepSetup(module, device, step_loss_sum_fn, scaler, config.optim.grad_clip, autocast_dtype, strategy)
    step = optimizer_step
    if config.batch.on_oom == "shrink":  # a step that runs out of memory is redone with fewer rows per micro-batch
        from accumulation.shrink_on_oom import optimizer_step_shrinking_on_oom as step
    set_tf32(config.precision.tf32)  # CUDA fp32 matrix products on tensor cores; nothing changes on the CPU
    return Training(model, model_config, compiled, optimizer, scheduler, setup, step, evaluation, pipeline)


def step_strategy(config: Config, module: torch.nn.Module, model: torch.nn.Module) -> Strategy:
    """How the step runs `module`'s micro-batches: FSDP2's under dist.strategy = "fsdp2", the out-of-memory retry's
    under batch.on_oom = "shrink", else DataParallel (one process, DDP)."""
    if config.dist.strategy == "fsdp2":
        from accumulation.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module, model)
    if config.batch.on_oom == "shrink":
        from accumulation.shrink_on_oom import ShrinkOnOutOfMemory

        return ShrinkOnOutOfMemory(module)
    return DataParallel(module)


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matrix products (cuBLAS) and convolutions (cuDNN) on CUDA: inputs rounded to a 10-bit mantissa,
    products accumulated in fp32; bf16/fp16 autocast regions and the CPU unchanged (docs/performance.md)."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def training_bytes_per_parameter(optim: OptimConfig) -> int:
    """Training memory per parameter at the least: the fp32 weight, its gradient and the optimizer's tensors shaped
    like it (AdamW's two moments, SGD's momentum buffer, none for SGD without momentum), 4 bytes each."""
    state_tensors = 2 if optim.name == "adamw" else int(optim.momentum > 0)
    return 4 * (2 + state_tensors)


def training_memory(config: Config) -> list[tuple[str, int, int]]:
    """Each limit the run trains under: (what sets it, its bytes, how many of the run's ranks share it). This rank's
    GPU is its own; on the CPU the machine's memory and its cgroup's limit are shared by the host's LOCAL_WORLD_SIZE
    ranks, while the address space `ulimit -v` leaves is each process's own (accumulation/data/memory.py)."""
    if config.device != "cpu" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return [("the GPU", torch.cuda.get_device_properties(local_rank).total_memory, 1)]
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return [(limit, limit_bytes, 1 if own else local_ranks) for limit_bytes, limit, own in memory_limits()]


def activation_bytes_at_least(config: Config, vocab_size: int, chunked_loss: bool) -> int:
    """A lower bound on the activations one micro-batch keeps for its backward: per token, each layer's
    output (d_model values) and, without the chunked loss, the logits and the cross-entropy's log-softmax
    (vocab_size values each). The true figure is several times larger (attention scores, the MLP's hidden
    layer, norms); a bound that low refuses only what cannot fit, never a run that could. 4 bytes a value
    in fp32, 2 under bf16/fp16 autocast (the logits stay 4: the loss is computed in fp32). With pipeline stages a
    rank runs only its stage, and the largest stage's weights may sit on a rank without the logits: what every
    rank keeps at least is the residual stream its stage receives or makes (one layer's output, d_model values)."""
    tokens = config.batch.micro_batch_size * config.data.seq_len
    value_bytes = 4 if config.precision.dtype == "fp32" else 2
    if config.dist.pipeline_stages > 1:
        return tokens * config.model.d_model * value_bytes
    per_token = config.model.n_layer * config.model.d_model * value_bytes
    if not chunked_loss:
        per_token += 2 * vocab_size * 4
    return tokens * per_token


def parameters_held(config: Config, model_on_meta: torch.nn.Module) -> int:
    """The weights one rank trains whole: the model's, or with dist.pipeline_stages > 1 its largest stage's (each
    rank holds one stage); a ConfigError when the model does not split into the stages asked for."""
    if config.dist.pipeline_stages == 1:
        return count_parameters(model_on_meta)
    from accumulation.parallel.pipeline import check_model_splits

    return max(count_parameters(stage) for stage in check_model_splits(model_on_meta, config))


def check_fits_in_memory(config: Config, parameters: int, vocab_size: int, chunked_loss: bool) -> None:
    """Refuse a model whose rank holds `parameters` weights (parameters_held), or a micro-batch, that cannot possibly
    train here, before anything is written (docs/training.md): lower bounds only. Each rank holds the training state
    (training_bytes_per_parameter; under fsdp2 1/D of it) and then the activations; a limit shared by several ranks
    must hold all of theirs."""
    per_parameter = training_bytes_per_parameter(config.optim)
    shards = int(os.environ.get("WORLD_SIZE", "1")) if config.dist.strategy == "fsdp2" else 1  # D
    state_bytes = per_parameter * parameters // shards
    limits = training_memory(config)
    for where, memory_bytes, ranks in limits:
        if ranks * state_bytes > memory_bytes:
            raise ConfigError(
                f"model.d_model / model.n_layer / data.seq_len: the {config.model.name} model has {parameters:,} "
                f"weights{' in its largest pipeline stage' if config.dist.pipeline_stages > 1 else ''} "
                f"and needs at least {ranks * state_bytes / 2**30:,.1f} GiB to train ({per_parameter} "
                f"bytes each with {config.optim.name}{f' over {shards} shards' if shards > 1 else ''}"
                f"{f'; the {ranks} ranks of this host share it' if ranks > 1 else ''}), more than the "
                f"{memory_bytes / 2**30:,.1f} GiB of {where}; choose a smaller model"
            )
    activations = activation_bytes_at_least(config, vocab_size, chunked_loss)
    counted = "each layer's output" + ("" if chunked_loss else " and the logits")
    if config.dist.pipeline_stages > 1:
        counted = "the residual stream its pipeline stage receives or makes"
    for where, memory_bytes, ranks in limits:
        sharing = f" on each of the {ranks} ranks of this host, which share it" if ranks > 1 else ""
        if ranks * (state_bytes + activations) > memory_bytes:
            raise ConfigError(
                f"batch.micro_batch_size: a micro-batch of {config.batch.micro_batch_size} rows of "
                f"{config.data.seq_len} tokens keeps at least {activations / 2**30:,.1f} GiB of activations for its "
                f"backward ({counted}; more in truth), and the "
                f"model {state_bytes / 2**30:,.1f} GiB{sharing}, more than the {memory_bytes / 2**30:,.1f} GiB of "
                f"{where}; choose a smaller batch.micro_batch_size (the global batch stays the same, with more "
                f"accumulation steps)"
            )
