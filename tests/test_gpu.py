"""CUDA/NCCL environment defaults: chosen by layout, never overriding what the user set."""

from __future__ import annotations

import os

import pytest
import torch

from nanotron.config import load_config, parse_overrides
from nanotron.gpu import apply_env_defaults, env_defaults
from nanotron.parallel.overlap import async_tp_unavailable, max_connections


def config(*overrides: str):
    return load_config(*parse_overrides(["--config", "configs/tiny.toml", "--job.out_dir=/runs", *overrides]))


def defaults_of(*overrides: str, environ: dict[str, str]) -> dict[str, str]:
    cfg = config(*overrides)
    return env_defaults(cfg.run_dir, max_connections(cfg), environ=environ)


@pytest.mark.parametrize(
    "layout, expected",
    [
        ([], None),  # one device: nothing to overlap, CUDA's default
        (["--parallelism.tp=2"], "1"),  # TP only: the seed's Megatron ordering
        (["--parallelism.tp=2", "--parallelism.tp_mode=all_reduce"], "1"),
        (["--parallelism.dp=2"], "32"),  # FSDP2 all-gathers / reduce-scatters must overlap compute
        (["--parallelism.dp=2", "--parallelism.tp=2"], "32"),
        (["--parallelism.pp=2", "--parallelism.tp=2"], "32"),  # pipeline send/recv
        (["--parallelism.tp=2", "--parallelism.tp_linear_async_communication=true", "--training.compile=true"], "32"),
        # async TP requested where it can't run (all_reduce) leaves plain TP: the seed's setting again
        (
            [
                "--parallelism.tp=2",
                "--parallelism.tp_mode=all_reduce",
                "--parallelism.tp_linear_async_communication=true",
                "--training.compile=true",
            ],
            "1",
        ),
    ],
)
def test_max_connections_is_one_only_where_tp_is_the_only_traffic(layout, expected):
    defaults = defaults_of(*layout, environ={})
    assert defaults.get("CUDA_DEVICE_MAX_CONNECTIONS") == expected


def test_allocator_and_flight_recorder_defaults_point_into_the_run_dir():
    defaults = defaults_of("--job.name=first", environ={})
    assert defaults["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert defaults["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(defaults["TORCH_FR_BUFFER_SIZE"]) > 0  # the dump needs a trace buffer
    assert defaults["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/first/nccl_trace_rank_"


def test_variables_the_user_set_are_left_alone_under_any_alias():
    user = {
        "CUDA_DEVICE_MAX_CONNECTIONS": "8",
        "PYTORCH_ALLOC_CONF": "expandable_segments:False",  # the newer name of PYTORCH_CUDA_ALLOC_CONF
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",  # the older name of TORCH_FR_BUFFER_SIZE
    }
    defaults = defaults_of("--parallelism.tp=2", environ=user)
    assert defaults.keys() == {"TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"}


def test_apply_sets_the_defaults_in_this_process_for_the_ranks_it_starts(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("CUDA_", "PYTORCH_", "TORCH_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    cfg = config("--parallelism.dp=2")
    applied = apply_env_defaults(cfg.run_dir, max_connections(cfg))
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == applied["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in applied


@pytest.mark.parametrize(
    "overrides, device, reason",
    [
        (["--parallelism.tp_mode=all_reduce"], "cuda", "nothing to overlap"),
        (["--training.compile=false"], "cuda", "training.compile=true"),
        ([], "cpu", "needs CUDA"),
        (["--parallelism.tp=1"], "cuda", "tp > 1"),
        ([], "cuda", None),
    ],
)
def test_async_tp_says_why_it_cannot_run(overrides, device, reason):
    base = ["--parallelism.tp=2", "--parallelism.tp_linear_async_communication=true", "--training.compile=true"]
    why = async_tp_unavailable(config(*base, *overrides), torch.device(device))
    assert why == reason if reason is None else reason in why
