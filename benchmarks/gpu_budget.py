"""gpu_check's time budget: what each row is estimated to cost, which rows fit what is left, the command that runs
the ones that did not, and the summary rewritten after every row (a command killed at its limit keeps what ran).

The cost model, per row: a training row is a process start-up, plus a compile when it compiles, plus `steps` steps
at the eager row's step time times the row's own factor, plus its fixed extra (a checkpoint's save); a kernel or
doctor row is its fixed time. The start-up and step time are refined from the training rows already measured
(the eager row first), the compile time from the first compile row. The defaults are guesses for the 1.1B model
on one H100 until a GPU run measures them (benchmarks/RESULTS.md lists each row's estimate).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common import markdown_table, write_csv

PART_LIMIT_SEC = 540.0  # each --part is planned to fit 9 minutes on one H100, a 10-minute command's margin


@dataclass(frozen=True)
class Cost:
    """What one row costs beside the model's shared timings."""

    training: bool = True  # a `nanotron.train` run of `steps` steps; otherwise only `fixed_sec`
    step_factor: float = 1.0  # its step time against the eager bf16 row's
    compile: bool = False
    fixed_sec: float = 0.0  # a kernel row's whole time; a training row's extra (a save, torchrun's start)


@dataclass(frozen=True)
class Timing:
    """The shared timings, first guessed, then measured."""

    startup_sec: float  # process start to the first step's end, less one steady step
    step_sec: float  # the eager bf16 row's steady step
    compile_sec: float  # what compiling adds to a run


# Guesses until a GPU runs gpu_check. The step: `nanotron plan` puts the 1.1B model's step (16 x 2048 tokens, bf16)
# at 0.59 s on an H100 at its calibrated 41% of peak (large compiled runs); an eager 1B run is taken at ~32%.
H100_1B = Timing(startup_sec=25.0, step_sec=0.75, compile_sec=50.0)
H100_1B_BATCH = 16  # the sequences per step H100_1B's step is for
CPU_NANO = Timing(startup_sec=8.0, step_sec=0.3, compile_sec=0.0)  # --quick (nano model, 2 shared cores)


def estimate(cost: Cost, timing: Timing, steps: int) -> float:
    """Seconds the row is expected to take."""
    if not cost.training:
        return cost.fixed_sec
    compile_sec = timing.compile_sec if cost.compile else 0.0
    return timing.startup_sec + compile_sec + steps * timing.step_sec * cost.step_factor + cost.fixed_sec


def refine(timing: Timing, cost: Cost, seconds: float, step_sec: float, steps: int) -> Timing:
    """The timings after a one-process training row took `seconds` with a steady step of `step_sec`: an eager row
    sets the start-up and step time, a compile row the compile time (what is left of its wall time)."""
    running = steps * step_sec + cost.fixed_sec
    if cost.compile:
        return replace(timing, compile_sec=max(seconds - timing.startup_sec - running, 0.0))
    return replace(timing, startup_sec=max(seconds - running, 0.0), step_sec=step_sec / cost.step_factor)


def skip_reason(estimate_sec: float, left_sec: float | None, missing: Sequence[str] = ()) -> str | None:
    """Why a row is not started (None: it is): its reference did not run, or its estimate exceeds what is left."""
    if missing:
        return f"skipped (needs {', '.join(missing)}, which did not run)"
    if left_sec is not None and estimate_sec > left_sec:
        return f"skipped (budget: needs ~{estimate_sec:.0f}s, {max(left_sec, 0):.0f}s left)"
    return None


def plan(rows: Sequence[tuple[str, float, Sequence[str]]], budget_sec: float | None) -> list[tuple[str, str | None]]:
    """(name, estimate, the rows it needs) in priority order -> (name, skip reason or None), as the run would go
    if every estimate held: each row in turn if it fits what the rows before it left."""
    left, ran, out = budget_sec, set(), []
    for name, cost_sec, needs in rows:
        reason = skip_reason(cost_sec, left, [need for need in needs if need not in ran])
        if reason is None:
            ran.add(name)
            left = None if left is None else left - cost_sec
        out.append((name, reason))
    return out


def with_references(names: Iterable[str], needs: dict[str, Sequence[str]], order: Sequence[str]) -> list[str]:
    """`names` and, transitively, the rows they are checked against, in priority `order`."""
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(needs.get(name, ()))
    return [name for name in order if name in wanted]


def rerun_command(skipped: Sequence[str], base: str = "bash benchmarks/gpu_check.sh") -> str:
    """The command that runs the skipped rows (their references come with them)."""
    return f'{base} --only-rows "{",".join(skipped)}"'


def write_summary(stem: Path, header: str, rows: list[dict], columns: Sequence[str], extra: dict) -> None:
    """`<stem>.csv`, `.md` (its first line `header`) and `.json`, each replaced whole (a kill leaves the last)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    notes = [line for line in extra.get("notes", []) if line]
    markdown = "\n\n".join([header, markdown_table(rows, columns), *notes]) + "\n"
    document = {"status": header, **extra, "rows": rows}
    for suffix, write in (
        (".csv", lambda path: write_csv(rows, path, columns)),
        (".md", lambda path: path.write_text(markdown)),
        (".json", lambda path: path.write_text(json.dumps(document, indent=1, default=str) + "\n")),
    ):
        path = stem.with_suffix(suffix)
        temporary = path.with_name(f".{path.name}.tmp")
        write(temporary)
        os.replace(temporary, path)
