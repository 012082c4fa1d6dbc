"""Weights & Biases in offline mode: a run killed and resumed is one W&B run with every step once; without the
package the run goes on with one warning line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, read_metrics, train_env

wandb = pytest.importorskip("wandb")
pytestmark = pytest.mark.slow  # training processes and W&B's service


def history(path: Path) -> tuple[set[str], list[tuple[int, set[str]]]]:
    """The run ids and the (step, keys) of each history record of an offline run's transaction log: W&B's header
    (":W&B", magic, version: 7 bytes), then LevelDB log records (32 KiB blocks, 7-byte headers) of protobuf
    Records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, ids, steps = 7, b"", set(), []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                keys = {item.key or "/".join(item.nested_key) for item in record.history.item}
                steps.append((record.history.step.num, keys))
    return ids, steps


def train(tiny_data, out: Path, extra: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={out}", "--job.name=run", "--training.steps=6"]
    args += ["--logging.wandb=true", "--checkpoint.interval=3", *extra]
    command = [sys.executable, "-m", "nanotron.train", *args]
    return subprocess.run(command, cwd=REPO, env=train_env() | env, capture_output=True, text=True, timeout=300)


def test_a_killed_and_resumed_run_is_one_wandb_run_with_every_step_once(tiny_data, tmp_path):
    """Offline through W&B's own WANDB_MODE (the config leaves wandb_mode empty): a cluster user's setting holds."""
    env = {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_CACHE_DIR": str(tmp_path)}
    env["WANDB_MODE"] = "offline"
    killed = train(tiny_data, tmp_path, [], env | {"NANOTRON_FAULT": "rank:0,step:6,kind:crash"})
    assert killed.returncode != 0
    run_dir = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4, 5]  # checkpoint at 3
    resumed = train(tiny_data, tmp_path, [], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # one per process, both of the same run
    ids, steps = set(), []
    for log in logs:
        found_ids, found_steps = history(log)
        ids |= found_ids
        steps += found_steps
    assert ids == {json.loads((run_dir / "wandb.json").read_text())["id"]}
    # What W&B keeps, as it keeps it: the logs in order, a step at or below the last one held dropped. The killed
    # process's log is empty here (SIGKILL before W&B wrote anything); the resumed one re-sent steps 1-3 from
    # metrics.jsonl, and trained and sent 4-6 again.
    kept, last = [], 0
    for step, keys in steps:
        if step > last:
            kept.append(step)
            last = step
            assert {"loss", "lr", "grad_norm", "tokens_per_sec"} <= keys, (step, keys)
    assert kept == [1, 2, 3, 4, 5, 6]


def test_without_the_package_the_run_goes_on_with_one_warning(tiny_data, tmp_path):
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "wandb.py").write_text("raise ImportError('hidden for the test')\n")
    env = {"PYTHONPATH": f"{hidden}:{REPO}"}
    done = train(tiny_data, tmp_path, ["--training.steps=2", "--logging.wandb_mode=offline"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stdout.splitlines() if "wandb" in line]
    assert len(warnings) == 1 and "not installed" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]


def test_wandbs_own_variables_apply_where_the_config_leaves_the_key_empty(tmp_path):
    from nanotron.config import load_config
    from nanotron.metrics.wandb_run import init_settings

    environ = {"WANDB_PROJECT": "theirs", "WANDB_MODE": "offline", "WANDB_DIR": "/scratch/wandb"}
    cfg = load_config("configs/tiny.toml", [("job.out_dir", str(tmp_path))])
    # None: wandb.init reads WANDB_ENTITY / WANDB_RUN_GROUP / WANDB_MODE / WANDB_DIR itself
    assert init_settings(cfg, environ) == {
        "project": "theirs",
        "entity": None,
        "group": None,
        "mode": None,
        "dir": None,
    }
    assert init_settings(cfg, {}) == {
        "project": "nanotron",
        "entity": None,
        "group": None,
        "mode": None,
        "dir": str(cfg.run_dir),
    }
    keys = [("logging.wandb_project", "mine"), ("logging.wandb_mode", "online"), ("logging.wandb_group", "sweep")]
    cfg = load_config("configs/tiny.toml", [("job.out_dir", str(tmp_path)), *keys])
    settings = init_settings(cfg, environ)
    assert (settings["project"], settings["mode"], settings["group"]) == ("mine", "online", "sweep")
