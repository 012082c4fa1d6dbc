"""`nanotron doctor --config CFG [--section.key=value ...] [--nproc_per_node N]`: the preflight checks of
`nanotron.watch.doctor` (compute, links, checkpoint disk, clocks) at the config's layout, without training.

Under `torchrun`/`srun` it runs in every rank; with `--nproc_per_node N` it starts N local ranks itself.
"""

from __future__ import annotations

from nanotron.config import load_config, parse_overrides
from nanotron.errors import run_as_main, run_command
from nanotron.launch.torchrun import launched_world_size, pop_nproc, spawn_local


def _main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        from nanotron.watch import doctor

        print(__doc__ + "\n" + doctor.__doc__)
        return 0
    nproc = pop_nproc(argv)
    cfg = load_config(*parse_overrides(argv), world_size=nproc or launched_world_size())
    if nproc:
        return spawn_local(nproc, ["-m", "nanotron", "doctor", *argv])
    # A rank: the checks' imports are here, so the launcher of local ranks (above) loads no torch before torchrun.
    from nanotron.parallel.mesh import destroy_distributed, init_distributed
    from nanotron.watch.doctor import preflight

    ctx = init_distributed(cfg)
    preflight(cfg, ctx, standalone=True)
    if ctx.rank == 0:
        print(f"doctor: {ctx.world_size} ranks healthy", flush=True)
    destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    run_as_main(main)
