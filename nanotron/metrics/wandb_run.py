"""Weights & Biases, optional (`pip install ".[wandb]"`, `logging.wandb = true`): every record that goes to
metrics.jsonl also goes to one W&B run, from the logging rank only.

One run dir is one W&B run: its id is kept in `<run dir>/wandb.json` (written before the run starts), so a resume,
a Slurm requeue or an in-place restart continues the same run (`resume="allow"`). W&B keeps each step once: a
step at or below the last one it holds is dropped (online at once, offline when `wandb sync` uploads the run's
offline dirs in order). A process killed with SIGKILL loses what W&B had not yet written (measured: a run killed
after 5 steps left an empty log), so a resumed process first re-sends the records of metrics.jsonl up to its
checkpoint's step (those W&B already holds are dropped), then logs on: every step once, none missing. Cost: one
read of metrics.jsonl at a resume, on the logging rank (100k records at 1M steps: seconds).

`logging.wandb_mode = "offline"` (or `WANDB_MODE=offline`) needs no network (`wandb sync <run
dir>/wandb/offline-run-*` later). W&B's own variables (`WANDB_MODE`, `WANDB_PROJECT`, `WANDB_ENTITY`,
`WANDB_RUN_GROUP`, `WANDB_DIR`) apply wherever the config leaves the key empty. No package, or no way to start the
run: one warning line, and the run goes on with metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nanotron import records
from nanotron.config import Config
from nanotron.console import quiet_handler_errors, say
from nanotron.errors import UserError
from nanotron.io import write_atomic

STATE_FILE = "wandb.json"
HINT = "logging to metrics.jsonl and TensorBoard only"


def init_settings(cfg: Config, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """`wandb.init`'s project, entity, group, mode and dir: the config's where it sets them; else None, which lets
    W&B read its own variable (the project falls back to 'nanotron', the dir to the run dir)."""
    log = cfg.logging
    return {
        "project": log.wandb_project or environ.get("WANDB_PROJECT") or "nanotron",
        "entity": log.wandb_entity or None,
        "group": log.wandb_group or None,
        "mode": log.wandb_mode or None,
        "dir": None if environ.get("WANDB_DIR") else str(cfg.run_dir),
    }


class WandbRun:
    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def start(cls, cfg: Config) -> WandbRun | None:
        """The run dir's W&B run, started or continued; None (after one warning line) when it can't be."""
        try:
            import wandb
        except ImportError:
            say(f"warning: logging.wandb=true but the wandb package is not installed (pip install '.[wandb]'); {HINT}")
            return None
        path = cfg.run_dir / STATE_FILE
        try:
            state = records.read(path, records.WANDB_STATE, UserError) if path.exists() else {}
        except UserError as error:
            say(f"warning: {error}; a new W&B run is started")
            state = {}
        run_id = state.get("id") or secrets.token_hex(6)  # ours: lowercase letters and digits
        write_atomic(path, json.dumps({"id": run_id}) + "\n", durable=False)
        try:
            with quiet_handler_errors():  # its debug log on a full disk: a stack per record otherwise
                run = wandb.init(
                    **init_settings(cfg),
                    name=cfg.job.name,
                    id=run_id,
                    resume="allow",
                    config=cfg.to_dict(),
                    settings=wandb.Settings(silent=True, init_timeout=60),
                )
        except Exception as error:  # noqa: BLE001 - no network, bad credentials, a W&B server error
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            say(
                f"warning: W&B run {run_id} did not start ({first}); logging.wandb_mode='offline' needs no network "
                f"(wandb sync later); {HINT}",
            )
            return None
        return cls(run)

    def log(self, record: dict) -> None:
        step = record.get("step")
        values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if isinstance(step, int) and values:
            self.run.log(values, step=step)

    def resend(self, metrics: Path, step: int) -> None:
        """The records of `metrics` (metrics.jsonl) up to `step`, the checkpoint a resumed process starts from,
        in order (a later process's records for the same step replace an earlier's: they were recomputed)."""
        records: dict[int, list[dict]] = {}
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut by a kill
                    continue
                if isinstance(record.get("step"), int) and record["step"] <= step:
                    records.setdefault(record["step"], []).append(record)
        for at in sorted(records):
            for record in records[at]:
                self.log(record)

    def close(self) -> None:
        self.run.finish()
