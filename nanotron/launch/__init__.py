"""Launching runs: `local` starts workers on this machine (torchrun with job-friendly exit codes and
signals), `cluster` submits a run to Slurm with the seed launcher's flags (`python -m nanotron.launch`)."""

from nanotron.launch.cluster import main

__all__ = ["main"]
