"""Run a function on D gloo ranks on this machine and collect what each rank returns: for tests and for
the scripts that measure multi-rank behaviour without torchrun.

Every rank is a fresh process with one intra-op thread (the ranks share the machine's cores), forked from a
forkserver that imported torch once: a rank starts in well under a second instead of importing torch again
(seconds, the most of a small multi-rank test). Nothing a rank does reaches the next call's ranks (each is
forked afresh from the server, which runs no torch code itself), and each rank gets the caller's environment
as it is at the call, as a spawned process would. Hangs
become failures: each collective gives up after `timeout_s`, and the parent waits at most `timeout_s` for
all ranks before it kills the rest. Ranks end with os._exit after tearing down the process group, because
the interpreter's own exit can abort a finished gloo rank (about 1 spawn in 20 on the test machine).
"""

import importlib
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accumulation.parallel.distributed import run_and_exit

# What the forkserver imports once, before it forks any rank (torch, and the package, whose step imports FSDP2,
# train.py, whose pipeline imports torch's pipelining, and the checker: seconds together); the rest, fn's own
# module first, each rank imports.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "accumulation.parallel.distributed",
    "accumulation.step",
    "accumulation.data.sources",
    "train",
    "accumulation.checker",
]


def _rank_main(
    rank: int, world_size: int, store_path: str, result_dir: str, timeout_s: float, environment: dict, fn, args
) -> None:
    os.environ.clear()  # the server's environment is the one of its start; the caller's may have changed since
    os.environ.update(environment)

    def work(_argv: list[str]) -> int:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
        return 0

    run_and_exit(work, [])  # a raise prints its traceback and exits 1; flushed, then os._exit either way


def run_on_ranks(fn, world_size: int = 2, args: tuple = (), timeout_s: float = 120.0) -> list:
    """fn(rank, world_size, *args) on each rank, inside an initialised gloo process group; returns the
    per-rank results (anything torch.save can write) in rank order. `fn` must be importable by name."""
    with tempfile.TemporaryDirectory(prefix="accumulation-ranks-") as scratch:
        store_path = os.path.join(scratch, "store")  # a file store: no port to pick, nothing to collide with
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        environment = dict(os.environ)
        processes = [
            context.Process(
                target=_rank_main, args=(rank, world_size, store_path, scratch, timeout_s, environment, fn, args)
            )
            for rank in range(world_size)
        ]
        run_to_the_end(processes, timeout_s)
        failed = {rank: process.exitcode for rank, process in enumerate(processes) if process.exitcode != 0}
        if failed:
            raise RuntimeError(f"ranks exited with non-zero status {failed}; see the traceback above")
        return [torch.load(Path(scratch) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def pretend_launched(monkeypatch, world_size: int, rank: int = 0) -> None:
    """The environment torchrun gives a rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set with pytest's
    monkeypatch and nothing launched: for what train.py and the checker refuse before any process group exists
    (half of that environment is refused itself: accumulation/parallel/torchrun.py, launch_problem)."""
    launch = {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
    for name, value in launch.items():
        monkeypatch.setenv(name, str(value))


def _launched_rank_main(
    rank: int, world_size: int, port: int, output_dir: str, environment: dict, main_name: str, argv: list[str]
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    if world_size > 1:  # one rank runs as `python train.py` does: no launch environment, no process group
        # What torchrun's agent gives each worker; rank 0 then hosts the TCP store (no agent holds one).
        launch = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1"}
        os.environ.update({name: str(value) for name, value in launch.items()}, MASTER_PORT=str(port))
    # The rank's stdout and stderr go to files at the descriptor level, so whatever writes them is kept.
    for descriptor, name in ((1, "out"), (2, "err")):
        with open(Path(output_dir) / f"rank{rank}.{name}", "w") as sink:
            os.dup2(sink.fileno(), descriptor)
    module_name, function_name = main_name.split(":")
    main = getattr(importlib.import_module(module_name), function_name)
    torch.set_num_threads(1)
    run_and_exit(main, argv)  # exits with main's status, as the script under torchrun would


def run_main_on_ranks(
    main_name: str,
    argv: list[str],
    world_size: int = 2,
    timeout_s: float = 120.0,
    rank_argv: list[list[str]] | None = None,
) -> list:
    """A program's main(argv) ("train:main", "accumulation.checker:main") on `world_size` ranks forked from
    the forkserver, each with the environment torchrun would give it (none for one rank, as `python train.py`),
    instead of torchrun and interpreters that import torch again: (exit status, stdout, stderr) of each rank,
    in rank order. `rank_argv[r]`, when given, follows argv on rank r (nodes that do not share a folder)."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="accumulation-launched-") as scratch:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        processes = [
            context.Process(
                target=_launched_rank_main,
                args=(
                    rank,
                    world_size,
                    port,
                    scratch,
                    environment,
                    main_name,
                    argv + (rank_argv[rank] if rank_argv else []),
                ),
            )
            for rank in range(world_size)
        ]
        run_to_the_end(processes, timeout_s)
        outputs = []
        for rank, process in enumerate(processes):
            out, err = ((Path(scratch) / f"rank{rank}.{name}").read_text() for name in ("out", "err"))
            outputs.append((process.exitcode, out, err))
        return outputs


def run_to_the_end(processes: list, timeout_s: float) -> None:
    """Start the ranks' processes and wait for all of them, up to `timeout_s` in all; a rank still running then is
    killed, and a TimeoutError names the ranks that hung."""
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout_s} s (a hang?)")
