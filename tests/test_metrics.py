"""MFU against the right peak for the device in use, and memory of the rank that must fit."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import console_messages

from nanotron.config import load_config, parse_overrides
from nanotron.gpu import device_model, gpu_peak_tflops, math_mode, set_matmul_precision
from nanotron.metrics import step as metrics
from nanotron.metrics.logger import step_line
from nanotron.metrics.step import detect_peak_tflops, memory_record


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", ("H100", "")),
        ("NVIDIA H100 PCIe", ("H100", "pcie")),
        ("NVIDIA H100 NVL", ("H100", "nvl")),
        ("NVIDIA H200 NVL", ("H200", "nvl")),
        ("NVIDIA A100-PCIE-40GB", ("A100", "pcie")),
        ("NVIDIA A100-SXM4-80GB", ("A100", "")),
        ("Tesla V100-SXM2-32GB", ("V100", "")),
        ("AMD Instinct MI300X", ("MI300X", "")),
        ("NVIDIA H20", ("H20", "")),
    ],
)
def test_device_names_parse_to_model_and_form_factor(name, model):
    assert device_model(name) == model


# Dense datasheet figures: each variant its own (substring matching gave every H100/H200 the SXM figure).
@pytest.mark.parametrize(
    "name, mode, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H20", "bf16", 148.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        # Dense e4m3 float8: half the datasheets' "with sparsity" figures (twice bf16 on Hopper and Blackwell).
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "fp8", 1513.0),
        ("NVIDIA H200", "fp8", 1978.9),
        ("NVIDIA H200 NVL", "fp8", 1670.5),
        ("NVIDIA B200", "fp8", 4500.0),
        ("AMD Instinct MI300X", "fp8", 2614.9),
        ("NVIDIA A100-SXM4-80GB", "fp8", None),
        # No figure rather than a wrong one: Volta has no bf16/TF32 tensor cores; unlisted parts.
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Tesla V100-SXM2-16GB", "tf32", None),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("NVIDIA H100X", "bf16", None),
    ],
)
def test_gpu_peak_table_matches_the_exact_variant(name, mode, expected):
    assert gpu_peak_tflops(name, mode) == expected


def test_fp32_runs_use_tf32_tensor_cores_on_cuda_and_its_peak(monkeypatch):
    """fp32 MFU was divided by the TF32 peak while TF32 was never on: now training.tf32 turns it on (CUDA
    only) and the peak follows the math mode."""
    assert (math_mode("float32", True), math_mode("float32", False), math_mode("bfloat16", True)) == (
        "tf32",
        "fp32",
        "bf16",
    )
    cfg = load_config(*parse_overrides(["--config", "configs/tiny.toml"]))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        set_matmul_precision(cfg, torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"  # CPU: fp32 stays fp32
        set_matmul_precision(cfg, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"
        cfg.training.tf32 = False
        set_matmul_precision(cfg, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert detect_peak_tflops(torch.device("cuda"), "float32", tf32=True) == 378.0
    assert detect_peak_tflops(torch.device("cuda"), "float32", tf32=False) == 51.2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_peak_is_the_rate_the_fastest_matmul_layout_of_a_linear_layer_gets(dtype):
    """MFU on CPU is against a measured matmul rate: it must not be a layout slower than those a training step runs,
    or MFU passes 100 % (a bf16 run read "mfu 425%" here: a plain contiguous a @ b in bf16 ran at 0.84 GFLOP/s on
    this CPU without native bf16, x @ W^T at 9 and dY^T @ x at 17)."""
    element = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    a, b = torch.randn(1024, 1024, dtype=element), torch.randn(1024, 1024, dtype=element)
    rounds = []
    for _ in range(3):  # interleaved rounds: on a shared machine one quiet moment must not decide the comparison
        peak, rates = detect_peak_tflops(torch.device("cpu"), dtype, tf32=False), []
        for product in (lambda: a @ b.t(), lambda: a.t() @ b):  # a linear layer's forward, its weight gradient
            product()
            start = time.perf_counter()
            product()
            rates.append(2 * 1024**3 / (time.perf_counter() - start) / 1e12)
        rounds.append((peak, max(rates)))
        if peak >= 0.5 * max(rates):
            return
    pytest.fail(f"the measured peak is under half a linear layer's matmul rate in every round (peak, rate): {rounds}")


def test_unknown_gpu_warns_naming_the_key_and_logs_no_mfu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")
    assert detect_peak_tflops(torch.device("cuda"), "bfloat16", tf32=True) == 0.0
    out = console_messages(capsys.readouterr().out)
    assert len(out) == 1 and out[0].startswith("warning: ") and "'NVIDIA B300'" in out[0]
    assert "logging.peak_tflops" in out[0] and "bf16" in out[0]


def test_cuda_memory_record_has_allocated_reserved_its_share_of_the_device_and_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    record = memory_record(torch.device("cuda"))
    assert (record["memory_gib"], record["memory_reserved_gib"], record["memory_total_gib"]) == (3.0, 5.0, 80.0)
    assert record["host_memory_gib"] > 0
    line = step_line(STEP | record, total_steps=2)
    assert "| mem 3.00GiB (6% of 80GiB, reserved 5.00GiB, host " in line


STEP = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0, "tokens_per_sec_per_device": 5.0}
STEP |= {"step_time_sec": 0.25, "tflops": 1.0, "mfu": 0.5, "consumed_tokens": 1_234_567, "eta_sec": 75}


def test_the_step_line_says_step_time_rates_per_device_and_global_and_tokens_consumed():
    line = step_line(STEP | {"memory_gib": 0.5}, total_steps=2)
    assert line == (
        "step 1/2 | loss 2.0000 | lr 1.000e-03 | grad_norm 1.000 | 0.250s/step | tokens/s 10 (5/device) | tflops 1.000"
        " | mfu 50.00% | mem 0.50GiB | tokens 1.23M | eta 1m15s"
    )


def _memory_worker(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # Rank 1 peaks 1 GiB higher (e.g. the first 1F1B stage). Added to the real peak rather than allocated: a busy
    # host does not keep 512 MiB touched by one rank resident (CI saw a 0.22 GiB difference), the reduction is the same.
    # Read once: the process keeps growing (gloo, the record's own collective), and the test compares exact values.
    own = metrics._peak_rss_gib() + (1.0 if rank == 1 else 0.0)  # this rank's own peak, GiB
    metrics._peak_rss_gib = lambda: own
    record = memory_record(torch.device("cpu"))
    torch.save({"record": record, "own": own}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_memory_is_the_maximum_over_ranks(tmp_path, forkserver):
    """The logging rank reports the largest rank's peak, not its own: every rank gets the same record,
    equal to the peak of the rank that allocated most."""
    args = (2, str(tmp_path / "init"), str(tmp_path / "out"))
    mp.start_processes(_memory_worker, args=args, nprocs=2, start_method="forkserver")
    results = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    assert results[0]["record"] == results[1]["record"]
    assert results[1]["own"] > results[0]["own"] + 0.25  # rank 1 peaked higher
    assert results[0]["record"]["memory_gib"] == pytest.approx(results[1]["own"])
