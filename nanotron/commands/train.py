"""Entry point: `python -m nanotron.train --config configs/tiny.toml [--section.key=value ...]`.

Run it plainly for one process, under `torchrun` for many, or with `--nproc_per_node N` to have it
validate the config first and then start N local processes itself.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from nanotron.config import Config, help_text, load_config, parse_overrides
from nanotron.console import say
from nanotron.data import open_corpus
from nanotron.errors import RUN_DIR_VARIABLE, run_as_main, run_command
from nanotron.gpu import apply_env_defaults
from nanotron.io import check_writable
from nanotron.launch.torchrun import launched_world_size, pop_nproc, spawn_local
from nanotron.lock import lock_run
from nanotron.parallel.overlap import max_connections
from nanotron.signals import fail_writes_past_the_size_limit, stop_with_launcher


def _main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__ + "\nKeys (set in the TOML file or as --section.key=value):\n" + help_text())
        return 0
    nproc = pop_nproc(argv)
    path, overrides = parse_overrides(argv)
    cfg = load_config(path, overrides, world_size=nproc or launched_world_size())
    os.environ[RUN_DIR_VARIABLE] = str(cfg.run_dir.absolute())  # where a rank files what the console must not show
    check_writable("job.out_dir", cfg.run_dir)
    check_writable("checkpoint.dir", cfg.checkpoint_dir)
    if cfg.profiler.export_path:
        check_writable("profiler.export_path", Path(cfg.profiler.export_path))
    apply_env_defaults(cfg.run_dir, max_connections(cfg))  # before CUDA or NCCL start; local ranks inherit them
    if nproc:
        open_corpus(cfg)  # data errors surface here as one line, before the processes start
        return spawn_local(nproc, ["-m", "nanotron.train", *argv])
    return _train(cfg)


def _train(cfg: Config) -> int:
    """One rank's run. The training stack is imported here: the launcher of local ranks (above) checks the config
    and the corpus without torch, which only its torchrun loads."""
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    # One run per run dir: global rank 0 holds the lock for the run's lifetime (peers follow its fate).
    owns_run_dir = int(os.environ.get("RANK", "0")) == 0
    stop_with_launcher()
    fail_writes_past_the_size_limit()
    cfg = resolve_sp_regather(cfg)
    try:
        with lock_run([cfg.run_dir, cfg.checkpoint_dir]) if owns_run_dir else contextlib.nullcontext():
            trainer = Trainer(cfg)
            trainer.train()
            trainer.close()
    except BaseException:
        if cfg.world_size > 1:  # fail fast: a peer stuck in a collective would never join the teardown
            raise
        destroy_distributed()  # alone, the teardown can't block, and in-process callers get a clean slate
        raise
    destroy_distributed()
    return 0


def resolve_sp_regather(cfg: Config) -> Config:
    """cfg with parallelism.sp_regather as this rank builds its model: 'auto' decided by the plan of this config on
    this rank's device (`nanotron.plan.search.choose_sp_regather`; the Trainer turns it on everywhere if any rank
    did), said once by rank 0. The planner is loaded only where the setting can act (sequence parallelism, eager)."""
    from nanotron.gpu import device_memory_gib
    from nanotron.parallel.mesh import pick_device
    from nanotron.parallel.regather import can_regather

    if not can_regather(cfg):
        return cfg
    from nanotron.plan.search import choose_sp_regather, sp_regather_line, with_sp_regather

    on, why = choose_sp_regather(cfg, device_memory_gib(pick_device(cfg)))
    if int(os.environ.get("RANK", "0")) == 0:
        say(sp_regather_line(cfg, on, why))
    return with_sp_regather(cfg, on)


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    run_as_main(main)
