"""Model FLOPs utilisation (MFU) for the step records: the FLOPs a step's positions need, by the model's own
declaration (flops_per_token(), e.g. the GPT's), per second, as a fraction of the peak of every device the job runs
on. The peak is log.peak_tflops when set, else the data sheet's for a GPU named in PEAK_TFLOPS at the run's
precision; on a CPU, or an unknown GPU, there is none and the record has no `mfu`. Imported only on CUDA or with
log.peak_tflops set; scripts/benchmarks/ reads the same table."""

import torch

# Peak dense TFLOPS from NVIDIA's data sheets (the sheets' larger tensor-core figures assume 2:4 sparsity),
# looked up by the first name that occurs in torch.cuda.get_device_name(); more specific names first.
# "tf32" is the peak of fp32 matrix products with precision.tf32 on, "fp32" without it.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM; the NVL variant is lower
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision` ("bf16", "fp16", "tf32" or "fp32") from PEAK_TFLOPS, None when
    the name is not in the table."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks[precision]
    return None


def run_peak(config, device: torch.device) -> tuple[float | None, str]:
    """(one device's peak TFLOPS for this run, where it came from), or (None, why there is none)."""
    if config.log.peak_tflops > 0:
        return config.log.peak_tflops, "log.peak_tflops"
    if device.type != "cuda":
        return None, "no known peak for a CPU: set log.peak_tflops"
    precision = config.precision.dtype
    if precision == "fp32" and config.precision.tf32:  # fp32 matrix products run on TF32 tensor cores
        precision = "tf32"
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, precision)
    if peak is None:
        return None, f"{name} is not in PEAK_TFLOPS (accumulation/run/mfu.py): set log.peak_tflops"
    return peak, f"the {name} data sheet's dense {precision} peak"


def model_flops_utilisation(
    flops_per_position: int, positions: int, seconds: float, peak_tflops_per_device: float, devices: int
) -> float:
    """The step's model FLOPs per second over the peak of all `devices`: every position of every row costs the
    model's FLOPs, padding included (the model computes it), as nanoGPT and PaLM's appendix B count them."""
    return flops_per_position * positions / seconds / (peak_tflops_per_device * 1e12 * devices)
