"""A checkpoint's optimizer state loaded into this run's optimizer (a resume, and the scripts that reload one)."""

import torch

# The per-group switches of PyTorch's optimizers that choose an implementation, not the maths.
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict, sharded: bool = False) -> None:
    """optimizer.load_state_dict, keeping this run's implementation and putting the state where it runs.

    load_state_dict takes every group setting from the checkpoint, `fused` and `foreach` included, and
    leaves the step counters where the checkpoint's flags put them: a run saved on the CPU (fused off, step
    counters on the CPU) and resumed on a GPU would stay on the slow, syncing path. So the flags this
    optimizer was built with (build_optimizer: fused AdamW on CUDA) are put back, the moments are moved to
    each parameter's device and dtype, and the step counters are placed as PyTorch's optimizers expect:
    float32 on the parameter's device for a fused or capturable group, float32 on the CPU otherwise.
    The values themselves are unchanged, so the next update is the same as with the checkpoint's flags.
    `sharded` (dist.strategy = "fsdp2"): the checkpoint's whole tensors are first cut into this rank's shards."""
    configured = [{key: group[key] for key in IMPLEMENTATION_FLAGS if key in group} for group in optimizer.param_groups]
    if sharded:
        from accumulation.parallel.fsdp import shard_optimizer_state

        state_dict = shard_optimizer_state(optimizer, state_dict)
    optimizer.load_state_dict(state_dict)
    for group, flags in zip(optimizer.param_groups, configured, strict=True):
        group.update(flags)
        counter_on_device = bool(group.get("fused") or group.get("capturable"))
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if key == "step":
                    device = parameter.device if counter_on_device else torch.device("cpu")
                    state[key] = value.to(device=device, dtype=torch.float32)
                elif value.is_floating_point():
                    state[key] = value.to(device=parameter.device, dtype=parameter.dtype)
                else:
                    state[key] = value.to(device=parameter.device)
