"""A run's figures and summary from its metrics.jsonl alone (`nanotron report`; any run dir, also one copied off a
cluster). Records a resumed run wrote twice (the steps between its checkpoint and a kill) count once: the later
record of a step wins."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from nanotron.errors import DataError


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"'{run_dir}' has no metrics.jsonl; expected a run dir (job.out_dir/job.name)")
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise DataError(f"'{path}' holds no metrics records yet")
    return records


def series(records: list[dict]) -> dict[str, dict[int, float]]:
    """key -> {step: value} of every numeric metric; a later record of a step replaces an earlier one."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key][record["step"]] = float(value)
    return out


def events(records: list[dict]) -> list[dict]:
    """Stability actions (spikes, rollbacks) in step order."""
    return [r for r in records if isinstance(r.get("stability/action"), str)]


# (file, title, [(key or key prefix, label)], y-scale)
FIGURES = [
    ("loss.png", "Loss", [("loss", "train loss"), ("eval_loss", "validation loss")], "log"),
    ("learning_rate.png", "Learning rate", [("lr", "lr")], "linear"),
    ("grad_norm.png", "Gradient norm (before clipping)", [("grad_norm", "grad norm")], "log"),
    (
        "memory.png",
        "Peak memory (GiB)",
        [("memory_gib", "allocated / RSS"), ("memory_reserved_gib", "reserved")],
        "linear",
    ),
]


def _plot(plt, out: Path, title: str, lines: list[tuple[str, dict[int, float]]], scale: str, marks=()) -> bool:
    lines = [(label, points) for label, points in lines if points]
    if not lines:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in lines:
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], label=label, marker="o" if len(steps) < 30 else None)
    for step, text in marks:
        ax.axvline(step, color="red", alpha=0.5, linestyle="--")
        ax.annotate(text, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", fontsize=7)
    ax.set_yscale(scale)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def figures(data: dict[str, dict[int, float]], found: list[dict], out: Path) -> list[str]:
    """The PNGs this run has data for; their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    marks = [(e["step"], e["stability/action"]) for e in found]
    for name, title, keys, scale in FIGURES:
        lines = [(label, data.get(key, {})) for key, label in keys]
        if _plot(plt, out / name, title, lines, scale, marks if name == "loss.png" else ()):
            written.append(name)
    tasks = sorted({key.split("/")[1] for key in data if key.startswith("eval/") and key.count("/") == 2})
    lines = [(f"{t} {m}", data.get(f"eval/{t}/{m}", {})) for t in tasks for m in ("acc", "acc_norm")]
    if _plot(plt, out / "downstream.png", "Downstream accuracy", lines, "linear"):
        written.append("downstream.png")
    speed = [("tokens/s", data.get("tokens_per_sec", {}))]
    if _plot(plt, out / "throughput.png", "Throughput (tokens/s)", speed, "linear"):
        written.append("throughput.png")
    if _plot(plt, out / "mfu.png", "Model FLOPs utilisation", [("MFU", data.get("mfu", {}))], "linear"):
        written.append("mfu.png")
    acts = sorted(key for key in data if key.startswith("act/"))
    if _plot(plt, out / "activations.png", "Activations (mean |x|)", [(k[4:], data[k]) for k in acts], "log"):
        written.append("activations.png")
    stragglers = [(k.split("/")[1], data[k]) for k in sorted(data) if k.startswith("straggler/rank_")]
    if _plot(plt, out / "stragglers.png", "Straggler scores (fraction of a step late)", stragglers, "linear"):
        written.append("stragglers.png")
    return written


def summary(run_dir: Path, data: dict[str, dict[int, float]], found: list[dict], written: list[str]) -> str:
    lines = [f"# Run report: {run_dir.name}", ""]
    config = run_dir / "config.toml"
    if config.is_file():
        from nanotron.config import load_config
        from nanotron.parallel.layout import layout_line

        try:
            cfg = load_config(str(config), [], saved=True)
            m, t = cfg.model, cfg.training
            lines += [
                f"- model: {m.size or 'custom'} (hidden {m.hidden_size}, {m.num_layers} layers), seq_len {t.seq_len}, "
                f"global batch {t.global_batch_size}",
                f"- layout: {layout_line(cfg)}",
            ]
        except Exception as error:  # noqa: BLE001 - a config of another version: the report goes on without it
            lines.append(f"- config: unreadable here ({str(error).splitlines()[0]})")
    loss = data.get("loss", {})
    if loss:
        last = max(loss)
        lines.append(f"- steps: {last} logged; final train loss {loss[last]:.4f} (best {min(loss.values()):.4f})")
    if samples := data.get("consumed_samples"):
        lines.append(f"- samples trained: {int(samples[max(samples)])}")
    if evals := data.get("eval_loss"):
        best = min(evals, key=evals.get)
        lines.append(f"- validation loss: best {evals[best]:.4f} at step {best}, last {evals[max(evals)]:.4f}")
    for key in sorted(k for k in data if k.startswith("eval/") and k.endswith(("/acc", "/acc_norm"))):
        points = data[key]
        best = max(points, key=points.get)
        lines.append(f"- {key}: best {points[best]:.3f} at step {best}, last {points[max(points)]:.3f}")
    if speed := data.get("tokens_per_sec"):
        mfu = data.get("mfu", {})
        line = f"- throughput: median {statistics.median(speed.values()):.0f} tokens/s"
        lines.append(line + (f", MFU {100 * statistics.median(mfu.values()):.1f}%" if mfu else ""))
    if memory := data.get("memory_gib"):
        lines.append(f"- peak memory: {max(memory.values()):.2f} GiB")
    lines += ["", "## Incidents", ""]
    incidents = [f"- step {e['step']}: stability {e['stability/action']}" for e in found]
    if straggle := data.get("straggler/max"):
        late = sorted(step for step, value in straggle.items() if value > 0.25)
        if late:
            incidents.append(f"- straggler scores above 0.25 of a step at steps {late[:10]}")
    incident_dir = run_dir / "incidents"
    if incident_dir.is_dir():
        for entry in sorted(incident_dir.iterdir()):
            summary_file = entry / "summary.txt"
            text = summary_file.read_text(errors="replace").splitlines()[0] if summary_file.is_file() else entry.name
            incidents.append(f"- {entry.name}: {text}")
    lines += incidents or ["- none recorded"]
    lines += ["", "## Figures", ""] + [f"![{name}]({name})" for name in written]
    return "\n".join(lines) + "\n"
