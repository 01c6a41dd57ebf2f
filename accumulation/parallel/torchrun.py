"""What only a launch under torchrun needs: its environment checked, the process group joined, the ranks' settings
compared, and the line that says another rank was lost.

Every rank reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, checked first (launch_problem). A
single process has none of them and never imports this module (accumulation/parallel/distributed.py).
"""

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from accumulation.config.config import Config, ConfigError, settings_of

# What torchrun sets for every rank; a launcher of its own must set them all (LOCAL_RANK defaults to 0).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_problem() -> str | None:
    """What is wrong with torchrun's environment, or None. Half a launch environment is refused rather than
    guessed at: WORLD_SIZE=2 without RANK would check the batch for 2 ranks and then train on 1."""
    how = (
        "torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: launch with torchrun --standalone "
        "--nproc_per_node=N train.py, or unset RANK and WORLD_SIZE for one process"
    )
    missing = [name for name in LAUNCH_VARIABLES if not os.environ.get(name)]
    if missing:
        given = ", ".join(f"{name}={os.environ[name]!r}" for name in LAUNCH_VARIABLES if os.environ.get(name))
        return f"{', '.join(missing)} not set, though {given} is; {how}"
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        value = os.environ.get(name, "0")
        if not value.isdigit():
            return f"{name}={value!r} is not a non-negative integer; {how}"
        numbers[name] = int(value)
    if not numbers["RANK"] < numbers["WORLD_SIZE"]:
        return f"RANK={numbers['RANK']} is not below WORLD_SIZE={numbers['WORLD_SIZE']}; {how}"
    if not 0 < numbers["MASTER_PORT"] < 65536:
        return f"MASTER_PORT={numbers['MASTER_PORT']} is not a port (1 to 65535); {how}"
    return None


def join_process_group(device: torch.device, timeout_s: float, pipeline_stages: int):
    """(backend, layout): this rank in the process group on `device`, and with P > 1 its layout as D replicas × P
    pipeline stages (None: every rank a replica)."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    # torchrun's agent hosts the rendezvous store and keeps it across restarts (--max-restarts). Keys left
    # by the previous attempt confuse a fresh init_process_group (pytorch issue 135712), so every attempt
    # works under its own key prefix. Without the agent (a plain launcher that sets the variables), rank 0
    # hosts the store.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts_store = rank == 0 and not agent_hosts_store
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=hosts_store,
            timeout=timeout,
        )
    except dist.DistNetworkError as error:  # a launch problem, one line; train.py then undoes rank 0's run lock
        if hosts_store and "address already in use" in str(error).lower():
            raise ConfigError(
                f"MASTER_PORT={os.environ['MASTER_PORT']} is in use on this host, and rank 0 hosts the ranks' "
                f"rendezvous there (no torchrun agent holds it): set MASTER_PORT to a free port on every rank, or "
                f"launch with torchrun --standalone"
            ) from None
        raise
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"accumulation/attempt{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,  # a collective waiting longer than this fails instead of hanging forever
    )
    if pipeline_stages == 1:
        return backend, None
    from accumulation.parallel.mesh import build_layout

    return backend, build_layout(device, pipeline_stages)


# The keys that may differ from rank to rank. run.out_dir: the path under which each node sees the run's shared
# storage (mount points differ between nodes); only rank 0 writes there, and restore.py's check_ranks_agree_on_resume
# compares what each rank found in it. Every other key shapes the step (the model, the batch, the data, the
# optimizer) or decides when the ranks meet in a collective (run.max_steps, run.checkpoint_every, run.eval_every).
PER_RANK_KEYS = ("run.out_dir",)


def check_ranks_agree(config: Config, data_fingerprint: str) -> None:
    """Refuse (ConfigError, one line on every rank) ranks launched with different settings: a stale config file on
    one node, a node-local copy of other data. ONE all-gather of each rank's resolved config (less PER_RANK_KEYS)
    and its training data's fingerprint; every rank compares the same list, so every rank refuses alike. The
    first key that differs is named with its value on rank 0 and on the first rank that differs; the data's
    fingerprint comes last, since a differing data.source already explains it."""
    mine = {key: value for key, _, value in settings_of(config) if key not in PER_RANK_KEYS}
    mine["the training data's fingerprint"] = data_fingerprint
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    keys = list(everyone[0]) + [key for settings in everyone[1:] for key in settings if key not in everyone[0]]
    for key in keys:
        for rank, settings in enumerate(everyone[1:], start=1):
            if settings.get(key, "unset") != everyone[0].get(key, "unset"):
                first, other = everyone[0].get(key, "unset"), settings.get(key, "unset")
                raise ConfigError(
                    f"the ranks were launched with different settings: {key} is {first!r} on rank 0 and {other!r} "
                    f"on rank {rank}; every rank must get the same config file, command line and data (only "
                    f"{', '.join(PER_RANK_KEYS)} may differ)"
                )


# How gloo and the TCP store word the failures that mean "another rank is gone or stuck".
LOST_RANK_SIGNS = ("timed out", "connection closed by peer", "connection reset by peer", "broken pipe")


def lost_rank_message(error: RuntimeError, rank: int, timeout_s: int) -> str | None:
    """One line for an error that means another rank died or hangs; None for any other error (a bug, which
    keeps its traceback).

    A collective returns only when every rank has joined it. When a rank dies, gloo reports the closed
    connection at once; when a rank hangs, the others give up after dist.timeout_s with "Timed out waiting
    ...". torch.distributed's own errors (DistError: store, network, backend) mean the same. NCCL behaves
    differently: its watchdog ends the waiting process after the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING),
    so no Python error arrives at all.
    """
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or any(sign in text.lower() for sign in LOST_RANK_SIGNS)):
        return None
    # gloo's first sentence says what happened; before it stands the C++ source location ("[.../pair.cc:553] "),
    # after it advice on reading the other rank's logs, which the message below gives in our words.
    first_line = text.splitlines()[0] if text else type(error).__name__
    detail = re.sub(r"^\[[^\]]*\]\s*", "", first_line).split(". ")[0]
    return (
        f"error: rank {rank}: another rank stopped answering, so a collective failed ({detail}); a collective "
        f"waits at most dist.timeout_s={timeout_s} s. The rank that failed first tells why in its own messages"
    )
