"""The logging rank's sinks: the step line on the console (timestamped, `nanotron.console`), metrics.jsonl (every
record with its wall-clock `time`), TensorBoard and (optionally) W&B; and what the run's summary line reports."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nanotron.console import format_count, format_duration, say
from nanotron.errors import storage_errors

METRICS_HINT = "free space or fix the run dir (job.out_dir), then resume from the last checkpoint"
NOT_SCALARS = ("step", "time")  # what TensorBoard and W&B get as the axis, not as a series


class MetricsLogger:
    """Writes on the logging rank only; every other rank gets a no-op logger."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: Any = None):
        self.enabled = enabled
        self.writer = None
        self.file = None
        self.wandb = wandb  # a WandbRun, or None
        self.last: dict[str, tuple[int, float]] = {}  # key -> (step, value) of its latest record, for the summary
        self.best_eval: tuple[int, float] | None = None
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
        record = record | {"time": round(time.time(), 3)}
        with storage_errors("write metrics", self.path, METRICS_HINT):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        scalars = {k: v for k, v in record.items() if k not in NOT_SCALARS and isinstance(v, (int, float))}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({"step": record["step"]} | scalars)
        self._remember(record["step"], scalars)
        if line:
            say(line)

    def _remember(self, step: int, scalars: dict[str, float]) -> None:
        self.last |= {key: (step, value) for key, value in scalars.items()}
        if "eval_loss" in scalars and (self.best_eval is None or scalars["eval_loss"] < self.best_eval[1]):
            self.best_eval = (step, scalars["eval_loss"])

    def log_step(self, record: dict, total_steps: int) -> None:
        """A training step's record as metrics and the step line."""
        self.log(record, step_line(record, total_steps))

    def resumed(self, step: int) -> None:
        """A resume from `step`'s checkpoint: W&B gets again what an earlier process may have lost (see wandb_run)."""
        if self.wandb is not None and self.path.is_file():
            self.wandb.resend(self.path, step)

    def info(self, message: str) -> None:
        if self.enabled:
            say(message)

    def summary(self, first_step: int, steps: int, tokens: int, seconds: float, where: list[str]) -> None:
        """The run's last line: what it trained this time, how long it took, its last scores, where things are."""
        if not self.enabled:
            return
        parts = [f"run done: steps {first_step + 1}-{first_step + steps} ({steps} this run)"]
        parts.append(f"{format_count(tokens)} tokens in {format_duration(seconds)}")
        if "loss" in self.last:
            parts.append(f"last loss {self.last['loss'][1]:.4f}")
        if self.best_eval is not None:
            step, value = self.best_eval
            parts.append(f"eval_loss {self.last['eval_loss'][1]:.4f} (best {value:.4f} at step {step})")
        accuracies = sorted(key for key in self.last if key.startswith("eval/") and key.endswith("/acc"))
        parts += [f"{key.split('/')[1]} acc {self.last[key][1]:.3f}" for key in accuracies]
        say(" | ".join([*parts, *where]))

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
    """The one log line per step; fixed field order so benchmarks can parse it with a regex (the console adds the
    time of day in front)."""
    per_device = r["tokens_per_sec_per_device"]
    return (
        f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad_norm {r['grad_norm']:.3f}"
        f" | {r['step_time_sec']:.3f}s/step | tokens/s {r['tokens_per_sec']:,.0f} ({per_device:,.0f}/device)"
        f" | tflops {r['tflops']:.3f} | mfu {100 * r['mfu']:.2f}% | mem {r['memory_gib']:.2f}GiB{_memory_detail(r)}"
        f" | tokens {format_count(r['consumed_tokens'])} | eta {format_duration(r['eta_sec'])}"
    )


def _memory_detail(r: dict) -> str:
    if "memory_reserved_gib" not in r:
        return ""
    share = f"{r['memory_reserved_gib'] / r['memory_total_gib']:.0%} of {r['memory_total_gib']:.0f}GiB, "
    return f" ({share}reserved {r['memory_reserved_gib']:.2f}GiB, host {r['host_memory_gib']:.2f}GiB)"
