"""Launching runs: `torchrun` starts workers on this machine (torchrun with job-friendly exit codes and signals;
also each Slurm node's launcher), `cluster` submits a run to Slurm with the seed launcher's flags (`nanotron
launch`, `python -m nanotron.launch`): `flags` turns them into a config, `checks` finds what would fail in the queue.

Nothing is imported here: the trainer loads `launch.torchrun` alone, never the Slurm submitter."""
