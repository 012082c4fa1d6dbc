"""Step metrics: one fixed log line per logged step, metrics.jsonl, TensorBoard scalars, MFU; profiling."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanotron.config import Config, ProfilerConfig
from nanotron.errors import storage_errors
from nanotron.gpu import gpu_peak_tflops, math_mode
from nanotron.models.shapes import active_params, num_params


def detect_peak_tflops(device: torch.device, dtype: str, tf32: bool) -> float:
    """Per-device peak for MFU: the GPU table (0 with a warning for a device it doesn't know); on CPU, a
    measured matmul rate (what one rank really gets: the best of a few 1024^3 probes)."""
    mode = math_mode(dtype, tf32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, mode)
        if peak is None:
            print(
                f"warning: no {mode} peak TFLOP/s known for '{name}', so MFU is logged as 0; set "
                f"logging.peak_tflops to the device's dense {mode} peak from its datasheet",
                flush=True,
            )
        return peak or 0.0
    a = torch.randn(1024, 1024, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    torch.mm(a, a)
    rates = []
    for _ in range(3):
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.1:
            torch.mm(a, a)
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
            "host_memory_gib": _peak_rss_gib(),
        }
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    values = torch.tensor(list(local.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(local, values.tolist()))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


METRICS_HINT = "free space or fix the run dir (job.out_dir), then resume from the last checkpoint"


class MetricsLogger:
    """Writes on the logging rank only; every other rank gets a no-op logger."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: Any = None):
        self.enabled = enabled
        self.writer = None
        self.file = None
        self.wandb = wandb  # a WandbRun, or None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        with storage_errors("write metrics", self.path, METRICS_HINT):
            self.file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        with storage_errors("write metrics", self.path, METRICS_HINT):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(record)
        if line:
            print(line, flush=True)

    def log_step(self, record: dict, total_steps: int) -> None:
        """A training step's record as metrics and the step line."""
        self.log(record, step_line(record, total_steps))

    def resumed(self, step: int) -> None:
        """A resume from `step`'s checkpoint: W&B gets again what an earlier process may have lost (see wandb_log)."""
        if self.wandb is not None and self.path.is_file():
            self.wandb.resend(self.path, step)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # its buffered line failed to write: already reported by `log`
                pass
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


def step_line(r: dict, total_steps: int) -> str:
    """The one log line per step; fixed field order so benchmarks can parse it with a regex."""
    return (
        f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad_norm {r['grad_norm']:.3f}"
        f" | tokens/s {r['tokens_per_sec']:.0f} | tflops {r['tflops']:.3f} | mfu {100 * r['mfu']:.2f}%"
        f" | mem {r['memory_gib']:.2f}GiB{_memory_detail(r)} | eta {format_duration(r['eta_sec'])}"
    )


def _memory_detail(r: dict) -> str:
    if "memory_reserved_gib" not in r:
        return ""
    return f" (reserved {r['memory_reserved_gib']:.2f}GiB, host {r['host_memory_gib']:.2f}GiB)"


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


class Profiler:
    """torch.profiler traces (TensorBoard/Chrome JSON) of a few steps, or a no-op when profiling is off."""

    def __init__(self, profile: torch.profiler.profile | None):
        self.profile = profile

    @classmethod
    def start(cls, cfg: ProfilerConfig, device: torch.device, worker: str, enabled: bool) -> Profiler:
        """Profiles on rank 0 and the logging rank (`enabled`), when profiler.export_path is set."""
        if not cfg.export_path or not enabled:
            return cls(None)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=cfg.wait_steps, warmup=1, active=cfg.active_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.export_path, worker_name=worker),
            record_shapes=True,
            profile_memory=True,
        )
        profile.start()
        return cls(profile)

    def step(self) -> None:
        if self.profile is not None:
            self.profile.step()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.stop()
