"""FSDP2 (`dist.strategy = "fsdp2"`): the parameters, gradients and optimizer state sharded over the D ranks,
with the same exact step as under DDP, and checkpoints that DDP reads.

Under DDP every rank holds the whole model, its whole gradient and the whole optimizer state: 16 bytes per
parameter with fp32 AdamW, on every rank. FSDP2 (`torch.distributed.fsdp.fully_shard`) cuts each parameter
along its first dimension into D shards, one per rank (a DTensor), so at rest a rank holds 1/D of all three.
The full weights of a part of the model exist only while that part runs: `fully_shard(module)` makes the
module's parameters one communication group, all-gathered in one collective just before its forward (and
again before its backward), and whose gradients are reduce-scattered in one collective after its backward.

What changes against DDP, and where:
- `shard_model` (called by accumulation/run/build.py's `wrap_for_training`): `fully_shard` on each module the
  model lists in its optional `fsdp_units()` (the GPT: its transformer blocks), then on the whole model,
  which takes the parameters no unit holds (embeddings, final norm, head). A model without `fsdp_units()`
  (the GRU here) is sharded whole: one group, all-gathered as a whole for its forward.
- `initialise_shards`: a model built on the meta device and sharded gets each rank's shards of its initial
  weights, the values of a one-process build, without any rank building the whole model (docs/sharding.md).
- the step's strategy (`FullyShardedDataParallel`, handed to accumulation/step.py's optimizer_step):
  `set_requires_gradient_sync(False)` for every micro-batch but the last, FSDP2's counterpart of DDP's `no_sync`:
  one reduce-scatter of the gradient per update; the squared gradient norm from each rank's shards.
- the optimizer is built after sharding (train.py), so that it updates the shards; clipping and the
  GradScaler's inf check see every shard (the norm and the found-inf flag are reduced over ranks).
- checkpoints: each rank writes and reads its own shards (accumulation/run/sharded_checkpoint.py, DCP);
  `shard_optimizer_state` cuts a ddp run's whole optimizer state into this rank's shards, and
  `full_model_state_dict` / `full_optimizer_state_dict` gather the shards whole (tests, benchmarks). A run
  moves freely between ddp and fsdp2 and between world sizes.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from accumulation.batching import MicroBatch
from accumulation.config.config import Config, ConfigError
from accumulation.parallel.distributed import DistributedContext
from accumulation.step import MicroBatchLoss, Strategy, squared_norm


class FullyShardedDataParallel(Strategy):
    """optimizer_step's strategy for a fully_shard-ed model: every rank one replica, each holding shards. `module` is
    what the step runs: the sharded model, or with the chunked loss the module of its hidden states around it."""

    def __init__(self, module: torch.nn.Module, sharded: torch.nn.Module):
        self.model, self.sharded, self.replicas = module, sharded, dist.get_world_size()  # D

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss: MicroBatchLoss) -> torch.Tensor:
        last = len(micro_batches) - 1
        loss_sum_local = torch.zeros((), dtype=torch.float64, device=loss.device)
        for k, micro_batch in enumerate(micro_batches):
            # Gradients accumulate unsharded until the last micro-batch's backward reduce-scatters their sum with
            # ReduceOp.AVG, so rank r keeps shard r of (1/D)·Σ_q Σ_k ∇(S_qk·D/N) = ∇L: DDP's mean, the same ×D.
            self.sharded.set_requires_gradient_sync(k == last)
            loss_sum = loss.forward(self.model, micro_batch)  # S_rk
            loss.backward(loss_sum)
            loss_sum_local += loss_sum.detach()
        return loss_sum_local

    def squared_norm_share(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        # Each rank holds other shards of the gradient: the squares of its own sum over ranks to ‖g‖².
        return squared_norm([gradient.to_local() for gradient in gradients])


def check_strategy_for_world(config: Config, world_size: int) -> None:
    """The combinations fsdp2 refuses, each with one line naming the key."""
    if config.dist.strategy != "fsdp2":
        return
    if world_size < 2:
        raise ConfigError(
            'dist.strategy: "fsdp2" shards the model over the ranks and needs at least 2 (torchrun '
            '--nproc_per_node=N with N >= 2); on one process use "ddp", which reads the same checkpoints'
        )
    if config.batch.on_oom == "shrink":
        # Recovery needs the rank that ran out of memory to join the others' gradient reduction and then
        # redo the step (accumulation/step.py); FSDP2 reduce-scatters per block inside the backward, and
        # nothing here lets a rank join those half-way.
        raise ConfigError(
            'batch.on_oom: expected "fail" with dist.strategy = "fsdp2" (out-of-memory recovery is built for DDP '
            "only); set batch.micro_batch_size smaller instead"
        )


def sharding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules sharded one by one, as the model lists them; none for a model without `fsdp_units()`."""
    return list(model.fsdp_units()) if hasattr(model, "fsdp_units") else []


def shard_model(
    model: torch.nn.Module, context: DistributedContext, param_dtype: torch.dtype | None, compile_units: bool = False
) -> torch.nn.Module:
    """Shard `model` in place over all ranks and return it (it is now an FSDPModule; its parameters DTensors).

    Every rank must hold the same full weights before this call (the same seed, or the same checkpoint):
    each keeps its own shard of them. Or the model is on the meta device, and `initialise_shards` gives each
    rank's shards their values after this call (accumulation/run/build.py).
    bf16 and fp16 all-gather and compute with half-precision copies of the
    parameters (MixedPrecisionPolicy.param_dtype; autocast still runs in the step as under DDP) and
    reduce-scatter the gradients in fp32 (reduce_dtype), which is also the dtype in which the gradients of
    non-final micro-batches accumulate while synchronisation is off. fp32 needs no policy: everything stays
    in the parameters' dtype (float64 too, as the tests run it). `param_dtype` is the autocast dtype of
    precision.dtype: the dtype of the all-gathered (unsharded) parameters the forward and backward compute
    with; None keeps the parameters' own. The shards, gradients and optimizer state keep the parameters' dtype.

    `compile_units` (model.compile): each unit is compiled in place before it is sharded, so that torch.compile
    traces the block's own computation and FSDP2's all-gather and reduce-scatter stay outside it, run by the hooks
    of the eager module around it; the root (embeddings, final norm, head, loss) runs eagerly.

    The chunked loss (model.loss = "chunked") calls `model.hidden_states` and then reads the output head's weight:
    `hidden_states` is made one of the root's forwards (its parameters all-gathered before it), and the root keeps
    them whole after it (reshard_after_forward=False) until its backward has reduce-scattered their gradients, so
    the loss reads the whole head weight and its gradient reaches FSDP2's reduction like any other."""
    mesh = init_device_mesh(context.device.type, (context.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for unit in sharding_units(model):
        if compile_units:
            unit.compile()
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)  # the root: what no unit took
    if hasattr(model, "hidden_states"):
        register_fsdp_forward_method(model, "hidden_states")
    return model


@torch.no_grad()
def initialise_shards(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Materialise a model sharded on the meta device (`shard_model`) on `device` and give each rank's shards their
    initial values: the model's `initial_values(seed)`, one whole parameter at a time on the host, of which each
    rank keeps its own rows. No rank holds the whole model: at most its shards and the largest single parameter
    (at 70B, a 128k × 8192 embedding: 4 GiB, against 280 GB for the whole model). The values are those of a
    one-process build with the same seed, bit for bit, for any world size: the same draws, cut."""
    model.to_empty(device=device)
    parameters = dict(model.named_parameters())
    for name, value in model.initial_values(seed):
        param = parameters[name]
        # distribute_tensor with src_data_rank=None cuts this rank's rows out of the value every rank computed alike
        # (no communication), laid out as fully_shard laid the parameter out.
        mesh, placements = param.device_mesh, param.placements
        shard = distribute_tensor(value.to(device), mesh, placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())


def describe_sharding(model: torch.nn.Module) -> str:
    """The banner's line, e.g. "fsdp2: 5 groups (4 from fsdp_units() and the root)"."""
    units = len(sharding_units(model))
    if units == 0:
        return (
            "fsdp2: the whole model is one group (it lists no fsdp_units()); all-gathered whole for each forward, "
            "and never compiled (model.compile compiles each of fsdp_units())"
        )
    return f"fsdp2: {units + 1} groups ({units} from fsdp_units() and the root), each all-gathered when it runs"


def _gathered(state: dict) -> dict:
    """`state` with each DTensor shard gathered whole: rank 0 keeps the whole tensor on its host, the other
    ranks leave that entry out. Rank 0 also copies every other tensor to its host, so that a checkpoint written
    on GPUs loads on a machine without one; the other ranks keep those as they are (they write nothing). Every
    rank must call this, with the same keys in the same order: each gather is a collective."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    whole = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            full = value.full_tensor()  # one all-gather of this tensor's shards
            if is_main:
                whole[key] = full.cpu()
        elif is_main and isinstance(value, torch.Tensor):
            whole[key] = value.cpu()
        else:
            whole[key] = value
    return whole


def full_model_state_dict(model: torch.nn.Module) -> dict:
    """model.state_dict() with whole tensors on rank 0's host: DDP's copied there; FSDP2's shards gathered one
    tensor at a time, so rank 0 holds the whole model on its host, and never more than one whole tensor on the
    device."""
    return _gathered(model.state_dict())


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with whole tensors, in the same format (state keyed by parameter number), gathered
    like `full_model_state_dict`. The plain state_dict is used rather than torch.distributed.checkpoint's
    get_optimizer_state_dict, which runs a zero-gradient optimizer step to create the state of a fresh
    optimizer: that would count one AdamW step more than DDP's run and change every later update."""
    state_dict = optimizer.state_dict()
    state = {param_id: _gathered(param_state) for param_id, param_state in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A checkpoint's whole-tensor optimizer state as this optimizer loads it. Under FSDP2 each state tensor
    shaped like its parameter (AdamW's moments, SGD's momentum) is cut into this rank's shard, laid out as
    the parameter is; every rank read the same checkpoint, so the cut needs no communication. Without
    DTensor parameters the state dict is returned as it is."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not any(isinstance(param, DTensor) for param in params):
        return state_dict
    sharded = {}
    for param_id, param_state in state_dict["state"].items():
        if not 0 <= param_id < len(params):
            raise ValueError(f"optimizer state for parameter {param_id}, but the optimizer has {len(params)}")
        # Optimizer.state_dict numbers the parameters of all groups in order; the optimizer is built the same way.
        param = params[param_id]
        sharded[param_id] = {
            key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in param_state.items()
        }
    return {"state": sharded, "param_groups": state_dict["param_groups"]}
