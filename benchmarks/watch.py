"""What watching costs and whether it cries wolf (issue 20's targets).

    python -m benchmarks.watch [--steps 300] [--nproc 4] [--out DIR]

1. Cost per step, in this process: the watch work a training step adds (six phase beats into the shared-memory
   slot, the straggler bookkeeping: the step's own time) against a tiny-model training step (forward,
   backward, AdamW) measured in the same run; interleaved rounds, medians.
2. False alarms: a clean `--nproc` rank run through the launcher (so the watcher process runs) of `--steps`
   steps with a checkpoint and an evaluation every 50 steps and tight limits (floor 1 s, factor 4), every save
   made `--save-seconds` slower on rank 0 (`slow_disk`), so saves take well over 10 steps: the run must end with
   exit 0, no incident dir and no straggler named. The table gives the step time and the slowest save (from the
   run's console).
3. Detection: each injected hang at `--nproc` ranks (floor 8 s): the culprit's stall when it was named, the
   learnt limit of its phase, the first line, the exit code.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_env,
    bench_parser,
    ensure_data,
    model_overrides,
    write_table,
)


def watch_cost_ratio(rounds: int = 7) -> dict:
    from nanotron.config import load_config, parse_overrides
    from nanotron.models.llama import LlamaForCausalLM
    from nanotron.parallel.init import init_weights
    from nanotron.watch.heartbeat import Heartbeat
    from nanotron.watch.straggler import StragglerScores

    cfg = load_config(*parse_overrides(["--config", "configs/tiny.toml"]))
    torch.set_num_threads(1)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_len + 1))

    def train_step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    with tempfile.TemporaryDirectory() as folder:
        heartbeat = Heartbeat(Path(folder), 0, {"run_dir": folder, "watch": {}})
        stragglers = StragglerScores(cfg.watch, 0, 1, torch.device("cpu"))
        step = [0]

        def watch_work() -> None:
            step[0] += 1
            with stragglers.step():
                heartbeat.beat("data", step[0])
                heartbeat.beat("forward")
                heartbeat.beat("backward")
                heartbeat.beat("optimizer")
            stragglers.count_step()

        steps, calls = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(5):
                train_step()
            steps.append((time.perf_counter() - started) / 5)
            started = time.perf_counter()
            for _ in range(10000):
                watch_work()
            calls.append((time.perf_counter() - started) / 10000)
        heartbeat.close()
    step_s, watch_s = statistics.median(steps), statistics.median(calls)
    return {
        "check": "watch work per step",
        "step_ms": step_s * 1e3,
        "watch_us": watch_s * 1e6,
        "ratio": watch_s / step_s,
    }


def false_alarm_run(work_dir: Path, steps: int, nproc: int, save_seconds: float) -> dict:
    name = f"watch-clean-{nproc}"
    args = [
        *QUIET_RUN,
        *ensure_data(work_dir),
        *model_overrides("tiny"),
        f"--job.out_dir={work_dir / 'runs'}",
        f"--job.name={name}",
        f"--parallelism.dp={nproc}",
        f"--training.steps={steps}",
        "--training.eval_interval=50",
        "--checkpoint.interval=50",
        "--checkpoint.keep_last=2",
        "--logging.log_interval=10",
        "--watch.floor_seconds=1",
        "--watch.factor=4",
        "--watch.straggler_interval=50",
        "--checkpoint.resume_from=none",
    ]
    command = [sys.executable, "-m", "nanotron.train", "--nproc_per_node", str(nproc), *args]
    shutil.rmtree(work_dir / "runs" / name, ignore_errors=True)  # a fresh start, not over the last run's checkpoints
    started = time.perf_counter()
    env = bench_env() | {"NANOTRON_FAULT": f"rank:0,step:1,kind:slow_disk:{save_seconds}"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    run_dir = work_dir / "runs" / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_sec"] for r in records if "step_time_sec" in r]
    # The slow disk sleeps as the save begins: the checkpoint phase lasts the logged write plus that.
    saves = [float(s) + save_seconds for s in re.findall(r"checkpoint: saved \S+ in ([0-9.]+)s", proc.stdout)]
    incidents = list((run_dir / "incidents").glob("*")) if (run_dir / "incidents").exists() else []
    scores = [r["straggler/max"] for r in records if "straggler/max" in r]
    return {
        "check": f"clean run, {nproc} ranks, {steps} steps",
        "exit_code": proc.returncode,
        "incidents": len(incidents),
        "stragglers_named": proc.stdout.count("warning: straggler:"),
        "straggler_max": max(scores, default=float("nan")),
        "step_s": statistics.median(step_times) if step_times else float("nan"),
        "slowest_save_s": max(saves) if saves else float("nan"),
        "save_vs_step": (max(saves) / statistics.median(step_times)) if saves and step_times else float("nan"),
        "wall_s": wall,
        "stderr_tail": proc.stderr.strip().splitlines()[-1:] if proc.returncode else [],
    }


KINDS = ("sleep", "gil_lock", "sigstop", "skip_collective")


def detection_runs(work_dir: Path, nproc: int) -> list[dict]:
    rows = []
    for kind in KINDS:
        name = f"watch-{kind}"
        args = [*QUIET_RUN, *ensure_data(work_dir), *model_overrides("tiny"), f"--job.out_dir={work_dir / 'runs'}"]
        args += [f"--job.name={name}", f"--parallelism.dp={nproc}", "--training.steps=50", "--watch.floor_seconds=8"]
        command = [sys.executable, "-m", "nanotron.train", "--nproc_per_node", str(nproc), *args]
        env = bench_env() | {"NANOTRON_FAULT": f"rank:2,step:3,kind:{kind}"}
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        (incident,) = sorted((work_dir / "runs" / name / "incidents").iterdir())[-1:]
        record = json.loads((incident / "incident.json").read_text())
        culprit = next(r for r in record["ranks"] if r["rank"] == record["culprits"][0])
        limit = record["limits"].get(culprit["phase"], float("nan"))
        rows.append(
            {
                "kind": kind,
                "exit_code": proc.returncode,
                "named_after_s": culprit["stalled_seconds"],
                "limit_s": limit,
                "within_2x_limit_and_60s": culprit["stalled_seconds"] <= min(2 * limit, 60),
                "first_line": record["line"],
            }
        )
        shutil.rmtree(work_dir / "runs" / name)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("watch", __doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--save-seconds", type=float, default=20.0, help="slow_disk on rank 0 in the clean run")
    parser.add_argument("--parts", default="cost,clean,detect", help="which of cost, clean, detect to run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "nanotron-bench-watch")
    args = parser.parse_args(argv)
    parts, rows, ok = args.parts.split(","), [], True
    if "cost" in parts:
        cost = watch_cost_ratio()
        print(json.dumps(cost), flush=True)
        measured = f"{cost['watch_us']:.1f} us vs a {cost['step_ms']:.1f} ms tiny step"
        rows.append(
            {"what": cost["check"], "measured": measured, "result": f"{cost['ratio']:.5f}", "target": "<= 0.01"}
        )
    if "clean" in parts:
        clean = false_alarm_run(args.work_dir, args.steps, args.nproc, args.save_seconds)
        print(json.dumps(clean), flush=True)
        measured = (
            f"exit {clean['exit_code']}, step {clean['step_s']:.3f} s, slowest save {clean['slowest_save_s']:.1f} s "
            f"({clean['save_vs_step']:.0f}x a step), evaluation every 50 steps, {clean['wall_s']:.0f} s wall"
        )
        rows.append({"what": clean["check"], "measured": measured, "result": f"{clean['incidents']} incidents"})
        rows[-1]["target"] = "0"
        measured = f"highest score {clean['straggler_max']:.2f} (threshold 0.4), every 50 steps"
        named = f"{clean['stragglers_named']} named"
        rows.append({"what": "stragglers in the clean run", "measured": measured, "result": named, "target": "0"})
        ok &= clean["exit_code"] == 0 and not clean["incidents"] and not clean["stragglers_named"]
    if rows:
        print(write_table(rows, ["what", "measured", "result", "target"], args.out / "watch"))
    if "detect" in parts:
        detections = detection_runs(args.work_dir, args.nproc)
        print(write_table(detections, list(detections[0]), args.out / "watch_detection"))
        ok &= all(row["within_2x_limit_and_60s"] and row["exit_code"] == 75 for row in detections)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
