"""One function to set up data parallelism from torchrun's environment, one to tear it down, one to say
in a line that another rank was lost, and one to end a program's process cleanly.

Without `RANK` in the environment the program is a single process (D = 1) and no process group exists.
Under torchrun every rank reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, checked first by
launch_environment.
"""

import os
import re
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from accumulation.parallel.mesh import Layout, build_layout, layout_of


@dataclass
class DistributedContext:
    rank: int
    local_rank: int  # rank within this node: picks the GPU
    world_size: int  # ranks, D × P (the same as D without pipeline stages)
    device: torch.device
    backend: str | None  # "nccl", "gloo", or None for a single process
    layout: Layout | None = (
        None  # replicas and pipeline stages (accumulation/parallel/mesh.py); None: every rank a replica
    )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pipelined(self) -> bool:
        """Whether this rank runs one pipeline stage of the model (dist.pipeline_stages > 1)."""
        return self.layout is not None and self.layout.pipelined

    @property
    def replicas(self) -> int:
        """D: the data-parallel replicas, what the batch arithmetic, the data split and validation count."""
        return self.layout.replicas if self.layout is not None else self.world_size

    @property
    def replica(self) -> int:
        """This rank's replica, 0..D-1: which of the step's rows it runs."""
        return self.layout.replica if self.layout is not None else self.rank


def choose_device(preference: str, local_rank: int) -> torch.device:
    """ "auto" and "cuda" take this rank's GPU when there is one (build.check_device_available has already
    refused "cuda" without one); otherwise the CPU."""
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class LaunchError(ValueError):
    """The launcher's environment is incomplete or malformed: a WORLD_SIZE set by hand, RANK=abc, no MASTER_ADDR."""


# What torchrun sets for every rank; a launcher of its own must set them all (LOCAL_RANK defaults to 0).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_environment() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, checked before anything reads it: (0, 1) for a single
    process, which has neither RANK nor WORLD_SIZE. Half a launch environment is refused rather than guessed
    at: WORLD_SIZE=2 without RANK would check the batch for 2 ranks and then train on 1."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1
    how = (
        "torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: launch with torchrun --standalone "
        "--nproc_per_node=N train.py, or unset RANK and WORLD_SIZE for one process"
    )
    missing = [name for name in LAUNCH_VARIABLES if not os.environ.get(name)]
    if missing:
        given = ", ".join(f"{name}={os.environ[name]!r}" for name in LAUNCH_VARIABLES if os.environ.get(name))
        raise LaunchError(f"{', '.join(missing)} not set, though {given} is; {how}")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        value = os.environ.get(name, "0")
        if not value.isdigit():
            raise LaunchError(f"{name}={value!r} is not a non-negative integer; {how}")
        numbers[name] = int(value)
    if not numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise LaunchError(f"RANK={numbers['RANK']} is not below WORLD_SIZE={numbers['WORLD_SIZE']}; {how}")
    if not 0 < numbers["MASTER_PORT"] < 65536:
        raise LaunchError(f"MASTER_PORT={numbers['MASTER_PORT']} is not a port (1 to 65535); {how}")
    return numbers["RANK"], numbers["WORLD_SIZE"]


def setup_distributed(device_preference: str, timeout_s: float, pipeline_stages: int = 1) -> DistributedContext:
    """The process group, this rank's device, and its layout as D replicas × P pipeline stages."""
    if "RANK" not in os.environ:
        return DistributedContext(0, 0, 1, choose_device(device_preference, 0), None, layout_of(1, 0, 1))
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    device = choose_device(device_preference, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    # torchrun's agent hosts the rendezvous store and keeps it across restarts (--max-restarts). Keys left
    # by the previous attempt confuse a fresh init_process_group (pytorch issue 135712), so every attempt
    # works under its own key prefix. Without the agent (a plain launcher that sets the variables), rank 0
    # hosts the store.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"accumulation/attempt{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,  # a collective waiting longer than this fails instead of hanging forever
    )
    return DistributedContext(rank, local_rank, world_size, device, backend, build_layout(device, pipeline_stages))


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


def run_and_exit(main, argv: list[str]) -> None:
    """End the process with the exit status of main(argv). main destroys its process group itself, on a
    clean return only; after an error (a status main returns for one, or an exception, whose traceback is
    printed here) the process leaves without tearing down, so that it never waits for the other ranks.

    Output is flushed and the process ends through os._exit: interpreter teardown after gloo or NCCL use
    occasionally aborts a rank (SIGABRT) that finished all its work, and a finished job must exit 0.
    Without the teardown of a failed rank, the others learn at once that it is gone: their next collective
    fails (gloo), or torchrun's agent, seeing a worker exit non-zero, stops them.
    """
    try:
        status = main(argv)
    except SystemExit as request:  # argparse: --help (0) or an unknown flag (2, usage already printed)
        status = request.code if isinstance(request.code, int) else 1
    except KeyboardInterrupt:
        status = 130
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
