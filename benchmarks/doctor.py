"""Does `nanotron doctor` accuse healthy nodes on a shared machine, and does it still name real faults?

    python -m benchmarks.doctor [--runs 20] [--hogs 2] [--fault-runs 3] [--against OTHER_CHECKOUT] [--out DIR]

Healthy: `--runs` standalone doctor runs of an 8-rank dp2 x tp2 x pp2 layout of the tiny model while `--hogs`
busy-loop processes share the machine's cores the whole time; a false naming is any run that exits non-zero or
names a rank. Faults: `--fault-runs` runs of each injected fault the doctor must name (a 4x slow rank, a wrong
matmul, a slow checkpoint disk) under the same load. With `--against`, every run is repeated with another checkout's
nanotron (e.g. the commit before a change) in interleaved rounds, so both see the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import REPO, RESULTS_DIR, bench_env, ensure_data, write_table

LAYOUT = ["--parallelism.dp=2", "--parallelism.tp=2", "--parallelism.pp=2"]
TINY = ["--model.hidden_size=32", "--model.intermediate_size=64", "--model.num_layers=4", "--model.num_heads=4"]
TINY += ["--model.num_kv_heads=2", "--model.vocab_size=1024", "--training.seq_len=16", "--model.max_seq_len=32"]
FAULTS = {  # name: (NANOTRON_FAULT, the exit code, the line the doctor must print)
    "slow rank (4x)": ("rank:2,step:0,kind:slow:4", (75, 2), "doctor: rank 2 "),
    "wrong matmul": ("rank:3,step:0,kind:bad_matmul", (75, 2), "doctor: rank 3 "),
    "slow disk": ("rank:0,step:0,kind:slow_disk:3", (2,), "checkpoint.dir writes at"),
}


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU: another job sharing the machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def doctor(checkout: Path, work: Path, name: str, fault: str = "") -> tuple[int, str, float]:
    """One standalone 8-rank doctor run with `checkout`'s nanotron: (exit code, its output, seconds)."""
    args = ["--config", "configs/tiny.toml", *TINY, *LAYOUT, *ensure_data(work), f"--job.out_dir={work}"]
    env = bench_env() | {"PYTHONPATH": str(checkout)}
    env.pop("NANOTRON_FAULT", None)
    if fault:
        env["NANOTRON_FAULT"] = fault
    command = [sys.executable, "-m", "nanotron", "doctor", "--nproc_per_node", "8", *args, f"--job.name={name}"]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - started


def named(output: str) -> list[str]:
    return [line for line in output.splitlines() if "doctor: rank " in line and "(node " in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--fault-runs", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout, run in interleaved rounds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "nanotron-doctor-bench"
    rows = []
    with hogs(args.hogs):
        for label in checkouts:
            for case in ("healthy", *FAULTS):
                rows.append({"checkout": label, "case": case, "runs": 0, "named or failed": 0, "seconds": 0.0})
        by_key = {(r["checkout"], r["case"]): r for r in rows}
        cases = [("healthy", "")] * args.runs + [(f, FAULTS[f][0]) for f in FAULTS for _ in range(args.fault_runs)]
        for index, (case, fault) in enumerate(cases):
            for label, checkout in checkouts.items():  # interleaved: both checkouts under the same load
                code, output, seconds = doctor(checkout, work, f"{label}-{index}", fault)
                row = by_key[(label, case)]
                row["runs"] += 1
                row["seconds"] += seconds
                if case == "healthy":
                    hit = code != 0 or bool(named(output))
                    if hit:
                        print(f"{label} healthy run {index}: exit {code}; {named(output)[:2]}", flush=True)
                else:
                    codes, line = FAULTS[case][1], FAULTS[case][2]
                    hit = code in codes and line in output
                row["named or failed"] += hit
                print(f"{label:8s} {case:16s} exit {code} {'hit' if hit else 'miss'} ({seconds:.0f} s)", flush=True)
    for row in rows:
        row["seconds"] = round(row["seconds"] / max(row["runs"], 1), 1)
    columns = ["checkout", "case", "runs", "named or failed", "seconds"]
    print(write_table(rows, columns, args.out / "doctor"))


if __name__ == "__main__":
    main()
