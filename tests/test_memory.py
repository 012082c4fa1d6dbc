"""ZeRO stages keep their memory promise and their communication promise (gradients reduced once per step at
stage 1, every microbatch at 2/3), measured in real training processes by
`benchmarks/probe.py`: what a rank holds between microbatches, not only after the step. Every run also
holds `nanotron plan`'s per-rank estimate to the measurement (parameters, gradients, optimizer state
within 5%, saved activations within 25%)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, TINY_MODEL, ZYGOTE, train_env, train_losses

from nanotron.config import load_config, parse_overrides
from nanotron.parallel.mesh import ParallelContext, build_mesh
from nanotron.parallel.parallelize import build_model
from nanotron.parallel.recompute import POLICY_SEES_OUTPUTS, recompute_mode
from nanotron.parallel.runner import MicrobatchRunner
from nanotron.parallel.torch_private import fake_process_group, pipeline_keeps_receive_buffers
from nanotron.plan.memory import (
    communication_buffer_bytes,
    element_bytes,
    micro_tokens,
    rank_stages,
    rank_weights,
    stage_memory,
)

# Global batch 16 of one sample: 16 microbatches in one process, 8 per rank at dp=2 (the case).
EIGHT_MICROBATCHES = ["--training.micro_batch_size=1", "--training.global_batch_size=16", "--training.steps=2"]


def measure(
    tiny_data, out: Path, name: str, nproc: int, extra: list[str], activation_tolerance: float = 0.25
) -> tuple[list[dict], list[float]]:
    """Per-rank records of benchmarks.memory's worker (the real Trainer under the probe) and the losses; checks
    `nanotron plan`'s estimate against them on the way (the memory formula is validated by every run here)."""
    record = out / f"{name}.json"
    train_args = [
        *TINY_MODEL,
        *tiny_data.overrides(),
        *EIGHT_MICROBATCHES,
        f"--job.out_dir={out}",
        f"--job.name={name}",
        "--checkpoint.save_final=false",
        *extra,
    ]
    args = ["--worker", "--out", str(record), *train_args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "benchmarks.memory", *args]  # its ranks forked (tests/zygote.py)
    proc = ZYGOTE.run(command, args, nproc, REPO, train_env(), 300, module="benchmarks.memory")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(record.read_text())
    cfg = load_config(*parse_overrides(train_args))
    for rank in ranks:
        plan = stage_memory(cfg, rank["pp_rank"])
        for key, estimate in [("param_bytes", plan["params"]), ("grad_bytes", plan["grads"])]:
            assert abs(estimate / rank[key] - 1) <= 0.05, (key, estimate, rank[key])
        assert abs(plan["optimizer"] / rank["optimizer_bytes"] - 1) <= 0.05
        assert plan["pipeline_buffers"] == rank["pipeline_buffer_bytes"], (plan["pipeline_buffers"], rank)
        activations = plan["activations_saved"] + plan["logits_saved"]
        error = activations / rank["activation_bytes"] - 1
        assert abs(error) <= activation_tolerance, (activations, rank["activation_bytes"])
    return ranks, train_losses(out / name)


@pytest.fixture(scope="module")
def one_process(tiny_data, tmp_path_factory) -> tuple[list[dict], list[float]]:
    return measure(tiny_data, tmp_path_factory.mktemp("one"), "one", 1, [])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.dp=2", "--parallelism.zero_stage=2"],
        ["--parallelism.dp=2", "--parallelism.zero_stage=3"],
        # torch's pipeline defers every reduction to the step's end; the split backward reduces per microbatch
        [
            "--parallelism.dp=2",
            "--parallelism.pp=2",
            "--parallelism.pp_engine=zero_bubble",
            "--parallelism.zero_stage=2",
        ],
    ],
    ids=["dp2-zero2", "dp2-zero3", "dp2-pp2-zero_bubble-zero2"],
)
def test_zero_2_and_3_hold_only_gradient_shards_across_eight_microbatches(layout, one_process, tiny_data, tmp_path):
    (reference,), ref_losses = one_process
    nproc = 4 if "--parallelism.pp=2" in layout else 2
    ranks, losses = measure(tiny_data, tmp_path, "run", nproc, layout)
    held = [r["grad_bytes"] for r in ranks]
    print(f"{layout}: gradient bytes held per rank {held} vs one process {reference['grad_bytes']}")
    assert max(held) <= 0.55 * reference["grad_bytes"], (held, reference["grad_bytes"])
    assert len(losses) == len(ref_losses) == 2
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def reduce_scatters_per_step(monkeypatch, zero_stage: int, grad_accum_steps: int) -> list[int]:
    """Gradient reduce-scatters of two steps of the microbatch runner, as rank 0 of dp=2 on the fake process group
    (one process, collectives move nothing: what is counted is which collectives FSDP issues)."""
    overrides = [*TINY_MODEL, "--parallelism.dp=2", f"--parallelism.zero_stage={zero_stage}"]
    overrides += [f"--training.global_batch_size={2 * 2 * grad_accum_steps}", "--logging.activation_stats_interval=0"]
    cfg = load_config(*parse_overrides(["--config", "configs/tiny.toml", *overrides]))
    calls: list[str] = []
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP2's default reduce-scatter calls one
        if hasattr(dist, name):
            original = getattr(dist, name)
            monkeypatch.setattr(dist, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        mesh = build_mesh(cfg, "cpu")
        ctx = ParallelContext(mesh, torch.device("cpu"), 0, cfg.world_size, 0, 0, 0)
        runner = MicrobatchRunner(build_model(cfg, ctx), cfg, ctx)
        t = cfg.training
        batch = torch.randint(0, cfg.model.vocab_size, (grad_accum_steps * t.micro_batch_size, t.seq_len + 1))
        counts = []
        for _ in range(2):
            calls.clear()
            runner.forward_backward(batch)
            counts.append(len(calls))
        return counts
    finally:
        dist.destroy_process_group()


def test_zero_1_reduces_gradients_once_per_step_and_zero_2_after_every_microbatch(monkeypatch):
    """One reduce-scatter per FSDP unit (4 layers + the root) per step at stage 1, whatever the microbatch count;
    stage 2 reduce-scatters after each of the 4 microbatches: stage 1 silently acting as 2 fails here."""
    units = 4 + 1
    assert reduce_scatters_per_step(monkeypatch, zero_stage=1, grad_accum_steps=4) == [units, units]
    assert reduce_scatters_per_step(monkeypatch, zero_stage=2, grad_accum_steps=4) == [4 * units, 4 * units]


@pytest.mark.slow
@pytest.mark.skipif(
    not pipeline_keeps_receive_buffers(), reason="torch >= 2.15 keeps no receive buffers: a received tensor is an input"
)
def test_the_plan_counts_pipeline_boundaries_at_the_sequence_parallel_shard(tiny_data, tmp_path):
    """Under sequence parallelism a stage sends and receives its seq_len / tp part of every microbatch: the plan's
    receive buffers equal those torch allocated (checked exactly in `measure`).

    Its saved activations are loose here: the first stage is planned to hold one more microbatch after a pipelined
    step (measured at pp2 alone), which under tp2 it does not (measured: +46% on the first stage of this model,
    +51% on benchmarks' small model, the last stage -24% / -6%); issue 24's calibration is where that goes."""
    layout = ["--parallelism.pp=2", "--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter"]
    ranks, _ = measure(tiny_data, tmp_path, "run", 4, layout, activation_tolerance=0.5)
    assert all(r["pipeline_buffer_bytes"] > 0 for r in ranks)


@pytest.fixture(scope="module")
def full_recompute(tiny_data, tmp_path_factory) -> tuple[list[dict], list[float]]:
    return measure(tiny_data, tmp_path_factory.mktemp("full"), "full", 1, ["--parallelism.recompute=full"])


def planned_activations(layout: list[str]) -> float:
    cfg = load_config(*parse_overrides([*TINY_MODEL, *EIGHT_MICROBATCHES, *layout]))
    plan = stage_memory(cfg, 0)
    return plan["activations_saved"] + plan["logits_saved"]


@pytest.mark.slow
@pytest.mark.skipif(not POLICY_SEES_OUTPUTS, reason="torch 2.11's checkpoint policy is not shown the outputs it keeps")
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.recompute=selective"],
        ["--parallelism.recompute=selective", "--parallelism.recompute_every=2"],
        ["--parallelism.recompute=selective", "--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter"],
        ["--parallelism.recompute=selective", "--parallelism.selective_matmuls=every_other"],
    ],
    ids=["selective", "selective-every-2", "tp2-sp-selective", "selective-every-other-matmul"],
)
def test_selective_recompute_keeps_activations_between_none_and_full_as_planned(
    layout, one_process, full_recompute, tiny_data, tmp_path
):
    """Selective recompute keeps matmul and attention outputs and reruns the cheap ops: the activations a rank
    holds lie between no recompute and full recompute, the plan's estimate is within 10% of the measurement
    (checked in `measure`; the issue asks 25%) and its saving over no recompute within 3% of the measured one
    (the layers' part, without the few KB outside them that both runs share), and the losses are those of one
    process without recompute."""
    (none,), ref_losses = one_process
    (full,), _ = full_recompute
    nproc = 2 if "--parallelism.tp=2" in layout else 1
    ranks, losses = measure(tiny_data, tmp_path, "run", nproc, layout, activation_tolerance=0.1)
    held = max(r["activation_bytes"] for r in ranks)
    print(f"{layout}: activation bytes {held} vs none {none['activation_bytes']}, full {full['activation_bytes']}")
    assert full["activation_bytes"] < held * nproc < none["activation_bytes"]  # tp ranks hold 1/tp of most
    if nproc == 1:
        saved, planned = none["activation_bytes"] - held, planned_activations([]) - planned_activations(layout)
        assert abs(planned / saved - 1) <= 0.03, (planned, saved)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)


@pytest.mark.slow
def test_the_mtp_block_under_full_recompute_keeps_its_input_only_as_planned(full_recompute, tiny_data, tmp_path):
    """Multi-token prediction's decoder layer is recomputed as the model's layers are: with full recompute a run
    with MTP holds, beyond one without, the module's norms, concatenation and projection and the block's input
    only. The plan counts it so: within 10 % of the measured activations, and the MTP module's share within 10 %
    of the measured one (55.4 KB planned, 57.5 KB measured; with the block kept in full the run held 142 KB against
    the plan's 103 KB)."""
    (full,), _ = full_recompute
    mtp = ["--parallelism.recompute=full", "--model.mtp_depth=1"]
    (ranks,), _ = measure(tiny_data, tmp_path, "mtp", 1, mtp, activation_tolerance=0.1)
    planned = planned_activations(mtp) - planned_activations(["--parallelism.recompute=full"])
    measured = ranks["activation_bytes"] - full["activation_bytes"]
    assert abs(planned / measured - 1) <= 0.1, (planned, measured)


@pytest.mark.slow
def test_the_z_loss_keeps_each_microbatchs_float_logits_as_planned(full_recompute, tiny_data, tmp_path):
    """The z-loss's log-normaliser keeps the float logits for backward: a run with it holds, beyond one without,
    one [tokens, vocab / tp] fp32 tensor per microbatch in flight, and the plan counts it so (within 10 %)."""
    (full,), _ = full_recompute
    z_loss = ["--parallelism.recompute=full", "--training.z_loss=1e-4"]
    (ranks,), _ = measure(tiny_data, tmp_path, "z_loss", 1, z_loss, activation_tolerance=0.1)
    planned = planned_activations(z_loss) - planned_activations(["--parallelism.recompute=full"])
    measured = ranks["activation_bytes"] - full["activation_bytes"]
    print(f"z-loss: planned {planned / 1e3:.1f} KB, measured {measured / 1e3:.1f} KB beyond the run without it")
    assert abs(planned / measured - 1) <= 0.1, (planned, measured)


@pytest.mark.slow
def test_sequence_parallel_keeps_its_gathered_inputs_as_shards_as_planned(one_process, tiny_data, tmp_path):
    """The re-gather in a real 2-process run: the plan, which counts the kept shard, is within 6% of the measured
    activations (+4.6% here, byte counts: deterministic; the benchmarks' small model −0.4%; the exact saving is
    checked on the fake process group below), and the losses are one process's (the re-gathered values are the
    ones the weight gradients need)."""
    _, ref_losses = one_process
    layout = ["--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter", "--parallelism.sp_regather=on"]
    ranks, losses = measure(tiny_data, tmp_path, "run", 2, layout, activation_tolerance=0.06)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)


def saved_activation_bytes(overrides: list[str], regather: str) -> int:
    """Peak saved activations of one step of rank 0 at tp2 on the fake process group (one process; collectives
    move nothing, so values are garbage, but what autograd keeps is real), measured by the benchmarks' probe."""
    from benchmarks.probe import StepProbe

    args = ["--config", "configs/tiny.toml", *TINY_MODEL, *overrides, f"--parallelism.sp_regather={regather}"]
    cfg = load_config(*parse_overrides(args))
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        ctx = ParallelContext(build_mesh(cfg, "cpu"), torch.device("cpu"), 0, cfg.world_size, 0, 0, 0)
        runner = MicrobatchRunner(build_model(cfg, ctx), cfg, ctx)
        t = cfg.training
        batch = torch.randint(0, cfg.model.vocab_size, (t.grad_accum_steps * t.micro_batch_size, t.seq_len + 1))
        with StepProbe(runner.modules, functools.partial(recompute_mode, cfg)).active() as probe:
            runner.forward_backward(batch)
        return probe.activation_peak, cfg
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_keeps_shards_of_gathered_inputs_and_the_plan_counts_them():
    """With parallelism.sp_regather on, the attention and MLP blocks keep the rank's shard of the gathered norm
    output (and gather it again in backward): per layer and token 2 x hidden x (1 - 1/tp) elements fewer than
    keeping the gathered copy (off), measured exactly, and the plan's estimate moves by the same bytes."""
    layout = ["--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter", "--logging.activation_stats_interval=0"]
    kept, cfg = saved_activation_bytes(layout, "on")
    gathered, off = saved_activation_bytes(layout, "off")
    m, t = cfg.model, cfg.training
    tokens = t.micro_batch_size * t.seq_len
    assert gathered - kept == m.num_layers * tokens * 2 * m.hidden_size * (1 - 1 / 2) * 4, (gathered, kept)
    planned = stage_memory(off, 0)["activations_saved"] - stage_memory(cfg, 0)["activations_saved"]
    assert planned == gathered - kept


@pytest.mark.parametrize("peer", [True, False], ids=["a peer resolved it on", "every peer resolved it off"])
def test_ranks_that_resolved_sp_regather_differently_all_build_it_on(monkeypatch, capsys, peer):
    """`auto` is resolved by each rank from its own device's memory: a rank that resolved it off builds it on when
    a peer needs it (a TP group split between the two would hang in backward), and says so on rank 0."""
    from nanotron.parallel.regather import agree_on_regather, regathers

    def all_reduce(tensor, op, group=None):  # this rank and one peer, reduced with the op asked for
        assert op == dist.ReduceOp.MAX  # on wins
        tensor.copy_(torch.maximum(tensor, torch.tensor([int(peer)])))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    layout = ["--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter", "--parallelism.sp_regather=off"]
    mine = load_config(*parse_overrides([*TINY_MODEL, *layout]), world_size=2)
    agreed = agree_on_regather(mine, torch.device("cpu"))
    assert regathers(agreed) is peer
    said = capsys.readouterr().out
    assert ("parallelism.sp_regather: on for every rank, not off: another rank's plan needs it" in said) is peer


@pytest.mark.parametrize(
    "overrides, wrapped",
    [
        ([], False),  # one fp32 rank: nothing to shard, reduce or cast
        (["--parallelism.tp=2"], False),  # dp = 1 beside tp
        (["--parallelism.pp=2"], False),
        (["--training.dtype=bfloat16"], True),  # FSDP's mixed precision is bf16's mechanism, dp = 1 too
        (["--parallelism.dp=2"], True),
        (["--parallelism.dp=2", "--parallelism.zero_stage=0"], True),  # replicate: the gradient all-reduce
        (["--parallelism.cp=2"], True),  # cp ranks shard the parameters with dp
    ],
)
def test_fsdp_wraps_the_model_only_where_it_has_work(overrides, wrapped):
    """FSDP's per-layer hooks and parameter copies cost ~6 % of a small CPU step at dp = 1 in fp32, where they
    do nothing: every rank of such a layout holds plain modules; bf16 or dp > 1 keeps them. The plan charges one
    layer's gradient-reduction buffers (its unsharded gradient and reduce-scatter input) exactly where they exist."""
    from torch.distributed.fsdp import FSDPModule

    cfg = load_config(*parse_overrides(["--config", "configs/tiny.toml", *TINY_MODEL, *overrides]))
    largest, tokens = rank_weights(cfg, rank_stages(cfg, 0)).largest_layer, micro_tokens(cfg)
    reduction = communication_buffer_bytes(cfg, tokens, largest, 0) - communication_buffer_bytes(cfg, tokens, 0, 0)
    assert reduction == (largest * (4 + element_bytes(cfg.training.dtype)) if wrapped else 0)
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        ctx = ParallelContext(build_mesh(cfg, "cpu"), torch.device("cpu"), 0, cfg.world_size, 0, 0, 0)
        modules = [module for _, stage in build_model(cfg, ctx) for module in stage.modules()]
        assert any(isinstance(m, FSDPModule) for m in modules) == wrapped
    finally:
        dist.destroy_process_group()
