"""Pipeline parallelism (dist.pipeline_stages = P > 1): the schedule's micro-batches ARE the accumulation group.

The model is cut into P stages (the model's pipeline_split, e.g. GPT.pipeline_split), one per rank of a
replica; D = world size / P replicas each run the whole pipeline on their own rows (accumulation/parallel/mesh.py). A
replica's A = G / (m·D) micro-batches go through one `schedule.step` of PyTorch's pipeline schedules
(torch.distributed.pipelining: 1F1B or GPipe), which runs every micro-batch's forward and backward through
the stages and accumulates each stage's gradients. So the step is the same sum as accumulation/step.py's:

    L = (1 / N) · Σ_replicas Σ_k S_rk,   and the last stage backpropagates   S_rk · D / N

for each micro-batch k of replica r. Each stage's gradients are then Σ_k ∇(S_rk · D / N) for its own
parameters, and DDP over the dp group (the D ranks holding the same stage) averages them once, in the
last micro-batch's backward: (1 / D) · Σ_r Σ_k ∇(S_rk · D / N) = ∇L. PipelineStage puts DDP's no_sync around
every backward but the last itself.

Where the schedules' defaults go wrong for this sum:
- `scale_grads=True` (their default) divides the accumulated gradients by the number of micro-batches: right
  for a loss that is a mean over equal micro-batches, wrong for a token-weighted sum, where it makes the
  gradient A times too small (and a step's micro-batches with few tokens weigh as much as full ones). Here
  scale_grads=False: the 1 / N is in the loss already.
- The loss sum lives on the last stage only: for the log, the boundary's one all-reduce carries it (with
  the stop flag and the squared gradient norm), so every rank logs the same loss.
- Clipping needs the norm of the whole model: each stage knows only its own gradients, so the squared norms
  of the stages are summed over the ranks before the clip (the norm of one stage clips too little).
The step itself is accumulation/step.py's optimizer_step with `strategy=pipeline`: a Pipeline runs the
micro-batches through its schedule and gives its stage's share of the squared gradient norm; the boundary, the
clip, the update or skip and the result are the step's, the same as for every strategy.
"""

import itertools
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

from accumulation.batching import IGNORE_INDEX, MicroBatch, count_supervised_tokens
from accumulation.config.config import Config, ConfigError
from accumulation.parallel.mesh import Layout
from accumulation.step import MicroBatchLoss, Strategy, squared_norm

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def split_into_stages(model: torch.nn.Module, num_stages: int) -> list[torch.nn.Module]:
    """The model's own pipeline_split(num_stages); a ValueError (with its reason) when it cannot be split so,
    when the model has no pipeline_split (docs/forking.md says how a fork's model provides one), or when a
    weight sits in more than one stage (weights_in_several_stages)."""
    if not callable(getattr(model, "pipeline_split", None)):
        raise ValueError(
            f"dist.pipeline_stages: the {type(model).__name__} model has no pipeline_split(num_stages) method "
            "returning its stages (docs/forking.md); use dist.pipeline_stages=1"
        )
    stages = model.pipeline_split(num_stages)
    shared = weights_in_several_stages(model, stages)
    if shared:
        found = "; ".join(
            f"{' = '.join(names)} in stages {' and '.join(map(str, held_by))}" for names, held_by in shared
        )
        raise ValueError(
            f"dist.pipeline_stages: a weight is shared by several pipeline stages (tied weights: {found}), and each "
            "stage would train its own copy of it; untie it (e.g. give the output head its own weight) or use "
            "dist.pipeline_stages=1"
        )
    return stages


def weights_in_several_stages(model: torch.nn.Module, stages: list[torch.nn.Module]) -> list[tuple[list, list]]:
    """(the model's names for it, the stages holding it) for each Parameter that more than one stage holds: an
    embedding tied to the output head, or a module two stages share. Each rank trains only its own stage's
    parameters, so such a weight would take a different update on each stage holding it, with the gradient of
    that stage's use alone, and the checkpoint would keep one of the copies. Works on the meta device."""
    model_names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        model_names.setdefault(id(param), []).append(name)
    stages_holding: dict[int, list[int]] = {}
    for stage_index, stage in enumerate(stages):
        for param in stage.parameters():
            stages_holding.setdefault(id(param), []).append(stage_index)
    return [
        (model_names.get(param_id, ["(a parameter outside the model)"]), held_by)
        for param_id, held_by in stages_holding.items()
        if len(held_by) > 1
    ]


def check_pipeline_settings(config: Config, accumulation_steps: int) -> None:
    """The settings dist.pipeline_stages > 1 refuses, each with one line naming the key (world size and the
    batch arithmetic are checked by build.check_config_for_world, the model's seam by check_model_splits)."""
    stages = config.dist.pipeline_stages
    if stages == 1:
        return
    refused = {
        "dist.strategy": (config.dist.strategy == "fsdp2", '"ddp" (each stage\'s replicas average with DDP)'),
        "batch.on_oom": (config.batch.on_oom == "shrink", '"fail" (no rank can redo half a pipeline schedule)'),
        "model.loss": (config.model.loss == "chunked", '"plain" or "auto" (the chunked loss is not built for stages)'),
        "model.compile": (config.model.compile is True, 'false or "auto" (stages run eagerly)'),
    }
    for key, (is_set, allowed) in refused.items():
        if is_set:
            raise ConfigError(f"{key}: expected {allowed} with dist.pipeline_stages = {stages}")
    if config.dist.pipeline_schedule == "1f1b" and accumulation_steps < stages:
        raise ConfigError(
            f"dist.pipeline_schedule: 1f1b needs at least as many micro-batches per replica as stages, and "
            f"accumulation steps are {accumulation_steps} < {stages} stages; lower batch.micro_batch_size, raise "
            'batch.global_batch_size, or use dist.pipeline_schedule="gpipe"'
        )


def check_model_splits(model: torch.nn.Module, config: Config) -> list[torch.nn.Module]:
    """The model's stages (built on the meta device: shapes only; the model itself with dist.pipeline_stages = 1),
    or a ConfigError unless it splits into the stages asked for."""
    if config.dist.pipeline_stages == 1:
        return [model]
    try:
        return split_into_stages(model, config.dist.pipeline_stages)
    except ValueError as error:
        raise ConfigError(str(error)) from None


class LastStageLoss:
    """The loss the schedule calls on the last stage for each micro-batch. The schedule cuts the step's rows into
    the micro-batches itself; the target it cuts is the rows' positions, so that the labels and every extra tensor
    are read at exactly the rows of the outputs: S_mb = loss_sum_fn(outputs, labels, **extras). During a training
    step it returns `weighted(S_mb)` = S_mb · D / N (times the GradScaler's scale), what the schedule backpropagates.
    The sums S_mb are kept, detached, for the log."""

    def __init__(self, loss_sum_fn: Callable):
        self.loss_sum_fn = loss_sum_fn
        self.rows: MicroBatch | None = None  # the step's rows on the device (labels and extras read here)
        self.weighted: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: forward only (validation)
        self.sums: list[torch.Tensor] = []

    def __call__(self, outputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        labels = self.rows.labels.index_select(0, positions)
        extras = {name: tensor.index_select(0, positions) for name, tensor in self.rows.extras.items()}
        loss_sum = self.loss_sum_fn(outputs, labels, **extras)  # S_mb
        self.sums.append(loss_sum.detach())
        return self.weighted(loss_sum) if self.weighted is not None else loss_sum


@dataclass
class Pipeline(Strategy):
    """This rank's part of a pipelined model, and the schedule that runs one step of it: optimizer_step's strategy
    (accumulation/step.py) for dist.pipeline_stages > 1."""

    layout: Layout
    stage_module: torch.nn.Module  # this rank's stage, unwrapped: the optimizer's parameters
    wrapped: torch.nn.Module  # the stage in DDP over the dp group when D > 1
    schedule: Schedule1F1B | ScheduleGPipe
    loss: LastStageLoss
    names: dict[int, str]  # id of each of the whole model's tensors -> its name in the model's state dict
    device: torch.device
    accumulation_steps: int  # A: the micro-batches of every schedule step
    # The parameter names of each group of an optimizer over the whole model (optimizer_order), in its state
    # dict's numbering: what checkpoints use, so that they load on any layout. Set by whoever builds the optimizer.
    whole_order: list[list[str]] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        """D: the replicas, each running the whole pipeline on its own rows."""
        return self.layout.replicas

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> torch.Tensor:
        """The replica's micro-batches through the stages in one schedule step, all of it under DDP's no_sync:
        PipelineStage arms the last micro-batch's backward for the all-reduce itself (run_schedule). A replica
        without a supervised token still runs every micro-batch through every stage, so that each send meets its
        receive; its sums are zero."""
        self.loss.weighted = loss.weighted
        with loss.autocast():
            return run_schedule(self, micro_batches, train=True)

    def squared_norm_share(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        # Each rank knows only its stage's gradient, and the D ranks of a stage hold the same averaged one: summed
        # over all ranks, ‖g_stage‖² / D counts each stage once, sqrt(Σ_stages ‖g_stage‖²) is the whole model's norm.
        return squared_norm(gradients) / self.layout.replicas


def build_pipeline(
    model: torch.nn.Module,
    layout: Layout,
    device: torch.device,
    loss_sum_fn: Callable,
    accumulation_steps: int,
    schedule_name: str,
    initial_seed: int | None = None,
) -> Pipeline:
    """This rank's stage of `model`, wrapped in DDP over the dp group when there are several replicas, and the
    schedule over the pp group, with A micro-batches per step. `model` holds its weights already, the same on every
    rank; or it is on the meta device and `initial_seed` is given: then only this stage is materialised on
    `device` and initialised (initialise_stage), and the other stages stay shapes."""
    stage_module = split_into_stages(model, layout.pipeline_stages)[layout.stage]
    if initial_seed is not None:
        initialise_stage(model, stage_module, device, initial_seed)
    wrapped = stage_module
    if layout.replicas > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(stage_module, device_ids=device_ids, process_group=layout.dp_group)
    stage = PipelineStage(wrapped, layout.stage, layout.pipeline_stages, device, group=layout.pp_group)
    loss = LastStageLoss(loss_sum_fn)
    # scale_grads=False: the 1/N of the token mean is in the loss; the default would divide by A once more.
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=accumulation_steps, loss_fn=loss, scale_grads=False)
    names = {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}
    return Pipeline(layout, stage_module, wrapped, schedule, loss, names, device, accumulation_steps)


@torch.no_grad()
def initialise_stage(model: torch.nn.Module, stage_module: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Materialise this rank's stage of a model built on the meta device (its parameters are the model's own) on
    `device`, and give it the initial values of a one-process build: the model's `initial_values(seed)`, each whole
    parameter drawn on the host in the one generator's order, kept only when the stage holds it. No rank holds the
    whole model: at most its stage and one whole parameter of another stage; the values are the same, bit for bit,
    for any number of stages and replicas."""
    stage_module.to_empty(device=device)
    held = {id(parameter) for parameter in stage_module.parameters()}
    parameters = dict(model.named_parameters())  # after to_empty: the stage's materialised ones among them
    for name, value in model.initial_values(seed):
        if id(parameters[name]) in held:
            parameters[name].copy_(value)


def stand_in_forward(model_on_meta: torch.nn.Module, device: torch.device) -> Callable:
    """The forward step 0's probe (accumulation/probe.py) runs when no rank holds the whole model (its stages built
    on the meta device): the whole model's forward on the meta device, for the outputs' shape and dtype, filled with
    standard normal values on `device` from a generator of its own (the run's random state untouched). The probe
    tests the loss on those outputs (a mean, a read of the positions labelled -100, coupled rows), which no
    particular values hide."""
    generator = torch.Generator().manual_seed(0)

    def forward(inputs):
        if isinstance(inputs, dict):
            shaped = model_on_meta(**{name: tensor.to("meta") for name, tensor in inputs.items()})
        else:
            arguments = inputs if isinstance(inputs, tuple) else (inputs,)
            shaped = model_on_meta(*(tensor.to("meta") for tensor in arguments))
        return torch.randn(shaped.shape, generator=generator).to(device, shaped.dtype)

    return forward


def concatenate(micro_batches: list[MicroBatch]) -> MicroBatch:
    """The rows of several micro-batches as one, in order (every tensor concatenated along its rows)."""
    first = micro_batches[0]
    if isinstance(first.inputs, dict):
        inputs = {name: torch.cat([mb.inputs[name] for mb in micro_batches]) for name in first.inputs}
    elif isinstance(first.inputs, tuple):
        inputs = tuple(torch.cat(parts) for parts in zip(*(mb.inputs for mb in micro_batches), strict=True))
    else:
        inputs = torch.cat([mb.inputs for mb in micro_batches])
    labels = torch.cat([mb.labels for mb in micro_batches])
    extras = {name: torch.cat([mb.extras[name] for mb in micro_batches]) for name in first.extras}
    return MicroBatch(inputs, labels, sum(mb.num_examples for mb in micro_batches), extras)


def run_schedule(pipeline: Pipeline, micro_batches: list[MicroBatch], *, train: bool) -> torch.Tensor:
    """The replica's micro-batches through the stages in one schedule step (forward and backward, or forward
    only); returns the sum of the last stage's S_mb (float64; zero on the other stages). The schedule cuts the
    concatenated rows back into the same micro-batches of m rows each."""
    layout, device = pipeline.layout, pipeline.device
    rows = concatenate(micro_batches).to(device)
    pipeline.loss.sums.clear()
    pipeline.loss.rows = rows
    if not train:
        pipeline.loss.weighted = None
    # PipelineStage takes tensors only: the first stage gets a tuple of inputs as its arguments, a dict as keywords.
    inputs = rows.inputs if layout.is_first_stage else ()
    args = () if isinstance(inputs, dict) else inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = inputs if isinstance(inputs, dict) else {}
    positions = torch.arange(rows.labels.shape[0], device=device) if layout.is_last_stage else None
    if train:
        # no_sync: the shape inference's forward must not arm DDP's reducer; the last micro-batch's backward arms it.
        with pipeline.wrapped.no_sync() if isinstance(pipeline.wrapped, DistributedDataParallel) else nullcontext():
            pipeline.schedule.step(*args, target=positions, return_outputs=False, **kwargs)
    else:
        pipeline.schedule.eval(*args, target=positions, **kwargs)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # A schedule's first step infers the shapes the stages exchange by running the loss once more, before the
    # micro-batches (on placeholder tensors, outside the gradients): the last A sums are the micro-batches'.
    for partial_sum in pipeline.loss.sums[len(pipeline.loss.sums) - len(micro_batches) :]:
        loss_sum += partial_sum.double()
    pipeline.loss.sums.clear()
    pipeline.loss.rows = None
    return loss_sum


@torch.no_grad()
def pipelined_loss_sum(
    pipeline: Pipeline, micro_batches: Iterable[MicroBatch], autocast_dtype: torch.dtype | None
) -> tuple[torch.Tensor, int]:
    """Forward only, for validation: this replica's micro-batches through the stages, A at a time (the last
    group filled up with micro-batches without targets); returns the last stage's sum of token losses (zero
    elsewhere) and the replica's supervised targets. The caller sums both over the ranks."""
    accumulation_steps, device = pipeline.accumulation_steps, pipeline.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    pipeline.stage_module.eval()
    iterator = iter(micro_batches)  # built one micro-batch at a time, A of them held at once
    while group := list(itertools.islice(iterator, accumulation_steps)):
        tokens += sum(count_supervised_tokens(mb.labels) for mb in group)
        empty = MicroBatch(group[-1].inputs, torch.full_like(group[-1].labels, IGNORE_INDEX), 0, group[-1].extras)
        group = group + [empty] * (accumulation_steps - len(group))
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss_sum += run_schedule(pipeline, group, train=False)
    pipeline.stage_module.train()
    return loss_sum, tokens


def optimizer_order(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    """The parameter names of each of the optimizer's groups, in the order its state dict numbers them."""
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def whole_names(pipeline: Pipeline) -> dict[str, str]:
    """This stage's state-dict names -> the whole model's names of the same tensors."""
    state = pipeline.stage_module.state_dict(keep_vars=True)
    return {name: pipeline.names[id(tensor)] for name, tensor in state.items()}


def whole_numbers(pipeline: Pipeline, optimizer: torch.optim.Optimizer) -> list[int]:
    """The number an optimizer over the whole model gives each of this stage's optimizer's parameters (in the
    stage optimizer's own order): pipeline.whole_order, build_optimizer over the whole model, numbers them."""
    index = {name: i for i, name in enumerate(name for group in pipeline.whole_order for name in group)}
    return [index[name] for group in optimizer_order(optimizer, pipeline.names) for name in group]


def stage_state_under_whole_names(pipeline: Pipeline, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(this stage's state dict under the whole model's names, this stage's optimizer state dict as part of one
    optimizer's over the whole model: its entries under the whole model's numbers, param_groups over the whole
    model) for the stages of replica 0; the other replicas hold copies and give ({}, no entries)."""
    state_dict = optimizer.state_dict()
    model, state = {}, {}
    if pipeline.layout.replica == 0:
        names, numbers = whole_names(pipeline), whole_numbers(pipeline, optimizer)
        model = {names[name]: tensor for name, tensor in pipeline.stage_module.state_dict().items()}
        state = {numbers[i]: entries for i, entries in state_dict["state"].items()}
    # Each stage's optimizer has the whole optimizer's groups, with the same settings.
    groups, first = [], 0
    for group_names, group in zip(pipeline.whole_order, state_dict["param_groups"], strict=True):
        groups.append({**group, "params": list(range(first, first + len(group_names)))})
        first += len(group_names)
    return model, {"state": state, "param_groups": groups}


def stage_optimizer_state(pipeline: Pipeline, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A whole-model optimizer state dict (a checkpoint's, from any layout) cut to this stage's parameters, in
    the numbering of this stage's optimizer."""
    index = {name: i for i, name in enumerate(name for group in pipeline.whole_order for name in group)}
    state, groups, first = {}, [], 0
    for group, saved_group in zip(optimizer_order(optimizer, pipeline.names), state_dict["param_groups"], strict=True):
        for offset, name in enumerate(group):
            if index[name] in state_dict["state"]:
                state[first + offset] = state_dict["state"][index[name]]
        groups.append({**saved_group, "params": list(range(first, first + len(group)))})
        first += len(group)
    return {"state": state, "param_groups": groups}
