"""Downstream evaluation measured on the demo: the task's accuracy over training, and what scoring costs.

    python -m benchmarks.evaluation [--steps 200] [--items 200] [--nproc 1] [--layout ...]

Trains `configs/tiny.toml` (the demo corpus and task, `make data`) for `--steps` steps, scoring the demo task's
first `--items` items every 100 steps. Reports acc and acc_norm at each evaluation (with the binomial standard
error of the last, against chance 0.25), the seconds of each evaluation, and their cost: one evaluation's median
seconds over the time of the 100 steps between two (median step time x 100, from the same run's step records).
"""

from __future__ import annotations

import json
import math
import statistics

from benchmarks.common import DEFAULT_WORK_DIR, REPO, RESULTS_DIR, bench_parser, run_nanotron, write_table

COLUMNS = ("step", "acc", "acc_norm", "seconds", "detail")


def main() -> None:
    parser = bench_parser("evaluation", __doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--layout", nargs="*", default=[], help="e.g. --parallelism.dp=2 --parallelism.pp=2")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    task = REPO / "data" / "eval" / "next_words.jsonl"
    if not task.is_file():
        raise SystemExit(f"no demo task at {task}: run `make data` first")
    overrides = [
        "--config",
        str(REPO / "configs" / "tiny.toml"),
        f"--training.steps={args.steps}",
        f"--job.seed={args.seed}",
        f"--evaluation.tasks={task}",
        "--evaluation.interval=100",
        f"--evaluation.max_items={args.items}",
        "--training.eval_interval=0",  # the validation loss apart: only the downstream tasks are measured
        "--checkpoint.save_final=false",
        "--checkpoint.interval=0",
        "--logging.log_interval=1",
        *args.layout,
    ]
    records = run_nanotron("evaluation", overrides, args.nproc, DEFAULT_WORK_DIR, args.steps)
    lines = (DEFAULT_WORK_DIR / "runs" / "evaluation" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "eval/next_words/acc" in r]
    steps = [r["step_time_sec"] for r in records]
    step_time = statistics.median(steps)
    rows = []
    for r in evals:
        rows.append(
            {
                "step": r["step"],
                "acc": round(r["eval/next_words/acc"], 3),
                "acc_norm": round(r["eval/next_words/acc_norm"], 3),
                "seconds": round(r["eval/seconds"], 2),
                "detail": "",
            }
        )
    last = evals[-1]["eval/next_words/acc"]
    stderr = math.sqrt(0.25 * 0.75 / args.items)
    cost = statistics.median(r["eval/seconds"] for r in evals) / (100 * step_time)
    rows.append(
        {
            "step": "cost",
            "acc": f"{(last - 0.25) / stderr:.1f} sigma",
            "acc_norm": "",
            "seconds": round(100 * step_time, 2),
            "detail": f"one evaluation = {100 * cost:.1f}% of 100 steps (median step {step_time:.3f} s, "
            f"{args.nproc} process(es) {' '.join(args.layout)}); last acc {last:.3f} vs chance 0.25, "
            f"binomial s.e. {stderr:.3f} at {args.items} items",
        }
    )
    print(write_table(rows, COLUMNS, RESULTS_DIR / f"evaluation-np{args.nproc}"))


if __name__ == "__main__":
    main()
