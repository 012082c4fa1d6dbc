"""Slurm launcher: nanotron's `slurm_launcher.py` flags → a run dir → `sbatch launch/slurm.sh`.

    python -m nanotron.launch --run_name my_first_experiment --nodes 4 --model_size base
    python -m nanotron.launch --run_name cpu_test --nodes 2 --gpus_per_node 0 --nproc_per_node 2 --dp 4 --tp 1 --dry_run

A run starts from `configs/<model_size>.toml` (or `--config FILE`) and the flags override it. The whole config is
resolved and checked here, on the login node, with what would fail in the queue (paths, Python, data and split
sizes, filesystems the nodes share: `preflight.py`), so a mistake costs a second instead of a wait for nodes. It
writes `<out_dir>/<run_name>/config.toml` (the resolved config, absolute paths) and `submit.sh` (the exact `sbatch`
command), then submits the one job script with `sbatch` options. Any `--section.key=value` argument is passed on
as a config override, as for `nanotron.train`.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TextIO

import nanotron.launch.preflight as preflight
from nanotron.config import Config, load_config, parse_overrides, to_toml
from nanotron.config.validate import RUN_NAME, RUN_NAME_RULE
from nanotron.errors import ConfigError, LaunchError, run_command
from nanotron.launch.flags import (
    CONFIG_FLAGS,
    config_overrides,
    fit_max_seq_len,
    flag_help,
    model_summary,
    normalize_spellings,
    starting_config,
)

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "slurm.sh"

SAFE_PARTITION = re.compile(r"[A-Za-z0-9_.,-]*")
SAFE_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+")
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD"}
ACTIVE_STATES |= {"RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError, so a bad flag is one `error:` line (exit 2), not usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type whose error names the bound: "argument --nodes: expected an integer >= 1, got '0'"."""

    def parse(text: str) -> int:
        value = int(text) if text.lstrip("-").isdigit() else minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m nanotron.launch",
        allow_abbrev=False,
        description="Resolve and validate a run's config, write runs/<run_name>/, and submit launch/slurm.sh "
        "with sbatch. Extra --section.key=value arguments are config overrides, as for nanotron.train.",
    )
    p.add_argument("--run_name", required=True, help="run dir name and Slurm job name (letters, digits, . _ -)")
    p.add_argument(
        "--config",
        help="TOML config to start from (default: configs/<model_size>.toml; without --model_size, the preset "
        "nearest --hidden_size, else tiny)",
    )
    slurm = p.add_argument_group("Slurm")
    slurm.add_argument("--nodes", type=_int_at_least(1), default=2, help="most nodes to request (default 2)")
    slurm.add_argument(
        "--gpus_per_node", type=_int_at_least(0), default=8, help="one process per GPU (default 8); 0 = CPU nodes"
    )
    slurm.add_argument(
        "--nproc_per_node", type=_int_at_least(1), help="processes per node with --gpus_per_node 0 (default 1)"
    )
    slurm.add_argument("--partition", default="hopper-prod", help="default hopper-prod; '' = cluster default")
    slurm.add_argument("--time_limit", default="1:00:00", help="Slurm time format (default 1:00:00)")
    slurm.add_argument("--email", help="mail the job's end or failure to this address")
    config = p.add_argument_group("config (each flag sets the keys in brackets)")
    for flag in CONFIG_FLAGS:
        bool_flag = flag == "save_initial_state"
        config.add_argument(f"--{flag}", action="store_true" if bool_flag else None, default=None, help=flag_help(flag))
    run = p.add_argument_group("execution")
    run.add_argument("--show_logs", action="store_true", help="follow the job's log until the job ends")
    run.add_argument(
        "--dry_run",
        action="store_true",
        help="check, write the run dir and print everything (the plan too); submit nothing",
    )
    run.add_argument(
        "--gpu",
        default="h100",
        help="GPU type the plan checks memory against: h100, h200, a100, or '<memory GiB>,<peak TFLOP/s>' "
        "(default h100)",
    )
    run.add_argument("--force", action="store_true", help="submit even if the plan says the layout does not fit")
    return p


def check_slurm_flags(args: argparse.Namespace) -> None:
    """Flags that reach sbatch or paths are restricted to safe characters, so nothing can inject commands."""
    if not RUN_NAME.fullmatch(args.run_name):
        raise ConfigError(f"--run_name {args.run_name!r}: use {RUN_NAME_RULE} (it names a folder and the Slurm job)")
    if not SAFE_PARTITION.fullmatch(args.partition):
        raise ConfigError(f"--partition {args.partition!r}: expected a Slurm partition name (letters, digits, _.,-)")
    if args.email is not None and not SAFE_EMAIL.fullmatch(args.email):
        raise ConfigError(f"--email {args.email!r}: expected an address like name@example.org")
    if args.nproc_per_node is not None and args.gpus_per_node > 0:
        raise ConfigError(
            "--nproc_per_node is for CPU nodes: add --gpus_per_node 0 (on GPU nodes one process "
            "runs per GPU; lower --gpus_per_node to use fewer)"
        )


def time_limit_seconds(text: str) -> int:
    """Parses Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) to place the checkpoint signal."""
    days, dash, rest = text.rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or (dash and not days.isdigit()) or len(parts) > 3:
        raise ConfigError(f"--time_limit {text!r}: expected a Slurm time such as 90, 1:00:00 or 2-00:00:00")
    nums = [int(p) for p in parts]
    if dash:  # D-H, D-H:M, D-H:M:S
        h, m, s = (nums + [0, 0])[:3]
        seconds = int(days) * 86400 + h * 3600 + m * 60 + s
    else:  # M, M:S, H:M:S
        h, m, s = ([0] + nums + [0])[:3] if len(nums) < 3 else nums
        seconds = h * 3600 + m * 60 + s
    if seconds < 60:
        raise ConfigError(f"--time_limit {text!r}: expected at least one minute")
    return seconds


def plan_nodes(cfg: Config, args: argparse.Namespace) -> tuple[int, int, list[str]]:
    """(nodes, processes per node, notes) for dp*cp*tp*pp processes, requesting no more nodes than needed."""
    p, world = cfg.parallelism, cfg.world_size
    if args.gpus_per_node:
        per_node, unit, flag = args.gpus_per_node, "GPUs", "--gpus_per_node"
    else:
        per_node, unit, flag = args.nproc_per_node or 1, "processes", "--nproc_per_node"
    capacity = args.nodes * per_node
    if world > capacity:
        raise ConfigError(
            f"dp*cp*tp*pp = {p.dp}*{p.cp}*{p.tp}*{p.pp} = {world} processes but --nodes {args.nodes} x {flag} "
            f"{per_node} = {capacity} {unit} ({world} > {capacity} {unit}); lower --dp/--cp/--tp/--pp or "
            "raise --nodes"
        )
    nodes = math.ceil(world / per_node)
    if world % nodes:
        raise ConfigError(
            f"dp*cp*tp*pp = {world} processes can't be spread evenly over {nodes} nodes of {per_node} "
            f"{unit}; make dp*cp*tp*pp a multiple of {nodes}"
        )
    procs = world // nodes
    notes = []
    if (nodes, procs) != (args.nodes, per_node):
        notes.append(
            f"note: dp*cp*tp*pp = {world} needs {nodes} node(s) x {procs} {unit}, not {args.nodes} x "
            f"{per_node}: requesting only that"
        )
    if procs % p.tp:
        notes.append(
            f"warning: tp={p.tp} does not divide the {procs} processes per node: tensor-parallel groups "
            "span nodes (slow); pick tp among the divisors of the processes per node"
        )
    return nodes, procs, notes


def plan_before_submit(cfg: Config, args: argparse.Namespace, procs: int) -> list[str]:
    """The per-GPU memory line (and with --dry_run the whole plan); refuses a layout that does not fit the GPUs
    unless --force, so it fails here in a second instead of out of memory after its wait in the queue."""
    from nanotron.plan.cli import describe, fit_line, fits
    from nanotron.plan.timing import parse_gpu

    if not args.gpus_per_node:
        return ["note: CPU nodes (--gpus_per_node 0): GPU memory not planned"]
    gpu = parse_gpu(args.gpu)
    line = fit_line(cfg, gpu)
    if not fits(cfg, gpu) and not args.force:
        raise LaunchError(f"{line}; --force submits anyway")
    if args.dry_run:
        nodes = math.ceil(cfg.world_size / procs)
        return ["plan:", *describe(cfg, gpu, nodes, procs, efficiency=gpu.efficiency.default)]
    return [line]


def sbatch_command(args: argparse.Namespace, cfg: Config, nodes: int, procs: int, python: str) -> list[str]:
    """sbatch options for the one job script: no templated second script, so hand and launcher runs agree."""
    run_dir = cfg.run_dir
    limit = time_limit_seconds(args.time_limit)
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={args.run_name}",
        f"--nodes={nodes}",
        f"--time={args.time_limit}",
        f"--output={run_dir / 'slurm-%j.out'}",
        f"--signal=B:USR1@{min(600, limit // 10)}",
    ]
    if args.partition:
        cmd.append(f"--partition={args.partition}")
    if args.gpus_per_node:
        cmd.append(f"--gpus-per-node={procs}")
    if args.email:
        cmd += [f"--mail-user={args.email}", "--mail-type=END,FAIL"]
    cmd.append(f"--export=ALL,NPROC_PER_NODE={procs},NANOTRON_PYTHON={python}")
    return [*cmd, _display_path(JOB_SCRIPT), str(run_dir / "config.toml")]


def _display_path(path: Path) -> str:
    """Relative to the working directory when inside it, so the printed command is short and portable."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def write_run_dir(cfg: Config, cmd: list[str], argv: list[str]) -> Path:
    """Saves what reproduces the run in its run dir: the resolved config and the sbatch command."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    submit = cfg.run_dir / "submit.sh"
    submit.write_text(
        f"#!/usr/bin/env bash\n# {datetime.now().isoformat(timespec='seconds')}: "
        f"{shlex.join(['python', '-m', 'nanotron.launch', *argv])}\n"
        f"cd {shlex.quote(os.getcwd())}\n{shlex.join(cmd)}\n"
    )
    return submit


def submit(cmd: list[str]) -> str:
    """Runs sbatch and returns the job id."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or f"exit code {result.returncode}").splitlines()
        raise LaunchError(f"sbatch refused the job: {reason[-1]}")
    return result.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict; empty once the controller has forgotten the job."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)


def follow_log(job_id: str, log: Path, out: TextIO | None = None, poll_s: float = 2.0) -> str:
    """Prints the job's log as it grows until the job ends; returns the final state.

    The job's state, not the file, decides when to stop: a log that never appears can't hang us.
    """
    out, offset = out or sys.stdout, 0
    while True:
        info = job_info(job_id)
        state = info.get("JobState", "UNKNOWN")
        log = Path(info.get("StdOut", log))
        if log.is_file():
            with log.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            out.write(chunk.decode(errors="replace"))
            out.flush()
        if state not in ACTIVE_STATES:
            if not log.is_file():
                out.write(f"no log file at {log}\n")
            return state
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    return run_command(_launch, argv)


def _launch(argv: list[str]) -> int:
    parser = build_parser()
    preflight.check_printable(argv)
    args, extra = parser.parse_known_args(normalize_spellings(argv, parser))
    _, passthrough = parse_overrides(extra)
    for key, _ in passthrough:
        if "." not in key:
            flags = [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(key, flags, n=1)
            hint = f"did you mean --{close[0]}?" if close else "see --help"
            raise ConfigError(f"unrecognized argument --{key}: {hint} (config overrides look like --section.key=value)")
        if key == "job.name":
            raise ConfigError("--job.name: set the run name with --run_name")
    check_slurm_flags(args)
    cfg, notes = resolve_config(args, passthrough)
    nodes, procs, layout_notes = plan_nodes(cfg, args)
    plan = plan_before_submit(cfg, args, procs)
    python = preflight.job_python()
    cmd = sbatch_command(args, cfg, nodes, procs, python)
    if not JOB_SCRIPT.is_file():
        raise LaunchError(f"{JOB_SCRIPT} not found: run from a source checkout of nanotron (pip install -e .)")
    if not args.dry_run and shutil.which("sbatch") is None:
        raise LaunchError(
            "sbatch not found: run this on a Slurm login node, or add --dry_run to only write "
            f"{cfg.run_dir}/config.toml and print the sbatch command"
        )
    preflight.check_data(cfg)
    notes += layout_notes + preflight.shared_filesystem_notes(preflight.job_paths(cfg, sys.prefix, Path.cwd()))
    for note in notes:
        print(note, file=sys.stderr)
    if (cfg.checkpoint_dir / "latest").exists() and cfg.checkpoint.resume_from == "auto":
        print(f"note: {cfg.checkpoint_dir} has checkpoints: the job resumes from the latest", file=sys.stderr)
    submit_file = write_run_dir(cfg, cmd, argv)
    print(model_summary(cfg))
    print("\n".join(plan))
    print(f"resolved config: {cfg.run_dir / 'config.toml'}")
    print(f"sbatch command ({submit_file}):\n  {shlex.join(cmd)}")
    if args.dry_run:
        print(to_toml(cfg))
        print("dry run: nothing submitted")
        return 0
    job_id = submit(cmd)
    log = cfg.run_dir / f"slurm-{job_id}.out"
    print(f"submitted job {job_id}; log: {log}")
    if not args.show_logs:
        return 0
    state = follow_log(job_id, log)
    print(f"job {job_id}: {state}")
    return 0 if state == "COMPLETED" else 1


def resolve_config(args: argparse.Namespace, passthrough: list[tuple[str, str]]) -> tuple[Config, list[str]]:
    """The run's config: the starting file, the flags and overrides, absolute paths; and notes on what was chosen."""
    path, notes = starting_config(args)
    if not path.is_file() and args.config is None:
        raise LaunchError(f"{path} not found: run from a source checkout of nanotron, or pass --config FILE")
    overrides = fit_max_seq_len(path, args, config_overrides(args, passthrough))
    cfg = load_config(path, overrides)
    preflight.make_paths_absolute(cfg)
    preflight.check_config_strings(cfg)
    return cfg, notes


if __name__ == "__main__":
    sys.exit(main())
