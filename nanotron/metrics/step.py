"""What a logged step measures: throughput and MFU (against a device's peak), peak memory over all ranks, the
step time and ETA, and the line that opens a run's log."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
import torch.distributed as dist

from nanotron.config import Config
from nanotron.console import say
from nanotron.gpu import gpu_peak_tflops, math_mode
from nanotron.models.shapes import active_params, num_params


def detect_peak_tflops(device: torch.device, dtype: str, tf32: bool) -> float:
    """Per-device peak for MFU: the GPU table (0 with a warning for a device it doesn't know); on CPU, a
    measured matmul rate (what one rank really gets: the best of a few 1024^3 probes in the layouts of a linear
    layer's forward, x @ W^T, and weight gradient, dY^T @ x; a CPU without native bf16 runs a plain contiguous
    a @ b 10-20x slower, which put a bf16 run's MFU at 425 %)."""
    mode = math_mode(dtype, tf32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, mode)
        if peak is None:
            say(
                f"warning: no {mode} peak TFLOP/s known for '{name}', so MFU is logged as 0; set "
                f"logging.peak_tflops to the device's dense {mode} peak from its datasheet"
            )
        return peak or 0.0
    a, b = torch.randn(2, 1024, 1024, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    rates = []
    for product in (lambda: a @ b.t(), lambda: a.t() @ b):  # two operands: a @ a^T may be taken as symmetric
        product()
        for _ in range(3):
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.1:
                product()
                n += 1
            rates.append(2 * 1024**3 * n / (time.perf_counter() - start) / 1e12)
    return max(rates)


def memory_record(device: torch.device) -> dict[str, float]:
    """Peak memory of the rank that must fit (e.g. the first 1F1B stage): the maximum over all ranks of
    allocated and reserved (allocated + cached: fragmentation) device memory and host RSS on GPU, of RSS
    alone on CPU. A collective of a few numbers that every rank calls (on logging steps only)."""
    if device.type != "cuda":
        local = {"memory_gib": _peak_rss_gib()}
    else:
        local = {
            "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "memory_total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
            "host_memory_gib": _peak_rss_gib(),
        }
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    values = torch.tensor(list(local.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(local, values.tolist()))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def throughput(tokens: int, flops: float, step_time: float, world_size: int, peak_tflops: float) -> dict:
    tflops = flops / step_time / world_size / 1e12
    return {
        "tokens_per_sec": tokens / step_time,
        "tokens_per_sec_per_device": tokens / step_time / world_size,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else 0.0,
    }


def step_record(state: Any, loss: float | None, lr: float, grad_norm: float, step_time: float, eta: float) -> dict:
    """The fields of a logged training step that the trainer's state knows (throughput is added by the caller)."""
    return {
        "step": state.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_time_sec": step_time,
        "consumed_samples": state.consumed_samples,
        "consumed_tokens": state.consumed_tokens,
        "eta_sec": eta,
    }


def run_line(cfg: Config, corpus: Any, world_size: int, device: torch.device, start_step: int) -> str:
    """The one line that opens a run's log: model, layout, batch, data and where it starts."""
    p, t, moe = cfg.parallelism, cfg.training, cfg.model.moe
    params = f"{num_params(cfg.model) / 1e6:.2f}M params"
    if moe.enabled:
        params += (
            f" ({active_params(cfg.model) / 1e6:.2f}M active: {moe.num_experts} experts, top {moe.top_k}"
            f"{f', ep={p.ep}' if p.ep > 1 else ''})"
        )
    return (
        f"nanotron | {params} | dp={p.dp}{f' cp={p.cp}' if p.cp > 1 else ''} "
        f"tp={p.tp} pp={p.pp} ({p.pp_engine}, tp_mode={p.tp_mode}, zero_stage={p.zero_stage}"
        f"{', attention=document' if cfg.model.attention == 'document' else ''}) on {world_size} x "
        f"{device.type} | global batch {t.global_batch_size} x {t.seq_len} tokens "
        f"(micro_batch_size={t.micro_batch_size}, grad_accum_steps={t.grad_accum_steps}) | "
        f"{corpus.num_train_samples} train / {corpus.num_val_samples} val samples | "
        f"run dir {cfg.run_dir} | start step {start_step}"
    )


class StepTimer:
    """Mean step time over the steps since the last lap, and the ETA from the run's mean so far."""

    def __init__(self, start_step: int, total_steps: int):
        self.total = total_steps
        self.run_start = self.lap_start = time.perf_counter()
        self.first_step = self.lap_step = start_step

    def lap(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        step_time = (now - self.lap_start) / max(step - self.lap_step, 1)
        eta = (now - self.run_start) / max(step - self.first_step, 1) * (self.total - step)
        self.lap_start, self.lap_step = now, step
        return step_time, eta
