"""Peak memory of a piece of work, on CUDA and on the CPU: for the benchmark and the micro-batch sweep."""

import torch
from torch.autograd.profiler import MEMORY_EVENT_NAME


def peak_memory_bytes_of(fn, device: torch.device) -> tuple[object, int]:
    """Run fn() and return (its result, the most bytes it held allocated at once on `device`, beyond what
    was already allocated when it began).

    CUDA: the caching allocator counts its own peak. The CPU allocator keeps no such counter, so the
    profiler records every allocation (+bytes) and free (-bytes) with its time; the running sum in time
    order is what fn holds at each moment, and its maximum is the peak.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        bytes_before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - bytes_before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        result = fn()
    # The raw records: profile.events() would fold each allocation into the operator that made it, hiding
    # a peak that lasts only inside one operator.
    records = [record for record in profile.profiler.kineto_results.events() if record.name() == MEMORY_EVENT_NAME]
    held_bytes = peak_bytes = 0
    for record in sorted(records, key=lambda record: record.start_ns()):
        held_bytes += record.nbytes()  # negative for a free
        peak_bytes = max(peak_bytes, held_bytes)
    return result, peak_bytes
