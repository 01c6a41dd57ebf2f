"""This rank's place in the job (DistributedContext), and the end of a program's process (run_and_exit). A single
process (no `RANK` or `WORLD_SIZE`) has no process group and never imports accumulation/parallel/torchrun.py."""

import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistributedContext:
    rank: int
    local_rank: int  # rank within this node: picks the GPU
    world_size: int  # ranks, D × P (the same as D without pipeline stages)
    device: torch.device
    backend: str | None  # "nccl", "gloo", or None for a single process
    layout: object = None  # P > 1: the Layout of replicas and stages (parallel/mesh.py); None: every rank a replica

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


class LaunchError(ValueError):
    """The launcher's environment is incomplete or malformed: a WORLD_SIZE set by hand, RANK=abc, no MASTER_ADDR."""


def launch_environment() -> tuple[int, int]:
    """(rank, world size): (0, 1) for a single process, which has neither RANK nor WORLD_SIZE; under a launcher,
    its environment checked first (accumulation/parallel/torchrun.py)."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1
    from accumulation.parallel.torchrun import launch_problem

    problem = launch_problem()
    if problem is not None:
        raise LaunchError(problem)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def setup_distributed(device_preference: str, timeout_s: float, pipeline_stages: int = 1) -> DistributedContext:
    """A single process without RANK in the environment, else the process group and the D x P layout joined under
    torchrun (accumulation/parallel/torchrun.py). The device: this rank's GPU for "auto" and "cuda" when there is
    one (build.check_device_available has already refused "cuda" without one), otherwise the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if "RANK" in os.environ else 0
    gpu = device_preference in ("cuda", "auto") and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if "RANK" not in os.environ:
        return DistributedContext(0, 0, 1, device, None)
    from accumulation.parallel.torchrun import join_process_group

    backend, layout = join_process_group(device, timeout_s, pipeline_stages)
    return DistributedContext(dist.get_rank(), local_rank, dist.get_world_size(), device, backend, layout)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_and_exit(main, argv: list[str]) -> None:
    """End the process with the exit status of main(argv) through os._exit, output flushed; main tears its process
    group down on a clean return only, so a failed rank never waits for the others (docs/faults.md, "Fail fast")."""
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
