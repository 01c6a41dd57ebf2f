"""Counting the calls that make the host wait for the GPU: for the benchmark and the GPU check."""

import warnings

import torch

# What PyTorch warns at each synchronising CUDA call under set_sync_debug_mode("warn") (c10/cuda).
SYNC_WARNING = "called a synchronizing CUDA operation"


def synchronising_calls(messages: list[str]) -> list[str]:
    """The first line of each warning that reports a synchronising call; every other warning is dropped.

    Matched on PyTorch's exact words, not on "synchroniz": switching the mode on makes PyTorch say once
    "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations",
    which is a notice, not a call, and counting it would report one sync too many per audit."""
    return [message.splitlines()[0] for message in messages if SYNC_WARNING in message]


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
    return result, synchronising_calls([str(warning.message) for warning in caught])
