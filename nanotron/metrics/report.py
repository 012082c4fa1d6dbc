"""A run's figures and summary from its metrics.jsonl alone (`nanotron report`; any run dir, also one copied off a
cluster). Records a resumed run wrote twice (the steps between its checkpoint and a kill) count once: the later
record of a step wins. A figure is described as a `Plot` (what to draw, with its units) and drawn by `draw` as PNG,
PDF and SVG with its text kept as text, ready for a paper."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from nanotron.console import format_duration
from nanotron.errors import DataError
from nanotron.metrics.logger import NOT_SCALARS

FORMATS = ("png", "pdf", "svg")
TOP_STRAGGLERS = 3  # ranks drawn beside the max: one line per rank is unreadable at 512 ranks


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
            if key not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key][record["step"]] = float(value)
    return out


def events(records: list[dict]) -> list[dict]:
    """Stability actions (spikes, rollbacks) in step order."""
    return [r for r in records if isinstance(r.get("stability/action"), str)]


def duration(records: list[dict]) -> float | None:
    """Wall-clock seconds from the first record to the last (a resumed run's time between its processes included)."""
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return max(times) - min(times) if times else None


@dataclass
class Line:
    label: str
    points: dict[int, float]  # step -> value
    errors: dict[int, float] = field(default_factory=dict)  # step -> one standard error, drawn as an error bar


@dataclass
class Plot:
    """One figure: what to draw, apart from drawing it."""

    name: str  # the files' stem
    title: str
    ylabel: str  # with its unit
    lines: list[Line]
    scale: str = "linear"
    levels: list[tuple[str, float]] = field(default_factory=list)  # horizontal reference lines (chance)
    marks: list[tuple[int, str]] = field(default_factory=list)  # vertical event lines (rollbacks, spikes)


# (name, title, y label with its unit, [(key, legend label)], y scale): a figure of logged series each, loss first
SIMPLE = [
    ("loss", "Loss", "loss (nats/token)", [("loss", "train loss"), ("eval_loss", "validation loss")], "log"),
    ("learning_rate", "Learning rate", "learning rate", [("lr", "lr")], "linear"),
    ("grad_norm", "Gradient norm (before clipping)", "gradient L2 norm", [("grad_norm", "grad norm")], "log"),
    (
        "memory",
        "Peak memory (the maximum over ranks)",
        "memory (GiB)",
        [
            ("memory_gib", "allocated (RSS on CPU)"),
            ("memory_reserved_gib", "reserved"),
            ("host_memory_gib", "host RSS"),
        ],
        "linear",
    ),
    ("throughput", "Throughput", "tokens/s (all devices)", [("tokens_per_sec", "tokens/s")], "linear"),
    ("step_time", "Step time", "step time (s)", [("step_time_sec", "step time")], "linear"),
    ("tflops", "Model TFLOP/s per device", "TFLOP/s per device", [("tflops", "TFLOP/s")], "linear"),
]


def plots(data: dict[str, dict[int, float]], found: list[dict]) -> list[Plot]:
    """The figures this run has data for, in the summary's order."""
    out = [
        Plot(name, title, ylabel, [Line(label, data[key]) for key, label in keys if data.get(key)], scale)
        for name, title, ylabel, keys, scale in SIMPLE
    ]
    out[0].marks = [(e["step"], e["stability/action"]) for e in found]  # on the loss
    percent = {step: 100 * value for step, value in data.get("mfu", {}).items()}  # as the step line prints it
    out.append(Plot("mfu", "Model FLOPs utilisation", "MFU (% of peak)", [Line("MFU", percent)] if percent else []))
    out.append(_downstream(data))
    acts = sorted(key for key in data if key.startswith("act/"))
    out.append(Plot("activations", "Activations", "mean |x| per element", [Line(k[4:], data[k]) for k in acts], "log"))
    out.append(_stragglers(data))
    return [plot for plot in out if plot.lines]


def standard_error(accuracy: float, items: float) -> float:
    """The binomial standard error of an accuracy over `items` items: sqrt(p (1 - p) / n)."""
    return math.sqrt(accuracy * (1 - accuracy) / items)


def _downstream(data: dict[str, dict[int, float]]) -> Plot:
    """Each task's acc and acc_norm with binomial standard errors sqrt(p (1 - p) / items), and its chance level."""
    tasks = sorted({key.split("/")[1] for key in data if key.startswith("eval/") and key.count("/") == 2})
    lines, levels = [], []
    for task in tasks:
        items = data.get(f"eval/{task}/items", {})
        for metric in ("acc", "acc_norm"):
            if points := data.get(f"eval/{task}/{metric}"):
                errors = {s: standard_error(p, items[s]) for s, p in points.items() if items.get(s)}
                lines.append(Line(f"{task} {metric}", points, errors))
        if chance := data.get(f"eval/{task}/chance"):
            levels.append((f"chance ({task})", chance[max(chance)]))
    title = "Downstream accuracy (bars: one binomial standard error)"
    return Plot("downstream", title, "accuracy (fraction of items)", lines, levels=levels)


def _stragglers(data: dict[str, dict[int, float]]) -> Plot:
    """The max over ranks and the TOP_STRAGGLERS ranks with the worst score at any step."""
    ranks = {int(key.rsplit("_", 1)[1]): data[key] for key in data if key.startswith("straggler/rank_")}
    worst = sorted(ranks, key=lambda rank: (-max(ranks[rank].values()), rank))[:TOP_STRAGGLERS]
    lines = [Line(f"max over {len(ranks)} ranks", data["straggler/max"])] if data.get("straggler/max") else []
    lines += [Line(f"rank {rank} (worst {max(ranks[rank].values()):.2f})", ranks[rank]) for rank in worst]
    title = "Straggler scores (own time between collectives, against peers)"
    return Plot("stragglers", title, "own time beyond peers (fraction of their median)", lines)


def draw(plot: Plot, out: Path, caption: str = ""):
    """Writes NAME.png, .pdf and .svg (text as text, TrueType in the PDF: editable, accepted by publishers);
    returns the matplotlib Axes (closed: for reading back)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.fonttype": "none", "pdf.fonttype": 42}):
        fig, ax = plt.subplots(figsize=(7, 4))
        for line in plot.lines:
            steps = sorted(line.points)
            values, marker = [line.points[s] for s in steps], "o" if len(steps) < 30 else None
            if line.errors:
                errors = [line.errors.get(s, 0.0) for s in steps]
                ax.errorbar(steps, values, yerr=errors, label=line.label, marker=marker, capsize=3)
            else:
                ax.plot(steps, values, label=line.label, marker=marker)
        for label, value in plot.levels:
            ax.axhline(value, color="gray", linestyle=":", label=label)
        for step, text in plot.marks:
            ax.axvline(step, color="red", alpha=0.5, linestyle="--")
            ax.annotate(text, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", fontsize=7)
        ax.set_yscale(plot.scale)
        if plot.scale == "log":
            _plain_log_labels(ax)
        ax.set_xlabel("step")
        ax.set_ylabel(plot.ylabel)
        ax.set_title(plot.title, loc="left", fontsize=10)
        if caption:
            ax.set_title(caption, loc="right", fontsize=8, color="gray")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        for suffix in FORMATS:
            fig.savefig(out / f"{plot.name}.{suffix}", dpi=110)
        plt.close(fig)
    return ax


def _plain_log_labels(ax) -> None:
    """Log-axis ticks labelled where matplotlib would label them, as plain numbers (4, 0.3; not 4×10⁰, 3e-01)."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))


def figures(data: dict[str, dict[int, float]], found: list[dict], out: Path, caption: str = "") -> list[str]:
    """Every figure this run has data for, in each of FORMATS; the PNGs' names."""
    drawn = plots(data, found)
    for plot in drawn:
        draw(plot, out, caption)
    return [f"{plot.name}.png" for plot in drawn]


def summary(
    run_dir: Path, data: dict[str, dict[int, float]], found: list[dict], written: list[str], seconds: float | None
) -> str:
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
    if seconds is not None:
        lines.append(f"- duration: {format_duration(seconds)} wall clock, first record to last")
    if samples := data.get("consumed_samples"):
        lines.append(f"- samples trained: {int(samples[max(samples)])}")
    if evals := data.get("eval_loss"):
        best = min(evals, key=evals.get)
        lines.append(f"- validation loss: best {evals[best]:.4f} at step {best}, last {evals[max(evals)]:.4f}")
    for key in sorted(k for k in data if k.startswith("eval/") and k.endswith(("/acc", "/acc_norm"))):
        points, task = data[key], key.split("/")[1]
        best, last = max(points, key=points.get), max(points)
        line = f"- {key}: best {points[best]:.3f} at step {best}, last {points[last]:.3f}"
        items, chance = data.get(f"eval/{task}/items", {}).get(last), data.get(f"eval/{task}/chance", {}).get(last)
        if items and chance is not None:
            error = standard_error(points[last], items)
            line += f" (± {error:.3f} s.e., {items:.0f} items; chance {chance:.3f})"
        lines.append(line)
    if speed := data.get("tokens_per_sec"):
        mfu = data.get("mfu", {})
        step_time = data.get("step_time_sec", {})
        line = f"- throughput: median {statistics.median(speed.values()):.0f} tokens/s"
        line += f", {statistics.median(step_time.values()):.3f} s/step" if step_time else ""
        lines.append(line + (f", MFU {100 * statistics.median(mfu.values()):.1f}%" if mfu else ""))
    if memory := data.get("memory_gib"):
        lines.append(f"- peak memory: {max(memory.values()):.2f} GiB")
    lines += ["", "## Incidents", ""]
    incidents = [f"- step {e['step']}: stability {e['stability/action']}" for e in found]
    if straggle := data.get("straggler/max"):
        slow = sorted(step for step, value in straggle.items() if value > 0.4)
        if slow:
            incidents.append(
                f"- straggler scores above 0.4 (a rank working 1.4x as long as its peers) at steps {slow[:10]}"
            )
    incident_dir = run_dir / "incidents"
    if incident_dir.is_dir():
        for entry in sorted(incident_dir.iterdir()):
            summary_file = entry / "summary.txt"
            first = summary_file.read_text(errors="replace").splitlines()[:1] if summary_file.is_file() else []
            incidents.append(f"- {entry.name}: {first[0] if first else entry.name}")
    lines += incidents or ["- none recorded"]
    lines += ["", "## Figures", "", f"Each also as {', '.join('.' + f for f in FORMATS[1:])} (text kept as text).", ""]
    lines += [f"![{name}]({name})" for name in written]
    return "\n".join(lines) + "\n"
