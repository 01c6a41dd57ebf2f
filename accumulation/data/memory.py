"""How much memory this process can have at most: the least of the machine's memory, its cgroup's limit (a
container's, a SLURM job's --mem) and the address space `ulimit -v` leaves. An upper bound, not what is free now,
which other processes move: the start-up checks refuse only what cannot fit (docs/training.md, "Launching")."""

import os
import resource
from pathlib import Path

# Where the kernel says which cgroup this process is in ("hierarchy:controllers:/path" lines), and where the
# cgroup file system is mounted (v2: one tree; v1: a tree per controller, memory/ among them).
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (v2: memory.max; v1: memory.limit_in_bytes), or None."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # cgroup v2, one hierarchy
            limit_file = CGROUP_ROOT / group.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1, the memory hierarchy
            limit_file = CGROUP_ROOT / "memory" / group.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            limit = limit_file.read_text().strip()
        except OSError:
            continue
        # "max" (v2) or a huge number (v1, 2^63 rounded to a page) both mean no limit
        if limit.isdigit() and int(limit) < 2**60:
            return int(limit)
    return None


def mapped_bytes() -> int:
    """The address space this process maps already (VmSize), which counts against RLIMIT_AS."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024  # kB
    return 0


def memory_limits() -> list[tuple[int, str, bool]]:
    """Each limit on the memory this process can get: (bytes, what sets it, whether it is this process's own). The
    machine's memory and its cgroup's limit are the host's, shared by every process on it (torchrun starts a
    host's ranks in one cgroup); the address space `ulimit -v` leaves (RLIMIT_AS) is this process's alone."""
    limits = [(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory", False)]
    cgroup = cgroup_memory_limit_bytes()
    if cgroup is not None:
        limits.append((cgroup, "the cgroup's memory.max", False))
    address_space, _ = resource.getrlimit(resource.RLIMIT_AS)
    if address_space != resource.RLIM_INFINITY:
        limits.append((max(0, address_space - mapped_bytes()), "the address space ulimit -v leaves", True))
    return limits


def memory_limit_bytes() -> tuple[int, str]:
    """(bytes, what sets the limit) for the memory this process can get at most."""
    return min((limit_bytes, limit) for limit_bytes, limit, _ in memory_limits())
