"""Summarizes torch.profiler Chrome traces (what `profiler.export_path` writes) as text, per rank.

    python -m benchmarks.trace_summary runs/<name>/profile/*.pt.trace.json [--top 12]

For each trace: the profiled step time; how much of it the main thread spent in compute ops, in
communication ops (gloo/nccl send, recv, collectives, waits) and elsewhere (Python, waiting on async
p2p work, idle); how many collectives ran per step; and the ops with the most self time. This is the
evidence RESULTS.md cites: a rank that idles or waits on its peer shows it without a trace viewer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

COMM_WORDS = (
    "c10d",
    "gloo",
    "nccl",
    "send",
    "recv",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "wait",
)


def is_comm(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in COMM_WORDS)


def summarize(path: Path, top: int) -> str:
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep")]
    if not steps:
        return f"{path.name}: no ProfilerStep events (was the trace written by torch.profiler with a schedule?)"
    main_tid, n = steps[0]["tid"], len(steps)
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e["tid"] == main_tid and start <= e["ts"] < end),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    self_time: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    outermost, stack, outer_end = [], [], -1.0
    for op in ops:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= op["ts"]:
            stack.pop()
        if stack:
            self_time[stack[-1]["name"]] -= op["dur"]
        self_time[op["name"]] += op["dur"]
        counts[op["name"]] += 1
        stack.append(op)
        if op["ts"] >= outer_end:
            outermost.append(op)
            outer_end = op["ts"] + op["dur"]
    # Collectives run nested in DTensor/FSDP dispatch: count communication by self time at any depth.
    comm = sum(micros for name, micros in self_time.items() if is_comm(name))
    compute = sum(op["dur"] for op in outermost) - comm
    collectives = sum(c for name, c in counts.items() if name.startswith("c10d::"))
    step_ms = (end - start) / n / 1e3
    lines = [
        f"{path.name}: {n} steps, {step_ms:.1f} ms/step = compute ops {compute / n / 1e3:.1f} + communication "
        f"ops {comm / n / 1e3:.1f} + other (Python, waits, idle) {(end - start - compute - comm) / n / 1e3:.1f} ms; "
        f"{collectives / n:.1f} c10d calls/step",
    ]
    for name, micros in sorted(self_time.items(), key=lambda kv: -kv[1])[:top]:
        share = 100 * micros / (end - start)
        lines.append(f"  {micros / n / 1e3:9.1f} ms/step {share:5.1f}%  x{counts[name] / n:6.1f}  {name[:80]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("traces", nargs="+", type=Path, help="*.pt.trace.json files")
    parser.add_argument("--top", type=int, default=12, help="ops listed by self time")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(summarize(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
