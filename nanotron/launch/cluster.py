"""The Slurm side of `nanotron launch`: nodes and processes for a layout, the plan's verdict before a wait in the
queue, the `sbatch` command for the one job script, the run dir that reproduces it, submitting and following."""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

import nanotron.launch.checks as checks
from nanotron.config import Config, load_config, to_toml
from nanotron.config.validate import RUN_NAME, RUN_NAME_RULE
from nanotron.errors import ConfigError, LaunchError
from nanotron.launch.flags import config_overrides, fit_max_seq_len, starting_config

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "slurm.sh"

SAFE_PARTITION = re.compile(r"[A-Za-z0-9_.,-]*")
# Values of sbatch options: Slurm names, node lists (node[1-4,7]), feature expressions (a100&ib|h100).
SLURM_VALUES = {
    "account": re.compile(r"[A-Za-z0-9_.-]*"),
    "qos": re.compile(r"[A-Za-z0-9_.,-]*"),
    "reservation": re.compile(r"[A-Za-z0-9_.,-]*"),
    "exclude": re.compile(r"[A-Za-z0-9_.,\[\]-]*"),
    "constraint": re.compile(r"[A-Za-z0-9_.,&|*()\[\]:-]*"),
}
# How the job script learns the node environment (launch/slurm.sh reads the same variables under plain sbatch).
JOB_VARIABLES = {
    "setup": "NANOTRON_SETUP",
    "container_image": "NANOTRON_CONTAINER_IMAGE",
    "container_mounts": "NANOTRON_CONTAINER_MOUNTS",
    "container_exec": "NANOTRON_CONTAINER_EXEC",
}
SAFE_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+")
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD"}
ACTIVE_STATES |= {"RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


def check_slurm_flags(args: argparse.Namespace) -> None:
    """Flags that reach sbatch or paths are restricted to safe characters, so nothing can inject commands."""
    if not RUN_NAME.fullmatch(args.run_name):
        raise ConfigError(f"--run_name {args.run_name!r}: use {RUN_NAME_RULE} (it names a folder and the Slurm job)")
    if not SAFE_PARTITION.fullmatch(args.partition):
        raise ConfigError(f"--partition {args.partition!r}: expected a Slurm partition name (letters, digits, _.,-)")
    for flag, allowed in SLURM_VALUES.items():
        if not allowed.fullmatch(getattr(args, flag)):
            raise ConfigError(f"--{flag} {getattr(args, flag)!r}: unexpected characters for an sbatch --{flag} value")
    extra = sbatch_extra(args)
    if any(not option.startswith("-") for option in extra[:1]):
        raise ConfigError(f'--sbatch_args {args.sbatch_args!r}: expected sbatch options, e.g. "--mem=0 --comment=x"')
    if args.container_image and args.container_exec:
        raise ConfigError("--container_image and --container_exec both set: pick pyxis (image) or a wrapper (exec)")
    if args.container_mounts and not args.container_image:
        raise ConfigError("--container_mounts needs --container_image (with --container_exec, pass the binds in it)")
    for flag in ("container_image", "container_mounts"):
        if any(c.isspace() for c in getattr(args, flag) or ""):
            raise ConfigError(f"--{flag} {getattr(args, flag)!r}: expected no spaces")
    if args.setup is not None:
        setup = Path(args.setup).expanduser()
        if not setup.is_file() or not os.access(setup, os.R_OK):
            raise ConfigError(f"--setup {args.setup!r}: not a readable file (the shell file each node sources)")
        args.setup = str(setup.absolute())
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
    from nanotron.plan.report import describe, fit_line, fits
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


def planned_step_seconds(cfg: Config, args: argparse.Namespace, procs: int) -> float | None:
    """The plan's step time on the requested GPUs (None on CPU nodes, or for float8 on GPUs without float8 matmuls,
    where torchao emulates them at a speed the plan does not know: nothing to plan against)."""
    from nanotron.plan.report import for_gpu
    from nanotron.plan.timing import estimate_step, parse_gpu

    if not args.gpus_per_node:
        return None
    gpu = parse_gpu(args.gpu)
    if cfg.training.float8 != "off" and gpu.device.fp8 is None:
        return None
    return estimate_step(for_gpu(cfg, gpu), gpu, procs, gpu.efficiency.default).step_s


def signal_margin(limit_seconds: int) -> int:
    """Seconds before the time limit at which Slurm asks the job to checkpoint (--signal=B:USR1@...)."""
    return min(600, limit_seconds // 10)


def run_length_notes(
    cfg: Config, train_samples: int, max_epochs: float, step_seconds: float | None, time_limit: str
) -> list[str]:
    """One warning each when the run repeats its corpus more than max_epochs times, or when its planned duration
    exceeds the time limit (how many requeues that takes): both are fine on purpose and costly by mistake."""
    t, notes = cfg.training, []
    epochs = t.steps * t.global_batch_size / max(train_samples, 1)
    if max_epochs and epochs > max_epochs:  # 0: no limit to warn of
        notes.append(
            f"warning: {t.steps} steps x {t.global_batch_size} samples = {epochs:,.1f} passes over the corpus's "
            f"{train_samples:,} training samples (more than --max_epochs {max_epochs:g}): lower training.steps, "
            "add data, or raise --max_epochs if the repetition is intended"
        )
    if step_seconds is not None:
        limit = time_limit_seconds(time_limit)
        duration = t.steps * step_seconds
        if duration > limit:
            requeues = math.ceil(duration / (limit - signal_margin(limit))) - 1
            notes.append(
                f"warning: {t.steps} steps of ~{step_seconds:.2f} s (the plan) take ~{duration / 3600:.1f} h, more "
                f"than --time_limit {time_limit}: the job will requeue ~{requeues} time(s), each resuming from its "
                "latest checkpoint; raise --time_limit to run it in one go"
            )
    return notes


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
        f"--signal=B:USR1@{signal_margin(limit)}",
    ]
    if args.partition:
        cmd.append(f"--partition={args.partition}")
    if args.gpus_per_node:
        cmd.append(f"--gpus-per-node={procs}")
    cmd += [f"--{flag}={getattr(args, flag)}" for flag in SLURM_VALUES if getattr(args, flag)]
    if args.email:
        cmd += [f"--mail-user={args.email}", "--mail-type=END,FAIL"]
    cmd.append(f"--export=ALL,NPROC_PER_NODE={procs},NANOTRON_PYTHON={python}")
    return [*cmd, *sbatch_extra(args), _display_path(JOB_SCRIPT), str(run_dir / "config.toml")]


def sbatch_extra(args: argparse.Namespace) -> list[str]:
    """--sbatch_args, split as a shell would; they come after the launcher's own options, so they override them."""
    try:
        return shlex.split(args.sbatch_args)
    except ValueError as error:
        raise ConfigError(f"--sbatch_args {args.sbatch_args!r}: {error}") from None


def job_environment(args: argparse.Namespace) -> dict[str, str]:
    """The job script's NANOTRON_* variables for set-up and containers, exported to sbatch (the job inherits them;
    a value may hold commas, which sbatch --export can't pass)."""
    return {name: getattr(args, flag) for flag, name in JOB_VARIABLES.items() if getattr(args, flag)}


def submit_lines(environment: dict[str, str], cmd: list[str]) -> list[str]:
    """The submission as shell lines: the exported variables, then sbatch."""
    return [f"export {name}={shlex.quote(value)}" for name, value in environment.items()] + [shlex.join(cmd)]


def _display_path(path: Path) -> str:
    """Relative to the working directory when inside it, so the printed command is short and portable."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def write_run_dir(cfg: Config, environment: dict[str, str], cmd: list[str], argv: list[str]) -> Path:
    """Saves what reproduces the run in its run dir: the resolved config and the submission (submit.sh)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    submit = cfg.run_dir / "submit.sh"
    lines = "\n".join(submit_lines(environment, cmd))
    submit.write_text(
        f"#!/usr/bin/env bash\n# {datetime.now().isoformat(timespec='seconds')}: "
        f"{shlex.join(['nanotron', 'launch', *argv])}\n"
        f"cd {shlex.quote(os.getcwd())}\n{lines}\n"
    )
    return submit


def submit(cmd: list[str], environment: dict[str, str]) -> str:
    """Runs sbatch (with the job's NANOTRON_* variables in its environment) and returns the job id."""
    result = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | environment)
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


def resolve_config(args: argparse.Namespace, passthrough: list[tuple[str, str]]) -> tuple[Config, list[str]]:
    """The run's config: the starting file, the flags and overrides, absolute paths; and notes on what was chosen."""
    path, notes = starting_config(args)
    if not path.is_file() and args.config is None:
        raise LaunchError(f"{path} not found: run from a source checkout of nanotron, or pass --config FILE")
    overrides = fit_max_seq_len(path, args, config_overrides(args, passthrough))
    cfg = load_config(path, overrides)
    checks.make_paths_absolute(cfg)
    checks.check_config_strings(cfg)
    return cfg, notes
