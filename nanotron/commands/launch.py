"""`nanotron launch` (also `python -m nanotron.launch`): nanotron's `slurm_launcher.py` flags → a run dir →
`sbatch launch/slurm.sh`.

    nanotron launch --run_name my_first_experiment --nodes 4 --model_size base
    nanotron launch --run_name cpu_test --nodes 2 --gpus_per_node 0 --nproc_per_node 2 --dp 4 --tp 1 --dry_run

A run starts from `configs/<model_size>.toml` (or `--config FILE`) and the flags override it. The whole config is
resolved and checked here, on the login node, with what would fail in the queue (paths, Python, data and split
sizes, filesystems the nodes share: `nanotron.launch.checks`), so a mistake costs a second instead of a wait for
nodes. It writes `<out_dir>/<run_name>/config.toml` (the resolved config, absolute paths) and `submit.sh` (the exact
`sbatch` command), then submits the one job script with `sbatch` options. Any `--section.key=value` argument is
passed on as a config override, as for `nanotron train`.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from pathlib import Path

import nanotron.launch.checks as checks
from nanotron.commands.args import Once, Parser, int_at_least, number_at_least
from nanotron.config import parse_overrides, to_toml
from nanotron.errors import ConfigError, LaunchError, run_command
from nanotron.gpu import GPU_FORMS
from nanotron.launch.cluster import (
    JOB_SCRIPT,
    check_slurm_flags,
    follow_log,
    job_environment,
    plan_before_submit,
    plan_nodes,
    planned_step_seconds,
    resolve_config,
    run_length_notes,
    sbatch_command,
    submit,
    submit_lines,
    write_run_dir,
)
from nanotron.launch.flags import CONFIG_FLAGS, flag_help, model_summary, original_spellings


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="nanotron launch",
        allow_abbrev=False,
        description="Resolve and validate a run's config, write runs/<run_name>/, and submit launch/slurm.sh "
        "with sbatch. Extra --section.key=value arguments are config overrides, as for nanotron.train.",
    )
    p.add_argument("--run_name", required=True, help="run dir name and Slurm job name (letters, digits, . _ -)")
    p.add_argument(
        "--config",
        action=Once,
        help="TOML config to start from (default: configs/<model_size>.toml; without --model_size, the preset "
        "nearest --hidden_size, else tiny)",
    )
    slurm = p.add_argument_group("Slurm")
    slurm.add_argument("--nodes", type=int_at_least(1), default=2, help="most nodes to request (default 2)")
    slurm.add_argument(
        "--gpus_per_node", type=int_at_least(0), default=8, help="one process per GPU (default 8); 0 = CPU nodes"
    )
    slurm.add_argument(
        "--nproc_per_node", type=int_at_least(1), help="processes per node with --gpus_per_node 0 (default 1)"
    )
    slurm.add_argument("--partition", default="", help="Slurm partition (default: the cluster's default)")
    slurm.add_argument("--account", default="", help="account to charge (most clusters require one)")
    slurm.add_argument("--qos", default="", help="quality of service")
    slurm.add_argument("--reservation", default="", help="reservation to run in")
    slurm.add_argument("--exclude", default="", help="nodes to leave out, e.g. node[3-4],node7")
    slurm.add_argument("--constraint", default="", help="node features required, e.g. h100&ib")
    slurm.add_argument("--time_limit", default="1:00:00", help="Slurm time format (default 1:00:00)")
    slurm.add_argument("--email", help="mail the job's end or failure to this address")
    slurm.add_argument(
        "--sbatch_args",
        default="",
        help='any other sbatch options, as one quoted value: --sbatch_args "--mem=0 --comment=x"',
    )
    env = p.add_argument_group("every node's environment (plain sbatch: NANOTRON_SETUP, NANOTRON_CONTAINER_*)")
    env.add_argument("--setup", help="shell file sourced on every node before Python starts (module load, conda ...)")
    env.add_argument("--container_image", help="run each node's task in this image (pyxis: srun --container-image)")
    env.add_argument("--container_mounts", help="SRC:DST[,SRC:DST...] for --container_image (the data, the run dir)")
    env.add_argument("--container_exec", help="a command each node's task runs through: 'apptainer exec --nv x.sif'")
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
        help=f"GPU the plan checks memory against: {GPU_FORMS} (default h100)",
    )
    run.add_argument("--force", action="store_true", help="submit even if the plan says the layout does not fit")
    run.add_argument(
        "--max_epochs",
        type=number_at_least(0),
        default=4.0,
        help="warn when the run passes over its corpus more often; 0: never (default 4: Muennighoff et al. 2023 "
        "found up to ~4 repeated epochs cost little)",
    )
    return p


def _join_sbatch_args(argv: list[str]) -> list[str]:
    """`--sbatch_args "--mem=0 ..."` as one value: argparse would take its leading "--" for a flag of ours."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--sbatch_args":
            out[i : i + 2] = [f"--sbatch_args={out[i + 1]}"]
            break
    return out


def main(argv: list[str] | None = None) -> int:
    return run_command(_launch, argv)


def _launch(argv: list[str]) -> int:
    parser = build_parser()
    checks.check_printable(argv)
    args, extra = parser.parse_known_args(original_spellings(_join_sbatch_args(argv), parser))
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
    from nanotron.checkpoint.manager import resolve_source  # torch: only once the flags are good
    from nanotron.optim.muon import check_adamw_names

    resolve_source(cfg.checkpoint_dir, cfg.checkpoint)  # what the job would refuse at start, on the shared filesystem
    check_adamw_names(cfg.optimizer, cfg.model)
    nodes, procs, layout_notes = plan_nodes(cfg, args)
    plan = plan_before_submit(cfg, args, procs)
    python = "python" if args.container_image or args.container_exec else checks.job_python()  # the image's
    cmd = sbatch_command(args, cfg, nodes, procs, python)
    environment = job_environment(args)
    if not JOB_SCRIPT.is_file():
        raise LaunchError(f"{JOB_SCRIPT} not found: run from a source checkout of nanotron (pip install -e .)")
    if not args.dry_run and shutil.which("sbatch") is None:
        raise LaunchError(
            "sbatch not found: run this on a Slurm login node, or add --dry_run to only write "
            f"{cfg.run_dir}/config.toml and print the sbatch command"
        )
    corpus = checks.check_data(cfg)
    step_seconds = planned_step_seconds(cfg, args, procs)
    notes += run_length_notes(cfg, corpus.num_train_samples, args.max_epochs, step_seconds, args.time_limit)
    notes += layout_notes + checks.shared_filesystem_notes(checks.job_paths(cfg, sys.prefix, Path.cwd()))
    for note in notes:
        print(note, file=sys.stderr)
    if (cfg.checkpoint_dir / "latest").exists() and cfg.checkpoint.resume_from == "auto":
        print(f"note: {cfg.checkpoint_dir} has checkpoints: the job resumes from the latest", file=sys.stderr)
    submit_file = write_run_dir(cfg, environment, cmd, argv)
    print(model_summary(cfg))
    print("\n".join(plan))
    print(f"resolved config: {cfg.run_dir / 'config.toml'}")
    print(f"submit script ({submit_file}):\n" + "\n".join(f"  {line}" for line in submit_lines(environment, cmd)))
    if args.dry_run:
        print(to_toml(cfg))
        print("dry run: nothing submitted")
        return 0
    job_id = submit(cmd, environment)
    log = cfg.run_dir / f"slurm-{job_id}.out"
    print(f"submitted job {job_id}; log: {log}")
    if not args.show_logs:
        return 0
    state = follow_log(job_id, log)
    print(f"job {job_id}: {state}")
    return 0 if state == "COMPLETED" else 1
