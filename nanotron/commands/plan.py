"""`nanotron plan`: will this layout fit, how fast will it run, which layout is best.

    nanotron plan --config configs/large.toml --nodes 4 --gpus_per_node 8 --gpu h100
    nanotron plan --config configs/large.toml --nodes 8 --gpus_per_node 8 --gpu h100 --search
    nanotron plan --config configs/large.toml --nodes 64 --gpus_per_node 8 --check \\
        --parallelism.pp=4 --parallelism.dp=16 --parallelism.tp=8

Extra `--section.key=value` arguments are config overrides, as for `nanotron train`. Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from nanotron.commands.args import Once, Parser
from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError, run_command
from nanotron.gpu import GPU_FORMS, LINK_GBPS, PLANNED
from nanotron.optim.muon import check_adamw_names
from nanotron.parallel.layout import layout_product
from nanotron.plan.report import check_table, describe, search_table
from nanotron.plan.timing import UNCALIBRATED_EFFICIENCY, Efficiency, parse_gpu

# A node is one NVLink domain to the planner (tp and HSDP shard groups stay inside it): 1024 GPUs is above the largest
# announced (NVL576); 2**17 nodes of 8 GPUs are 1M GPUs, five times the largest clusters built (~200k). Unbounded,
# a --search of 10**7 nodes ran for minutes without a word; at these bounds it takes seconds.
MAX_NODES, MAX_GPUS_PER_NODE = 2**17, 1024


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="nanotron plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config",
        action=Once,
        help="TOML config (default: built-in defaults); overrides follow as --section.key=value",
    )
    p.add_argument("--nodes", type=int, default=1, help=f"nodes in the cluster, 1 to {MAX_NODES} (default 1)")
    p.add_argument(
        "--gpus_per_node",
        type=int,
        default=8,
        help=f"GPUs per node (NVLink domain), 1 to {MAX_GPUS_PER_NODE} (default 8)",
    )
    p.add_argument(
        "--gpu",
        default="h100",
        help=f"{GPU_FORMS} (float8 at twice it; default h100)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="achieved fraction of peak compute (default: the GPU's, from published runs where the calibration "
        f"set has them: {', '.join(f'{name} {parse_gpu(name).efficiency.default:g}' for name in PLANNED)}; "
        f"custom GPUs {UNCALIBRATED_EFFICIENCY}, uncalibrated)",
    )
    links = f"{LINK_GBPS[0]:g} to {LINK_GBPS[1]:g}"
    p.add_argument(
        "--nvlink_gbps", type=float, help=f"ring bandwidth per GPU inside a node, GB/s, {links} (default: by --gpu)"
    )
    p.add_argument("--ib_gbps", type=float, help=f"bandwidth per GPU across nodes, GB/s, {links} (default: by --gpu)")
    p.add_argument("--search", action="store_true", help="rank every layout that fits this cluster by throughput")
    p.add_argument("--top", type=int, default=15, help="rows of the --search table (default 15)")
    p.add_argument("--check", action="store_true", help="build every distinct rank on a fake process group")
    return p


def _plan(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    _, overrides = parse_overrides(extra)
    for flag, value, most in (
        ("--nodes", args.nodes, MAX_NODES),
        ("--gpus_per_node", args.gpus_per_node, MAX_GPUS_PER_NODE),
    ):
        if not 1 <= value <= most:
            raise ConfigError(f"{flag}: expected an integer from 1 to {most}, got {value}")
    if args.top < 1:
        raise ConfigError(f"--top: expected an integer >= 1, got {args.top}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency: expected a fraction in (0, 1], got {args.efficiency}")
    gpu = parse_gpu(args.gpu, args.nvlink_gbps, args.ib_gbps)
    if args.efficiency is not None:  # the user's figure replaces the GPU's default and its published spread
        gpu = dataclasses.replace(gpu, efficiency=Efficiency(args.efficiency, source="--efficiency"))
    args.efficiency = gpu.efficiency.default
    cfg = load_config(args.config, overrides)
    check_adamw_names(cfg.optimizer, cfg.model)
    capacity = args.nodes * args.gpus_per_node
    layout = f"{layout_product(cfg)} GPUs"
    if cfg.world_size <= capacity:
        out = describe(cfg, gpu, args.nodes, args.gpus_per_node, args.efficiency)
    elif args.search and not args.check:  # the search only needs the model, batch and options from the config
        cluster = f"{args.nodes} x {args.gpus_per_node} GPUs"
        out = [f"the config's own layout ({layout}) is larger than {cluster}: not described"]
    else:
        raise ConfigError(
            f"{layout} but --nodes {args.nodes} x --gpus_per_node {args.gpus_per_node} = {capacity}; lower "
            "dp/cp/tp/pp or raise --nodes (--search alone ranks the layouts of this cluster)"
        )
    if args.search:
        out += ["", *search_table(cfg, capacity, gpu, args.gpus_per_node, args.efficiency, args.top)]
    if args.check:
        out += ["", *check_table(cfg)]
    print("\n".join(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_plan, list(sys.argv[1:] if argv is None else argv))
