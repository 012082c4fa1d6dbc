"""What a first GPU run should not have to know: the one table of device facts (peaks for MFU and the planner,
memory, links), the CUDA/NCCL environment, TF32; and, for CPU training, glibc's allocator kept from handing
freed activations back to the kernel between steps (`keep_freed_host_memory`).

Peaks are dense (no 2:4 sparsity) TFLOP/s per device from the vendors' datasheets, looked up by the exact
model and form factor in the device name (an H100 PCIe is not an H100 SXM). The float8 (e4m3) peaks are half of
the datasheets' "with sparsity" FP8 Tensor Core figures: NVIDIA H100 datasheet 3,958 (SXM), 3,026 (PCIe), 3,341
(NVL); H200 datasheet 3,958 (SXM), 3,341 (NVL); HGX B200 72 PFLOPS FP8 for 8 GPUs, GB200 NVL72 720 PFLOPS for
72; L40S 1,466, L40 724, L4 485; or the dense figure itself: H20 296, AMD MI300X / MI325X 2,614.9. Parts without
float8 tensor cores (Ampere, Volta) have None. The environment defaults are set by the trainer before CUDA or NCCL
read them; a variable already set by the user is never changed.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nanotron.config import Config

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Device:
    """One device's datasheet: dense TFLOP/s by math mode (None where it has no tensor-core path for it); for the
    GPUs `nanotron plan` plans for, also the float8 (e4m3) peak where it has float8 tensor cores; for the
    GPUs `nanotron plan` plans for, also memory as the device reports it (80 GB = 79.6 GiB), the achievable ring
    bandwidth per GPU inside a node (NVLink) and across nodes (InfiniBand), typical NCCL bus bandwidths, and the
    HBM bandwidth (datasheet): what selective recompute's element-wise reruns cost."""

    bf16: float | None
    tf32: float | None
    fp32: float | None
    fp8: float | None = None
    memory_gib: float | None = None
    nvlink_gbps: float | None = None
    ib_gbps: float | None = None
    hbm_gbps: float | None = None

    def peak(self, mode: str) -> float | None:
        """The dense peak in math `mode` (see `math_mode`; fp8: the e4m3 float8 matmuls of training.float8)."""
        return getattr(self, mode)


_H100_SXM = Device(989.4, 494.7, 66.9, 1978.9)
_H100_PCIE = Device(756.5, 378.0, 51.2, 1513.0)
_H100_NVL = Device(835.5, 417.5, 60.0, 1670.5)
_A100 = Device(312.0, 156.0, 19.5)
_HGX_H100_LINKS = {"nvlink_gbps": 360.0, "ib_gbps": 45.0}
# (model, form factor): form is "pcie", "nvl" or "" for the SXM/OAM module (or a part with one form only).
GPUS: dict[tuple[str, str], Device] = {
    ("B200", ""): Device(2250.0, 1125.0, 75.0, 4500.0),
    ("GB200", ""): Device(2500.0, 1250.0, 80.0, 5000.0),
    ("H100", ""): replace(_H100_SXM, memory_gib=79.6, hbm_gbps=3350.0, **_HGX_H100_LINKS),
    ("H100", "pcie"): _H100_PCIE,
    ("H100", "nvl"): _H100_NVL,
    ("H200", ""): replace(_H100_SXM, memory_gib=139.8, hbm_gbps=4800.0, **_HGX_H100_LINKS),
    ("H200", "nvl"): _H100_NVL,
    ("GH200", ""): _H100_SXM,
    ("H800", ""): _H100_SXM,
    ("H800", "pcie"): _H100_PCIE,
    ("H20", ""): Device(148.0, 74.0, 44.0, 296.0),
    # Memory, links and HBM of the 80 GB SXM module (the 40 GB one reports the same name without a form).
    ("A100", ""): replace(_A100, memory_gib=79.2, nvlink_gbps=230.0, ib_gbps=22.0, hbm_gbps=2039.0),
    ("A100", "pcie"): _A100,
    ("A800", ""): _A100,
    ("A800", "pcie"): _A100,
    ("A40", ""): Device(149.7, 74.8, 37.4),
    ("A10", ""): Device(125.0, 62.5, 31.2),
    ("L40S", ""): Device(362.05, 183.0, 91.6, 733.0),
    ("L40", ""): Device(181.0, 90.5, 90.5, 362.0),
    ("L4", ""): Device(121.0, 60.0, 30.3, 242.5),
    # Volta has fp16 tensor cores only: bf16 and TF32 matmuls run at (or below) the fp32 rate.
    ("V100", ""): Device(None, None, 15.7),
    ("V100", "pcie"): Device(None, None, 14.0),
    ("V100S", "pcie"): Device(None, None, 16.4),
    # ROCm reports AMD Instinct parts through torch.cuda; fp32 is the matrix-core rate.
    ("MI300X", ""): Device(1307.4, None, 163.4, 2614.9),
    ("MI325X", ""): Device(1307.4, None, 163.4, 2614.9),
}
_VENDOR_WORDS = {"NVIDIA", "TESLA", "AMD", "INSTINCT"}
# What `nanotron plan` and `launch` take for --gpu: a GPU with memory and links above, or a custom one's figures, whose
# ranges are wide enough for any part and narrow enough to catch a unit slip or a typo (inf, nan, 0 or 1e-300 make
# every estimate a division by zero or nonsense). Here, not in the planner, for the flags' help: no torch to load.
PLANNED = [model.lower() for (model, form), device in GPUS.items() if not form and device.memory_gib]
MEMORY_GIB, PEAK_TFLOPS, LINK_GBPS = (1, 10_000), (1, 100_000), (0.1, 10_000)
GPU_FORMS = (
    f"{', '.join(PLANNED)} or '<memory GiB>,<peak bf16 TFLOP/s>' with memory in [{MEMORY_GIB[0]}, {MEMORY_GIB[1]}] "
    f"GiB and peak in [{PEAK_TFLOPS[0]}, {PEAK_TFLOPS[1]}] TFLOP/s"
)


def device_model(name: str) -> tuple[str, str]:
    """(model, form factor) of a device name, e.g. 'NVIDIA H100 80GB HBM3' -> ('H100', ''),
    'NVIDIA A100-PCIE-40GB' -> ('A100', 'pcie'), 'NVIDIA H200 NVL' -> ('H200', 'nvl')."""
    words = [w for w in re.split(r"[\s_-]+", name.strip().upper()) if w and w not in _VENDOR_WORDS]
    if not words:
        return "", ""
    form = "pcie" if "PCIE" in words[1:] else "nvl" if "NVL" in words[1:] else ""
    return words[0], form


def math_mode(dtype: str, tf32: bool) -> str:
    """Which peak a run's matmuls can reach: bf16, tf32 (fp32 tensors on TF32 tensor cores) or fp32."""
    return "bf16" if dtype == "bfloat16" else "tf32" if tf32 else "fp32"


def gpu_peak_tflops(name: str, mode: str) -> float | None:
    """The dense peak of device `name` in math `mode`, or None when the table doesn't know it."""
    device = GPUS.get(device_model(name))
    return None if device is None else device.peak(mode)


def device_memory_gib(device: torch.device) -> float | None:
    """A CUDA device's memory in GiB; None for a CPU (no device memory to plan against)."""
    import torch  # here and below: importing this module (for the environment defaults) loads no torch

    return torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None


def set_matmul_precision(cfg: Config, device: torch.device) -> None:
    """fp32 matmuls on TF32 tensor cores (training.tf32) on CUDA; CPU keeps full fp32 whatever the key."""
    import torch

    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.training.tf32 else "highest")


# glibc malloc's settings (mallopt(3)): buffers from M_MMAP_THRESHOLD up are mmapped and unmapped on free (by
# default the threshold adapts, up to 32 MiB), and free memory past M_TRIM_THRESHOLD at the heap's top goes back
# to the kernel. Both are C ints.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HOST_MMAP_THRESHOLD = 256 << 20
HOST_TRIM_THRESHOLD = 1 << 30
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_host_memory(device: torch.device, environ: Mapping[str, str] = os.environ, libc=None) -> str | None:
    """On a CPU run, keeps glibc from returning freed buffers to the kernel: each step frees and re-allocates the
    same activations, and with glibc's defaults many of them are fresh mappings every step, so every page is
    faulted in and zeroed by the kernel again (16-47k faults per step of torchtitan's 6M debug model at batch
    8 x 512 here, its logits alone 32 MiB; 0-2k with these settings). Buffers up to 256 MiB come from the heap and
    up to 1 GiB of free heap is kept; peak memory is unchanged (freed memory is reused, not added). The same
    idea as the jemalloc settings of PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`). Nothing is changed
    on CUDA devices, where the host allocates little per step, or where the user set glibc's malloc variables
    (MALLOC_*_ or GLIBC_TUNABLES), or without glibc. What to say on the run's opening line, or None when nothing
    was changed."""
    if device.type != "cpu" or any(name in environ for name in _USER_MALLOC_SETTINGS):
        return None
    try:
        mallopt = (libc or ctypes.CDLL(None)).mallopt
    except (AttributeError, OSError):  # not glibc (macOS, musl without mallopt)
        return None
    if mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD) != 1:
        return None
    return (
        f"host memory kept for reuse (glibc malloc: mmap threshold {HOST_MMAP_THRESHOLD >> 20} MiB, trim "
        f"{HOST_TRIM_THRESHOLD >> 30} GiB; MALLOC_*_ or GLIBC_TUNABLES to choose)"
    )


# ---- environment -----------------------------------------------------------------------------------

FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per process group for the dump on a timeout
# A variable counts as set by the user under its current name or its older/newer alias.
_ALIASES = {
    "PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_ALLOC_CONF",),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
}


def env_defaults(run_dir: Path, max_connections: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The CUDA/NCCL variables to set for a run in `run_dir` (CUDA_DEVICE_MAX_CONNECTIONS: its layout's, see
    `nanotron.parallel.overlap`): those not already set (under any alias) in `environ`.

    expandable_segments lets the caching allocator grow segments instead of fragmenting (fewer OOMs at the
    same allocated bytes); the NCCL flight recorder keeps the last collectives of every process group and
    dumps them to <run dir>/nccl_trace_rank_<rank> when a collective times out, so a hang leaves evidence.
    """
    wanted = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir.absolute() / "nccl_trace_rank_"),
    }
    if max_connections is not None:
        wanted["CUDA_DEVICE_MAX_CONNECTIONS"] = max_connections
    return {
        key: value
        for key, value in wanted.items()
        if not any(name in environ for name in (key, *_ALIASES.get(key, ())))
    }


def apply_env_defaults(run_dir: Path, max_connections: str | None) -> dict[str, str]:
    """Sets `env_defaults` in this process (and so in the ranks it starts); call it before anything touches
    CUDA: CUDA_DEVICE_MAX_CONNECTIONS is read when the CUDA context is created, the rest at first use."""
    defaults = env_defaults(run_dir, max_connections)
    os.environ.update(defaults)
    return defaults
