"""The coordinate check's verdict (log-log slopes per statistic), table and figures."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from nanotron.coord_check.runs import ACTIVATIONS, MATRICES
from nanotron.errors import DataError

PARAMETRIZATIONS = ("standard", "mup")
LABEL = {"standard": "standard", "mup": "µP"}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-30)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def verdicts(rows: list[dict], steps: int, tolerance: float) -> list[dict]:
    """A row per (sweep, statistic): its slope under each parametrization at the last step, and the verdict."""
    table: dict[tuple[str, str], dict] = {}
    for sweep in ("width", "depth"):
        for parametrization in PARAMETRIZATIONS:
            points: dict[str, dict[int, list[float]]] = {}
            for r in rows:
                if (r["sweep"], r["parametrization"], r["step"]) == (sweep, parametrization, steps):
                    points.setdefault(r["statistic"], {}).setdefault(r["size"], []).append(r["value"])
            for statistic, by_size in points.items():
                xs = sorted(by_size)
                if len(xs) < 2:
                    continue
                s = slope(xs, [statistics.fmean(by_size[x]) for x in xs])
                spread = max(statistics.fmean(v) for v in by_size.values()) / min(
                    statistics.fmean(v) for v in by_size.values()
                )
                row = table.setdefault((sweep, statistic), {"sweep": sweep, "statistic": statistic})
                row[f"{LABEL[parametrization]} slope"] = round(s, 3)
                row[f"{LABEL[parametrization]} max/min"] = round(spread, 3)
                row[f"{LABEL[parametrization]} flat"] = abs(s) <= tolerance
    return list(table.values())


def plot(rows: list[dict], sweep: str, family: str, steps: int, out: Path, caption: str) -> bool:
    """One figure per sweep and statistic family (`rows` holds some; False without matplotlib): a column per
    quantity, a row per parametrization (standard above µP, each column on one shared y-axis), x the size and y the
    value (both log), a line per step coloured by the step (colour bar), error bars ±1 s.d. over seeds, and the last
    step's slope in each panel."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = sorted({r["statistic"] for r in rows if r["statistic"].startswith(family + "/")}, key=_order)
    labels = [p for p in PARAMETRIZATIONS if any(r["parametrization"] == p for r in rows)]
    fig, axes = plt.subplots(
        len(labels), len(kinds), figsize=(2.6 * len(kinds) + 1.2, 2.5 * len(labels) + 0.9), sharey="col",
        squeeze=False, layout="constrained",
    )  # fmt: skip
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.Normalize(vmin=1, vmax=max(steps, 2))
    for i, parametrization in enumerate(labels):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            chosen = [
                r for r in rows if (r["sweep"], r["parametrization"], r["statistic"]) == (sweep, parametrization, kind)
            ]
            last = []
            for step in sorted({r["step"] for r in chosen}):
                by_size: dict[int, list[float]] = {}
                for r in chosen:
                    if r["step"] == step:
                        by_size.setdefault(r["size"], []).append(r["value"])
                xs = sorted(by_size)
                means = [statistics.fmean(by_size[x]) for x in xs]
                errors = [statistics.stdev(by_size[x]) if len(by_size[x]) > 1 else 0.0 for x in xs]
                ax.errorbar(xs, means, yerr=errors, marker="o", markersize=3, color=cmap(norm(step)), capsize=2)
                last = (xs, means) if step == steps else last
            if last and len(last[0]) > 1:
                ax.text(0.03, 0.95, f"slope {slope(*last):+.2f}", transform=ax.transAxes, fontsize=8, va="top")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes_ = sorted({r["size"] for r in chosen})
            ax.set_xticks(sizes_, [str(s) for s in sizes_], fontsize=7)
            ax.minorticks_off()
            ax.set_title(f"{LABEL[parametrization]}: {kind.split('/', 1)[1]}", fontsize=9)
            if i == len(labels) - 1:
                ax.set_xlabel("width (hidden size)" if sweep == "width" else "depth (layers)", fontsize=8)
        axes[i][0].set_ylabel(f"{family}: mean |x|", fontsize=8)
    if len({r["step"] for r in rows if r["statistic"] in kinds}) > 1:  # change/update: the last step only
        fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="step", shrink=0.8)
    what = {"size": "activation size", "change": "change since init", "update": "update effect (W_T - W_0) x"}
    fig.suptitle(
        f"Coordinate check across {sweep}: {what[family]} (flat = scale kept; slope of log-log at step {steps})\n"
        f"{caption}; error bars ±1 s.d. over seeds",
        fontsize=9,
    )
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return True


def _order(kind: str) -> int:
    name = kind.split("/", 1)[1]
    order = (*ACTIVATIONS, *MATRICES)
    return order.index(name) if name in order else len(order)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


COLUMNS = ("sweep", "parametrization", "size", "seed", "step", "statistic", "value")


def read_rows(path: Path, hint: str) -> list[dict]:
    """coord_check.csv's rows with their numbers back; a row no check writes is a DataError naming its line."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows, header = list(reader), reader.fieldnames or []
    except (UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"'{path}' is not a coord-check CSV ({error}); {hint}") from None
    if (missing := [c for c in COLUMNS if c not in header]) or not rows:
        what = f"no column {', '.join(missing)}" if missing else "no rows"
        raise DataError(f"'{path}' has {what}: expected the columns {', '.join(COLUMNS)} and a row per value; {hint}")
    for line, r in enumerate(rows, start=2):
        try:
            r.update(size=int(r["size"]), seed=int(r["seed"]), step=int(r["step"]), value=float(r["value"]))
            if r["size"] < 1 or r["seed"] < 0 or r["step"] < 1 or not 0 <= r["value"] < math.inf:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            expected = ", ".join(COLUMNS)
            raise DataError(
                f"'{path}' line {line}: expected the columns {expected} (sizes and steps >= 1, values finite and "
                f">= 0); {hint}"
            ) from None
    return rows


def markdown(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
