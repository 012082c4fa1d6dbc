"""What a first GPU run should not have to know: device peaks for MFU, the CUDA/NCCL environment, TF32.

Peaks are dense (no 2:4 sparsity) TFLOP/s per device from the vendors' datasheets, looked up by the exact
model and form factor in the device name (an H100 PCIe is not an H100 SXM). The environment defaults are
set by the trainer before CUDA or NCCL read them; a variable already set by the user is never changed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nanotron.config import Config


@dataclass(frozen=True)
class DevicePeak:
    """Dense TFLOP/s by math mode; None where the device has no tensor-core path for it."""

    bf16: float | None
    tf32: float | None
    fp32: float


_H100_SXM = DevicePeak(989.4, 494.7, 66.9)
_H100_PCIE = DevicePeak(756.5, 378.0, 51.2)
_H100_NVL = DevicePeak(835.5, 417.5, 60.0)
_A100 = DevicePeak(312.0, 156.0, 19.5)
# (model, form factor): form is "pcie", "nvl" or "" for the SXM/OAM module (or a part with one form only).
GPU_PEAKS: dict[tuple[str, str], DevicePeak] = {
    ("B200", ""): DevicePeak(2250.0, 1125.0, 75.0),
    ("GB200", ""): DevicePeak(2500.0, 1250.0, 80.0),
    ("H200", ""): _H100_SXM,
    ("H200", "nvl"): _H100_NVL,
    ("H100", ""): _H100_SXM,
    ("H100", "pcie"): _H100_PCIE,
    ("H100", "nvl"): _H100_NVL,
    ("GH200", ""): _H100_SXM,
    ("H800", ""): _H100_SXM,
    ("H800", "pcie"): _H100_PCIE,
    ("H20", ""): DevicePeak(148.0, 74.0, 44.0),
    ("A100", ""): _A100,
    ("A100", "pcie"): _A100,
    ("A800", ""): _A100,
    ("A800", "pcie"): _A100,
    ("A40", ""): DevicePeak(149.7, 74.8, 37.4),
    ("A10", ""): DevicePeak(125.0, 62.5, 31.2),
    ("L40S", ""): DevicePeak(362.05, 183.0, 91.6),
    ("L40", ""): DevicePeak(181.0, 90.5, 90.5),
    ("L4", ""): DevicePeak(121.0, 60.0, 30.3),
    # Volta has fp16 tensor cores only: bf16 and TF32 matmuls run at (or below) the fp32 rate.
    ("V100", ""): DevicePeak(None, None, 15.7),
    ("V100", "pcie"): DevicePeak(None, None, 14.0),
    ("V100S", "pcie"): DevicePeak(None, None, 16.4),
    # ROCm reports AMD Instinct parts through torch.cuda; fp32 is the matrix-core rate.
    ("MI300X", ""): DevicePeak(1307.4, None, 163.4),
    ("MI325X", ""): DevicePeak(1307.4, None, 163.4),
}
_VENDOR_WORDS = {"NVIDIA", "TESLA", "AMD", "INSTINCT"}


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
    peak = GPU_PEAKS.get(device_model(name))
    return None if peak is None else getattr(peak, mode)


def async_tp_unavailable(cfg: Config, device: torch.device) -> str | None:
    """Why parallelism.tp_linear_async_communication can't take effect here (None: it can).

    Async TP is inductor's micro-pipelining of sequence parallelism: it splits each all-gather before a
    column-parallel matmul and each reduce-scatter after a row-parallel one into chunks that overlap the
    matmul. Plain Megatron TP (all_reduce) has neither pattern, so there it would overlap nothing.
    """
    p = cfg.parallelism
    if p.tp == 1:
        return "async TP needs tp > 1"
    if p.tp_mode == "all_reduce":
        return (
            "with tp_mode='all_reduce' async TP has nothing to overlap (it overlaps the all-gathers and "
            "reduce-scatters of tp_mode='reduce_scatter' with the matmuls); use tp_mode='reduce_scatter'"
        )
    if not cfg.training.compile:
        return "async TP is an inductor pass: it needs training.compile=true"
    if device.type != "cuda":
        return "async TP needs CUDA (symmetric memory)"
    return None


def set_matmul_precision(cfg: Config, device: torch.device) -> None:
    """fp32 matmuls on TF32 tensor cores (training.tf32) on CUDA; CPU keeps full fp32 whatever the key."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.training.tf32 else "highest")


# ---- environment -----------------------------------------------------------------------------------

FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per process group for the dump on a timeout
# A variable counts as set by the user under its current name or its older/newer alias.
_ALIASES = {
    "PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_ALLOC_CONF",),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
}


def max_connections(cfg: Config) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS for this layout (None: CUDA's default).

    1 (one hardware queue: kernels start in launch order) is Megatron's trick so TP collectives start
    before the compute queued after them; it helps only where TP is the only traffic. With data-parallel
    (FSDP2 all-gathers, reduce-scatters), pipeline (send/recv) or async-TP streams it serialises their
    communication with compute, so those layouts get 32, the number of streams FSDP2's authors advise.
    """
    p = cfg.parallelism
    if cfg.world_size == 1:
        return None
    async_tp = p.tp_linear_async_communication and async_tp_unavailable(cfg, torch.device("cuda")) is None
    if p.tp > 1 and p.dp == 1 and p.pp == 1 and not async_tp:
        return "1"
    return "32"


def env_defaults(cfg: Config, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The CUDA/NCCL variables to set for this run: those not already set (under any alias) in `environ`.

    expandable_segments lets the caching allocator grow segments instead of fragmenting (fewer OOMs at the
    same allocated bytes); the NCCL flight recorder keeps the last collectives of every process group and
    dumps them to <run dir>/nccl_trace_rank_<rank> when a collective times out, so a hang leaves evidence.
    """
    wanted = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(cfg.run_dir.absolute() / "nccl_trace_rank_"),
    }
    connections = max_connections(cfg)
    if connections is not None:
        wanted["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    return {
        key: value
        for key, value in wanted.items()
        if not any(name in environ for name in (key, *_ALIASES.get(key, ())))
    }


def apply_env_defaults(cfg: Config) -> dict[str, str]:
    """Sets `env_defaults` in this process (and so in the ranks it starts); call it before anything touches
    CUDA: CUDA_DEVICE_MAX_CONNECTIONS is read when the CUDA context is created, the rest at first use."""
    defaults = env_defaults(cfg)
    os.environ.update(defaults)
    return defaults
