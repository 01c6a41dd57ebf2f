"""Counting the calls that make the host wait for the GPU: for the benchmark and the GPU check."""

import warnings

import torch


def cuda_syncs_of(fn) -> tuple[object, list[str]]:
    """Run fn() and return (its result, one line per call that made the host wait for the GPU).

    torch.cuda.set_sync_debug_mode("warn") makes PyTorch warn at every synchronising CUDA call (a read of a
    device value, a blocking copy, an explicit synchronize); the warnings are recorded here, not shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
