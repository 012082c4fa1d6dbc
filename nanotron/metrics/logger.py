"""The logging rank's sinks: the step line on the console (timestamped, `nanotron.console`), metrics.jsonl (every
record with its wall-clock `time`), TensorBoard and (optionally) W&B; and what the run's summary line reports.

metrics.jsonl is the record: a failure to write it stops the run in one line. TensorBoard and W&B are views of it:
a tracker's failure (its disk full, its service gone) is one warning line, it gets nothing more, the run goes on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from nanotron.console import format_count, format_duration, quiet_handler_errors, say
from nanotron.errors import short, storage_errors

METRICS_HINT = "free space or fix the run dir (job.out_dir), then resume from the last checkpoint"
NOT_SCALARS = ("step", "time")  # what TensorBoard and W&B get as the axis, not as a series


class MetricsLogger:
    """Writes on the logging rank only; every other rank gets a no-op logger."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: Any = None):
        self.enabled = enabled
        self.file = None
        self.trackers: dict[str, Any] = {}  # name -> TensorBoard or WandbRun: log(record), close()
        self.last: dict[str, tuple[int, float]] = {}  # key -> (step, value) of its latest record, for the summary
        self.best_eval: tuple[int, float] | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        with storage_errors("write metrics", self.path, METRICS_HINT):
            self.file = open(self.path, "a")
        board = self._send("TensorBoard", partial(TensorBoard, run_dir / "tensorboard")) if tensorboard else None
        self.trackers = {name: t for name, t in (("TensorBoard", board), ("W&B", wandb)) if t is not None}

    def _send(self, tracker: str, action: Callable[[], Any]) -> Any:
        """`action()`'s result; its failure is one warning line, and `tracker` gets nothing more (None)."""
        try:
            with quiet_handler_errors():
                return action()
        except Exception as error:  # noqa: BLE001 - a disk, a network, a service: none of them may stop the run
            self.trackers.pop(tracker, None)
            say(f"warning: {tracker} failed ({short(error)}); it gets nothing more, metrics.jsonl keeps every record")
            return None

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        record = record | {"time": round(time.time(), 3)}
        with storage_errors("write metrics", self.path, METRICS_HINT):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        scalars = {k: v for k, v in record.items() if k not in NOT_SCALARS and isinstance(v, (int, float))}
        for name, tracker in list(self.trackers.items()):
            self._send(name, partial(tracker.log, {"step": record["step"]} | scalars))
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
        if "W&B" in self.trackers and self.path.is_file():
            self._send("W&B", partial(self.trackers["W&B"].resend, self.path, step))

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
        for name, tracker in list(self.trackers.items()):
            self._send(name, tracker.close)


class TensorBoard:
    """Every scalar of a record as a TensorBoard series in `folder`, the step as the axis."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        _drop_tensorboard_thread_errors()
        self.writer = SummaryWriter(log_dir=str(folder))

    def log(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def step_line(r: dict, total_steps: int) -> str:
    """The one log line per step; fixed field order so benchmarks can parse it with a regex (the console adds the
    time of day in front)."""
    per_device = r["tokens_per_sec_per_device"]
    return (
        f"step {r['step']}/{total_steps} | loss {r['loss']:.4f}{_loss_detail(r)} | lr {r['lr']:.3e}"
        f" | grad_norm {r['grad_norm']:.3f}"
        f" | {r['step_time_sec']:.3f}s/step | tokens/s {r['tokens_per_sec']:,.0f} ({per_device:,.0f}/device)"
        f" | tflops {r['tflops']:.3f} | mfu {100 * r['mfu']:.2f}% | mem {r['memory_gib']:.2f}GiB{_memory_detail(r)}"
        f" | tokens {format_count(r['consumed_tokens'])} | eta {format_duration(r['eta_sec'])}"
    )


def _loss_detail(r: dict) -> str:
    """Beside the main loss, what training adds to it and the loss does not include: multi-token prediction's loss
    (mean over its depths) and the z-loss's mean log(Z)^2 (before training.z_loss's weight)."""
    parts = [f"{name} {r[key]:.4f}" for name, key in (("mtp", "mtp_loss"), ("z", "z_loss")) if key in r]
    return f" ({', '.join(parts)})" if parts else ""


def _memory_detail(r: dict) -> str:
    if "memory_reserved_gib" not in r:
        return ""
    share = f"{r['memory_reserved_gib'] / r['memory_total_gib']:.0%} of {r['memory_total_gib']:.0f}GiB, "
    return f" ({share}reserved {r['memory_reserved_gib']:.2f}GiB, host {r['host_memory_gib']:.2f}GiB)"


def _drop_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread keeps its error and raises it again at the writer's next call, where it becomes
    the one warning: the stack threading prints when that thread dies would be a second, longer report."""
    printing = threading.excepthook
    if getattr(printing, "drops_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not type(args.thread).__module__.startswith("tensorboard."):
            printing(args)

    hook.drops_tensorboard = True
    threading.excepthook = hook
