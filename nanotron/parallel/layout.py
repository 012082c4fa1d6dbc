"""The layout as people and records read it: checkpoints' trainer_state.json, eval and run reports, captions. From
the config, so tools that start no process group (reports, the planner) say it the same way."""

from __future__ import annotations

from nanotron.config import Config


def layout_sizes(cfg: Config) -> dict[str, int]:
    p = cfg.parallelism
    return {"dp": p.dp, "cp": p.cp, "ep": p.ep, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage}


def layout_line(cfg: Config) -> str:
    """e.g. `dp 2 x cp 1 x tp 2 x pp 2 (1f1b), zero 0`."""
    p = cfg.parallelism
    return f"dp {p.dp} x cp {p.cp} x tp {p.tp} x pp {p.pp} ({p.pp_engine}), zero {p.zero_stage}"


def layout_product(cfg: Config) -> str:
    """The processes a layout needs, e.g. `dp*cp*tp*pp = 2*1*2*2 = 8`."""
    p = cfg.parallelism
    return f"dp*cp*tp*pp = {p.dp}*{p.cp}*{p.tp}*{p.pp} = {cfg.world_size}"
