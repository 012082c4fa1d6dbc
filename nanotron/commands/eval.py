"""Downstream scores of a saved checkpoint, at any layout:

    nanotron eval CHECKPOINT --tasks ITEMS.jsonl [NAME=ITEMS.jsonl ...] [--out scores.json]
                  [--items items.jsonl] [--max_items N] [--nproc_per_node N] [--section.key=value ...]

CHECKPOINT is a step-N dir, a checkpoint dir or a run dir (their latest). The model, tokenizer and
sequence length come from the checkpoint's config.toml; the layout starts as one process (dp = tp = pp = cp
= 1) and is set with the usual keys, e.g. `--nproc_per_node 4 --parallelism.tp=2 --parallelism.pp=2`, in
any combination the training run could have used, not necessarily its own. Scoring is the in-training
evaluation's (`[evaluation]`, docs/evaluation.md): the same numbers at every layout. Writes the
per-task scores as JSON to --out (default eval-step-N.json), and each item's log-likelihoods to --items.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nanotron.checkpoint.layout import find_checkpoint
from nanotron.commands.args import Parser
from nanotron.config import Config, load_config, parse_overrides
from nanotron.errors import ConfigError, run_as_main, run_command
from nanotron.evaluation.tasks import Task, load_tasks
from nanotron.io import check_not_input, check_writable_file, write_atomic
from nanotron.launch.torchrun import launched_world_size, pop_nproc, spawn_local
from nanotron.parallel.layout import layout_sizes

# The layout a checkpoint's config is read with, before the command line's overrides: one process.
ONE_PROCESS = {
    "parallelism.dp": "1",
    "parallelism.dp_shard": "0",
    "parallelism.tp": "1",
    "parallelism.pp": "1",
    "parallelism.cp": "1",
    "parallelism.ep": "1",
    "parallelism.zero_stage": "0",
    "training.grad_accum_steps": "0",
}


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="nanotron eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="step-N dir, checkpoint dir or run dir")
    parser.add_argument("--tasks", nargs="+", required=True, help="JSONL item files, as PATH or NAME=PATH")
    parser.add_argument("--out", type=Path, help="scores JSON (default: eval-step-N.json here)")
    parser.add_argument("--items", type=Path, help="also write each item's log-likelihoods (JSONL) here")
    parser.add_argument("--max_items", type=int, default=0, help="score only each task's first N items")
    parser.add_argument("--allow_unverified", action="store_true", help="load a checkpoint without checksums")
    return parser


def _main(argv: list[str]) -> int:
    nproc = pop_nproc(argv)
    args, rest = _parser().parse_known_args(argv)
    step_dir = find_checkpoint(args.checkpoint)
    out = args.out or Path(f"eval-{step_dir.name}.json")
    for flag, file in (("--out", out), ("--items", args.items)):
        if file is not None:  # before the work: a file that can't be written would fail only after scoring
            check_not_input(flag, file, [step_dir])  # before the next line makes its folder
            check_writable_file(flag, file)
    if args.items is not None and os.path.abspath(args.items) == os.path.abspath(out):
        raise ConfigError(f"--items: '{args.items}' is also --out; give each its own file")
    if args.max_items < 0:
        raise ConfigError(f"--max_items: expected a non-negative integer, got {args.max_items}")
    path, overrides = parse_overrides(rest)
    if path is not None:
        raise ConfigError("--config: nanotron eval reads the checkpoint's own config.toml; set keys with --a.b=...")
    given = {key for key, _ in overrides}
    pairs = [(k, v) for k, v in ONE_PROCESS.items() if k not in given] + overrides
    pairs += [("evaluation.tasks", ",".join(args.tasks)), ("evaluation.max_items", str(args.max_items))]
    if (step_dir / "tokenizer").is_dir() and "data.tokenizer" not in given:
        pairs.append(("data.tokenizer", str(step_dir / "tokenizer")))
    cfg = load_config(step_dir / "config.toml", pairs, world_size=nproc or launched_world_size(), saved=True)
    tasks = load_tasks(cfg)  # bad task files: one line, before any process starts
    for flag, file in (("--out", out), ("--items", args.items)):
        if file is not None:  # e.g. --items naming a task file: scoring would end by replacing it
            check_not_input(flag, file, [task.path for task in tasks])
    if nproc:
        return spawn_local(nproc, ["-m", "nanotron", "eval", *argv])
    return _score(cfg, tasks, step_dir, out, args)


def _score(cfg: Config, tasks: list[Task], step_dir: Path, out: Path, args: argparse.Namespace) -> int:
    """One rank's share of the scoring. The model's imports are here: the launcher of local ranks (above) loads no
    torch until it starts them."""
    from nanotron.checkpoint.manager import load_states
    from nanotron.checkpoint.state import ModelState
    from nanotron.evaluation.scoring import DownstreamEval, scores_line, write_items
    from nanotron.gpu import set_matmul_precision
    from nanotron.parallel.mesh import destroy_distributed, init_distributed
    from nanotron.parallel.parallelize import build_model
    from nanotron.parallel.runner import MicrobatchRunner
    from nanotron.tokenize.tokenizer import load_tokenizer

    ctx = init_distributed(cfg)
    set_matmul_precision(cfg, ctx.device)
    stages = build_model(cfg, ctx, initialize=False)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    runner = MicrobatchRunner(stages, cfg, ctx, eos_id=tokenizer.eos_id)
    load_states(step_dir, {"model": ModelState([module for _, module in stages])}, args.allow_unverified)
    result = DownstreamEval(tasks, cfg, runner, tokenizer).run()
    if result is not None and runner.is_logging_rank:
        scores, items = result
        print(scores_line(None, tasks, scores), flush=True)
        report = {
            "checkpoint": str(step_dir.absolute()),
            "layout": layout_sizes(cfg),
            "tasks": {
                t.name: {"acc": scores[f"eval/{t.name}/acc"], "acc_norm": scores[f"eval/{t.name}/acc_norm"]}
                | {"items": len(t.items), "path": str(t.path)}
                for t in tasks
            },
        }
        write_atomic(out, json.dumps(report, indent=2) + "\n", durable=False)
        print(f"eval: scores written to {out}" + (f", items to {args.items}" if args.items else ""), flush=True)
        if args.items:
            write_items(args.items, items)
    destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        _parser().print_help()
        return 0
    return run_command(_main, argv)


if __name__ == "__main__":
    run_as_main(main)
