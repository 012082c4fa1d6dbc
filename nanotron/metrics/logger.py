"""The logging rank's sinks: the step line on the console, metrics.jsonl, TensorBoard and (optionally) W&B."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from nanotron.errors import storage_errors


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
        """A resume from `step`'s checkpoint: W&B gets again what an earlier process may have lost (see wandb_run)."""
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
