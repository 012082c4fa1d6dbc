"""CUDA/NCCL environment defaults: chosen by layout, never overriding what the user set."""

from __future__ import annotations

import os

import pytest
import torch

from nanotron.config import load_config, parse_overrides
from nanotron.gpu import (
    HOST_MMAP_THRESHOLD,
    HOST_TRIM_THRESHOLD,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    apply_env_defaults,
    env_defaults,
    keep_freed_host_memory,
)
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
        (["--parallelism.cp=2", "--parallelism.tp=2"], "32"),  # the ring's send/recv, FSDP over dp x cp
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
    why = async_tp_unavailable(config(*base, *overrides), device)
    assert why == reason if reason is None else reason in why


class FakeLibc:
    """glibc's mallopt as a recorder: (param, value) of each call, answering `answer`."""

    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_cpu_runs_keep_freed_host_memory_unless_the_user_chose():
    libc = FakeLibc()
    line = keep_freed_host_memory(torch.device("cpu"), environ={}, libc=libc)
    assert libc.calls == [(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD)]
    assert line.startswith("host memory kept for reuse (glibc malloc: mmap threshold 256 MiB")
    assert "GLIBC_TUNABLES" in line
    for device, environ in (
        (torch.device("cuda", 0), {}),  # the host allocates little per step on a GPU
        (torch.device("cpu"), {"MALLOC_TRIM_THRESHOLD_": "0"}),
        (torch.device("cpu"), {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}),
    ):
        untouched = FakeLibc()
        assert keep_freed_host_memory(device, environ=environ, libc=untouched) is None
        assert untouched.calls == []
    assert keep_freed_host_memory(torch.device("cpu"), environ={}, libc=FakeLibc(answer=0)) is None
    assert keep_freed_host_memory(torch.device("cpu"), environ={}, libc=object()) is None  # no mallopt: not glibc


REFAULTS = """
import resource, sys, torch
from nanotron.gpu import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory(torch.device("cpu"), environ={})
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(5):  # a step's activations: 48 MiB (above glibc's own 32 MiB ceiling), freed, made again
    # (the 2nd allocation misses the 1st's exact-size free chunk by posix_memalign's slack; the 3rd fits)
    before = faults()
    torch.ones(12 << 20)
    counts.append(faults() - before)
print(min(counts[2:]))  # the steady state's best: a page fault of the machine's own (reclaim) is not the setting's
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="counts Linux page faults")
def test_freed_activations_come_back_without_page_faults():
    """The setting's point, measured: a 48 MiB buffer freed and allocated again faults its 12k pages in anew
    under glibc's defaults, and (almost) none with the setting."""
    import subprocess
    import sys

    def refaults(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        run = subprocess.run([sys.executable, "-c", REFAULTS, mode], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    default, keep = refaults("default"), refaults("keep")
    assert default > 10_000 and keep < 1_000, f"page faults per 48 MiB re-allocation: {default} by default, {keep} kept"
