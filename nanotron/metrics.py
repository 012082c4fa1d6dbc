"""Step metrics: one fixed log line per logged step, metrics.jsonl, TensorBoard scalars, MFU."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

# Dense bf16 peak TFLOP/s per GPU by name fragment (fp32 runs use the TF32 peak, half of it).
GPU_PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}


def detect_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Per-device peak: a table for GPUs; on CPU, a measured matmul rate (what one rank really gets)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), 0.0)
        return peak if dtype == torch.bfloat16 else peak / 2
    a = torch.randn(512, 512, dtype=dtype)
    torch.mm(a, a)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        torch.mm(a, a)
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start) / 1e12


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class MetricsLogger:
    """Writes on the logging rank only; every other rank gets a no-op logger."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.writer = None
        self.file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if line:
            print(line, flush=True)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def step_line(r: dict, total_steps: int) -> str:
    """The one log line per step; fixed field order so benchmarks can parse it with a regex."""
    return (
        f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad_norm {r['grad_norm']:.3f}"
        f" | tokens/s {r['tokens_per_sec']:.0f} | tflops {r['tflops']:.3f} | mfu {100 * r['mfu']:.2f}%"
        f" | mem {r['memory_gib']:.2f}GiB | eta {format_duration(r['eta_sec'])}"
    )
