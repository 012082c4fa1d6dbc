"""Same math at any layout: every (dp, tp, pp) run of the dense family reproduces its 1-process run (tests/matrix.py:
losses, evaluation losses and scores, gradient norms, activation statistics and final weights), starting from the
same initial weights."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import TINY_MODEL, run_train, train_losses
from matrix import (
    COMPILE,
    DENSE,
    FLOAT8,
    FLOAT8_ROWWISE,
    MLA,
    MTP,
    MUON,
    NOPE_Z_LOSS,
    QWEN3,
    QWEN3_MOE,
    RTOL,
    Layout,
    assert_matches,
    dense_family,
    relative_difference,
    weights,
)
from matrix import config as matrix_config

from nanotron.config import load_config, parse_overrides
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.parametrization import param_init_std
from nanotron.parallel.fsdp import GradientSync
from nanotron.parallel.init import init_weights
from nanotron.parallel.mesh import destroy_distributed, init_distributed
from nanotron.parallel.pipeline import build_schedule, split_layers, split_model
from nanotron.parallel.runner import microbatch_loss

# Every tp_mode, pp_engine, zero stage, HSDP, and recompute none/selective, keeping all matmul outputs or every
# other one (full in the cp, ep and µP matrices); sequence parallelism's norm outputs kept gathered (sp_regather
# off, auto's choice on CPU) and kept as shards, re-gathered in backward (on: here with pp and FSDP, and in the cp
# matrix with ring attention).
LAYOUTS = [
    Layout(dp=2),
    Layout(dp=2, flags=("--parallelism.zero_stage=3",)),
    Layout(dp=4, flags=("--parallelism.dp_shard=2", "--parallelism.zero_stage=3")),
    Layout(dp=2, pp=2, flags=("--parallelism.pp_engine=zero_bubble", "--parallelism.zero_stage=2")),
    Layout(tp=2, flags=("--parallelism.tp_mode=reduce_scatter",)),  # sp_regather auto: off on CPU
    Layout(tp=2, flags=("--parallelism.tp_mode=all_reduce",)),
    Layout(pp=2, flags=("--parallelism.pp_engine=1f1b",)),
    Layout(dp=2, tp=2, flags=("--parallelism.zero_stage=3", "--parallelism.recompute=selective")),  # sequence parallel
    Layout(dp=2, pp=2, flags=("--parallelism.pp_engine=afab", "--parallelism.zero_stage=1")),
    Layout(
        tp=2,
        pp=2,
        flags=(
            "--parallelism.pp_engine=interleaved_1f1b",
            "--parallelism.recompute=selective",
            "--parallelism.selective_matmuls=every_other",  # torchtitan's op-level policy
            "--parallelism.recompute_every=2",
            "--parallelism.tp_mode=all_reduce",
        ),
    ),
    Layout(pp=2, flags=("--parallelism.pp_engine=zero_bubble",)),
    Layout(pp=2, flags=("--parallelism.pp_engine=zbv",)),
    Layout(dp=2, tp=2, pp=2, flags=("--parallelism.zero_stage=3", "--parallelism.sp_regather=on")),
    Layout(pp=4, flags=("--parallelism.pp_engine=1f1b",)),
    Layout(dp=2, cp=2, tp=2, flags=("--parallelism.dp_shard=1", "--parallelism.zero_stage=2")),  # causal CP, HSDP
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layout_matches_one_process(layout, references, tiny_data, tmp_path):
    family = dense_family(layout)
    ref = references[family]
    run = family.run(tiny_data, tmp_path, "run", layout)
    layers = matrix_config(family.flags).model.num_layers
    assert len(ref.series("eval_loss")) == 2 and len(ref.items) == 25  # steps 0 and 5; 7 items of 3 and 4 choices
    assert sorted(ref.stats) == [2, 4] and len(ref.stats[2]) == 1 + 3 * layers + 2  # embed, layers x 3, norm, logits
    print(f"{family.name} {layout}: {assert_matches(run, ref, family)}")


# The other families, each at the layouts where its own parameters see shards, held to its own 1-process run.
# Qwen3's QK-norm under TP: each rank normalises its own heads with the one replicated weight, whose gradient is
# summed over the tp ranks; with sequence parallelism and ring attention (RoPE on each rank's chunks after the
# norm), and with plain TP and FSDP (the norm's weight a tp-replicated DTensor beside plain norm weights).
# Multi-head latent attention: heads split over tp with the latents' down-projections replicated and the shared RoPE
# key's gradient summed over tp (sequence parallel: the gathered input reaches them as a plain tensor); FSDP ZeRO-3
# over its replicated and per-head weights; the cp ring carrying keys and narrower values (expanded, not the latent).
# Multi-token prediction (depth 1, on MLA + MoE): its module on the last pipeline stage with the MTP tokens'
# embeddings carried beside the hidden states (the embedding's gradient flowing back through the pipeline), its
# norms and projection per sequence shard under sequence parallelism, its MoE block's experts split over ep with
# FSDP ZeRO-3 and recomputed in full as the model's layers are, and under cp the shifted tokens taken from the
# whole sequence before it is split (a token's t+1 may be in another rank's chunk).
# NoPE layers and the z-loss: the log-normaliser of vocab-sharded logits (its maximum and sum all-reduced over tp)
# with sequence parallelism and ring attention (the NoPE layers ignore the cp ranks' positions), and on the last
# stage of a pipeline over plain TP.
# Float8 (emulated): FSDP's float8 all-gather (ZeRO-3: re-gathered in backward with the precomputed scale),
# sequence-parallel TP with selective recompute, the pipeline; rowwise scales under TP (per-row amaxes of
# tp-sharded rows and columns).
FAMILY_LAYOUTS = [
    (QWEN3, Layout(cp=2, tp=2, flags=("--parallelism.tp_mode=reduce_scatter",))),
    (QWEN3, Layout(dp=2, tp=2, flags=("--parallelism.tp_mode=all_reduce", "--parallelism.zero_stage=3"))),
    (QWEN3_MOE, Layout(dp=2, pp=2, ep=2, flags=("--parallelism.pp_engine=1f1b", "--parallelism.zero_stage=1"))),
    (MLA, Layout(tp=2, flags=("--parallelism.tp_mode=reduce_scatter",))),
    (MLA, Layout(dp=2, flags=("--parallelism.zero_stage=3",))),
    (MLA, Layout(cp=2)),
    (MTP, Layout(tp=2, flags=("--parallelism.tp_mode=reduce_scatter",))),
    (MTP, Layout(pp=2, flags=("--parallelism.pp_engine=1f1b",))),
    (MTP, Layout(dp=2, ep=2, flags=("--parallelism.zero_stage=3", "--parallelism.recompute=full"))),
    (MTP, Layout(cp=2)),
    (NOPE_Z_LOSS, Layout(cp=2, tp=2, flags=("--parallelism.tp_mode=reduce_scatter",))),
    (NOPE_Z_LOSS, Layout(tp=2, pp=2, flags=("--parallelism.pp_engine=1f1b", "--parallelism.tp_mode=all_reduce"))),
    (FLOAT8, Layout(dp=2, flags=("--parallelism.zero_stage=3",))),
    (FLOAT8, Layout(tp=2, flags=("--parallelism.tp_mode=reduce_scatter", "--parallelism.recompute=selective"))),
    (FLOAT8, Layout(pp=2, flags=("--parallelism.pp_engine=1f1b",))),
    (FLOAT8_ROWWISE, Layout(dp=2, tp=2, flags=("--parallelism.zero_stage=2",))),
]
# the family is itself (MTP: its module's projection and its MoE block's experts)
OWN_WEIGHT = {
    QWEN3.name: "self_attn.k_norm.weight",
    QWEN3_MOE.name: "mlp.experts.down_proj",
    MLA.name: "self_attn.kv_b_proj.weight",
    MTP.name: "mtp.0.block.mlp.experts.down_proj",
}
LOGGED = {MTP.name: "mtp_loss", NOPE_Z_LOSS.name: "z_loss"}  # logged every step beside the loss


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", FAMILY_LAYOUTS, ids=lambda x: x.name if hasattr(x, "name") else str(x))
def test_family_layout_matches_its_one_process_run(family, layout, references, tiny_data, tmp_path):
    ref = references[family]
    run = family.run(tiny_data, tmp_path, "run", layout)
    if family.name in OWN_WEIGHT:
        assert any(name.endswith(OWN_WEIGHT[family.name]) for name in ref.weights)
    if family.name in LOGGED:  # logged every step, held to the reference too
        assert len(ref.series(LOGGED[family.name])) == family.steps
    print(f"{family.name} {layout}: {assert_matches(run, ref, family)}")


# torch.compile (inductor) under TP, where the vocab-parallel embedding's output (an AsyncCollectiveTensor)
# enters the first compiled layer: unwaited, the embedding got no gradient (plain TP: losses off by 8e-3 after 5
# steps; sequence parallel: the run fails), and FSDP's hooks and bf16 casts traced into the compiled layers.
# fp32 runs are held to the eager 1-process reference (equal to their eager twins within RTOL, above), bf16
# to its eager twin. (loss, all-weights) relative tolerances, ~4x the measured compiled-vs-eager gaps: fp32
# 1.5e-7 and 2.9e-7; bf16 2.3e-5 to 1.1e-4 and 2.3e-3 to 2.5e-3 (inductor fuses bf16 ops without the intermediate
# roundings: the same gap with or without TP). Compile is most of a run here (inductor per rank, ~45 s for two
# ranks on 2 cores, ~110 s for four): two 2-rank rows, sequence-parallel TP with pipelining and selective recompute
# (its policy applied inside the compiled layers), and FSDP ZeRO-3 in bf16 (plain TP, dp x tp and every other
# dimension are the eager matrix's; gpu_check compiles on the GPU).
COMPILED_LAYOUTS = [
    Layout(tp=2, pp=2, flags=("--parallelism.tp_mode=reduce_scatter", "--parallelism.recompute=selective")),
    Layout(dp=2, flags=("--training.dtype=bfloat16", "--parallelism.zero_stage=3")),
]
COMPILE_RTOL = {"float32": (RTOL, RTOL), "bfloat16": (2e-4, 1e-2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", COMPILED_LAYOUTS, ids=str)
def test_compiled_layout_matches_its_eager_twin(layout, references, tiny_data, tmp_path):
    family = dense_family(layout)
    compiled = family.run(tiny_data, tmp_path, "compiled", layout, COMPILE)
    dtype = "bfloat16" if "--training.dtype=bfloat16" in layout.flags else "float32"
    ref = references[family] if dtype == "float32" else family.run(tiny_data, tmp_path, "eager", layout)
    losses, ref_losses = compiled.losses + compiled.series("eval_loss"), ref.losses + ref.series("eval_loss")
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    weight_diff = relative_difference(compiled.weights, ref.weights)
    print(f"{layout} compiled vs eager: losses {loss_diff:.2e}, weights {weight_diff:.2e}")
    assert len(compiled.losses) == family.steps and len(compiled.series("eval_loss")) == 2
    loss_rtol, weight_rtol = COMPILE_RTOL[dtype]
    assert loss_diff <= loss_rtol, (losses, ref_losses)
    assert weight_diff <= weight_rtol


# µP at 4x the width and 4x the depth of its base: hidden matrices 1/sqrt(4) of init_std, residual outputs
# also 1/sqrt(2 * base depth) instead of 1/sqrt(2 * num_layers).
INIT_PARAMETRIZATIONS = {
    "standard": [],
    "mup": [
        "--model.parametrization=mup",
        "--model.mup_base.hidden=8",
        "--model.mup_base.heads=4",
        "--model.mup_base.intermediate=16",
        "--model.mup_base.layers=1",
    ],
}


@pytest.mark.slow
def test_initial_weights_equal_one_process_init_at_dp2_tp2_pp2(tiny_data, tmp_path):
    """Each rank draws its shards of the same full tensors: the step-0 checkpoint of a 3D layout equals the
    1-process init bit for bit. Under µP, whose init std differs per parameter (the sharding is the same)."""
    parametrization = INIT_PARAMETRIZATIONS["mup"]
    layout = Layout(dp=2, tp=2, pp=2, flags=("--parallelism.zero_stage=3",))
    args = ["--training.steps=1", "--checkpoint.save_initial_state=true", "--checkpoint.save_final=false"]
    run_dir = DENSE.train(tiny_data, tmp_path, "init", layout, *args, *parametrization)
    sharded = weights(run_dir, step=0)
    cfg = load_config(*parse_overrides([*TINY_MODEL, *tiny_data.overrides(), *parametrization]))
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    assert sharded.keys() == model.state_dict().keys()
    for name, expected in model.state_dict().items():
        assert torch.equal(sharded[name], expected), name


@pytest.mark.parametrize("parametrization", INIT_PARAMETRIZATIONS.values(), ids=INIT_PARAMETRIZATIONS.keys())
def test_initial_weights_follow_the_configured_std(parametrization):
    """Every tensor has mean 0 and the std `param_init_std` gives it (norms: exactly 1)."""
    cfg = load_config(*parse_overrides([*TINY_MODEL, *parametrization]))
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    for name, expected in model.state_dict().items():
        std = param_init_std(cfg.model, name)
        if std is None:
            assert torch.all(expected == 1.0), name
            continue
        n = expected.numel()  # sampling error: std of the mean ~ std/sqrt(n), of the std ~ std/sqrt(2n)
        assert abs(expected.mean().item()) < 5 * std / n**0.5, name
        assert abs(expected.std().item() / std - 1) < 5 / (2 * n) ** 0.5, name
    m, init_std = cfg.model, cfg.model.init_std
    width = 4 if m.parametrization == "mup" else 1  # hidden_size / mup_base.hidden
    depth = 1 if m.parametrization == "mup" else m.num_layers  # the depth the residual-output init is scaled for
    assert param_init_std(m, "model.layers.0.mlp.down_proj.weight") == pytest.approx(
        init_std / (2 * depth) ** 0.5 / width**0.5
    )
    assert param_init_std(m, "model.layers.2.self_attn.k_proj.weight") == pytest.approx(init_std / width**0.5)
    assert param_init_std(m, "model.embed_tokens.weight") == param_init_std(m, "lm_head.weight") == init_std


def test_first_pipeline_step_runs_each_stage_once_per_microbatch():
    """Static stage shapes: step 1 runs no extra metadata forward+backward on placeholder tensors. Two
    interleaved stages on one rank (a world of one) exercise the same PipelineStage path as pp ranks."""
    args = ["--config", "configs/tiny.toml", *TINY_MODEL, "--parallelism.pp_engine=interleaved_1f1b"]
    cfg = load_config(*parse_overrides(args))
    ctx = init_distributed(cfg)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg.model)
        stages = split_model(model, cfg, pp_rank=0)
        calls = {index: 0 for index, _ in stages}
        for index, module in stages:
            module.to_empty(device="cpu")
            init_weights(module, cfg.job.seed)
            module.register_forward_pre_hook(lambda m, a, index=index: calls.__setitem__(index, calls[index] + 1))
        schedule = build_schedule(stages, cfg, ctx.mesh, ctx.device, microbatch_loss, GradientSync(0))
        batch = torch.randint(0, cfg.model.vocab_size, (cfg.training.global_batch_size, cfg.training.seq_len + 1))
        losses: list[torch.Tensor] = []
        schedule.step(batch[:, :-1].contiguous(), target=batch[:, 1:], losses=losses)  # as the runner feeds it
        assert len(losses) == cfg.training.grad_accum_steps == 4
        assert calls == {0: 4, 1: 4}
    finally:
        destroy_distributed()


def test_stage_split_balances_cost_and_gives_every_stage_a_layer():
    # Cheap layers, costly head: the last stage gets fewer layers; every stage keeps at least one.
    ranges = split_layers(8, 2, costs=(0.0, 1.0, 3.0))
    assert [len(r) for r in ranges] == [5, 3]
    assert [len(r) for r in split_layers(8, 4, costs=(0.0, 1.0, 0.0))] == [2, 2, 2, 2]
    assert [len(r) for r in split_layers(4, 4, costs=(5.0, 1.0, 5.0))] == [1, 1, 1, 1]
    uneven = split_layers(7, 3, costs=(1.0, 1.0, 1.0))
    assert sum(len(r) for r in uneven) == 7 and max(len(r) for r in uneven) - min(len(r) for r in uneven) <= 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, nproc, expected",
    [
        (["--parallelism.dp=3"], 8, "dp*cp*tp*pp = 3*1*1*1 = 3 but 8 processes"),
        (
            ["--parallelism.cp=2", "--training.seq_len=102"],
            2,
            "training.seq_len=102 must be divisible by 2*parallelism.cp = 4",
        ),
        (["--parallelism.tp=3", "--model.num_kv_heads=4", "--model.num_heads=4"], 3, "parallelism.tp=3 must divide"),
        (["--parallelism.pp=4", "--model.num_layers=2"], 4, "model.num_layers=2 is too few for 4 pipeline stages"),
    ],
)
def test_impossible_layouts_fail_with_one_line_before_spawning(overrides, nproc, expected, tiny_data, tmp_path):
    proc = run_train(
        [
            "--nproc_per_node",
            str(nproc),
            "--config",
            "configs/tiny.toml",
            "--training.steps=5",
            *tiny_data.overrides(),
            f"--job.out_dir={tmp_path}",
            *overrides,
        ],
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


@pytest.mark.slow
def test_resume_reshards_between_one_process_hsdp_and_fsdp(tiny_data, tmp_path):
    """One process saves, HSDP (2 replicas x 2 shards) resumes and saves, FSDP over dp=2 resumes: the losses
    are the uninterrupted run's, so model, optimizer state and data position reshard both ways."""
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--checkpoint.save_final=true"]
    common.append("--optimizer.decay_steps=4")  # the LR schedule no longer depends on each leg's training.steps
    run_train([*common, "--job.name=reference", "--training.steps=6"])
    legs = [  # (name, processes, layout, steps at the end of the leg)
        ("one", 1, [], 2),
        ("hsdp", 4, ["--parallelism.dp=4", "--parallelism.dp_shard=2", "--parallelism.zero_stage=2"], 4),
        ("fsdp", 2, ["--parallelism.dp=2", "--parallelism.zero_stage=3"], 6),
    ]
    losses, previous = [], None
    for name, nproc, layout, steps in legs:
        resume = [f"--checkpoint.resume_from={previous}"] if previous else []
        run_train([*common, f"--job.name={name}", f"--training.steps={steps}", *layout, *resume], nproc=nproc)
        losses += train_losses(tmp_path / name)
        previous = tmp_path / name / "checkpoints" / f"step-{steps}"
    reference = train_losses(tmp_path / "reference")
    assert len(losses) == len(reference) == 6
    assert losses == pytest.approx(reference, rel=RTOL, abs=0), (losses, reference)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"dp": "4", "dp_shard": "3", "zero_stage": "3"}, "parallelism.dp_shard=3 must divide parallelism.dp=4"),
        ({"dp": "4", "dp_shard": "2", "zero_stage": "0"}, "set parallelism.zero_stage >= 1 for HSDP"),
        ({"pp": "2", "pp_engine": "zbv", "zero_stage": "3"}, "zero_stage=3 with pp_engine='zbv' computes wrong"),
        (  # torch 2.13's split backward recomputes a checkpointed layer twice and its context manager breaks
            {"pp": "2", "pp_engine": "zero_bubble", "recompute": "full"},
            "parallelism.recompute='full' with pp_engine='zero_bubble' is not supported",
        ),
        (
            {"pp": "2", "pp_engine": "zbv", "recompute": "selective"},
            "parallelism.recompute='selective' with pp_engine='zbv' is not supported",
        ),
        ({"recompute": "some"}, "parallelism.recompute: expected one of 'none', 'selective', 'full', got 'some'"),
        ({"recompute_every": "0"}, "parallelism.recompute_every: expected a value >= 1, got 0"),
    ],
)
def test_hsdp_zero_stage_and_recompute_misconfigurations_name_the_key(overrides, expected):
    from nanotron.errors import ConfigError

    pairs = [(f"parallelism.{k}", v) for k, v in overrides.items()] + [("training.grad_accum_steps", "4")]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("configs/tiny.toml", pairs)


def test_recompute_every_picks_layers():
    """recompute_every=k applies the mode to layers 0, k, 2k, ..."""
    every_third = [("parallelism.recompute", "selective"), ("parallelism.recompute_every", "3")]
    cfg = load_config("configs/tiny.toml", every_third)
    assert [cfg.parallelism.recompute_of(i) for i in range(4)] == ["selective", "none", "none", "selective"]


# Muon's whole-matrix updates at layouts whose shards differ. FSDP (zero 3: row shards) under the pipeline (each
# stage its own plan and exchange), all 3 steps; then the reference's step-2 checkpoint resumed with TP's colwise
# and rowwise shards, FSDP's strided row shards on top and the experts split over ep (FSDP over edp), so the
# momentum is resharded and its step-3 update made from those shards. Measured: weights within 5e-8 of one process.
@pytest.mark.slow
def test_muon_layout_matches_one_process(references, tiny_data, tmp_path):
    ref = references[MUON]
    layout = Layout(dp=2, pp=2, flags=("--parallelism.zero_stage=3",))
    run = MUON.run(tiny_data, tmp_path, "run", layout)
    print(f"muon {layout}: {assert_matches(run, ref, MUON)}")


# A family's reference checkpoint at step 2 resumed at another layout (its parameters and optimizer state
# resharded) trains on to the reference's losses and weights. Muon: TP's colwise and rowwise shards, FSDP's strided
# row shards on top and the experts split over ep (FSDP over edp), so the momentum is resharded and its step-3
# update made from those shards (measured: weights within 5e-8 of one process). Qwen3-MoE: QK-norm's weights
# replicated over tp, experts over ep, ZeRO-3. MTP: MLA's latents and the MTP module's block at tp x dp.
FAMILY_RESUMES = [
    (MUON, Layout(dp=2, tp=2, ep=2, flags=("--parallelism.zero_stage=2",))),
    (QWEN3_MOE, Layout(dp=2, tp=2, ep=2, flags=("--parallelism.zero_stage=3",))),
    (MTP, Layout(dp=2, tp=2, flags=("--parallelism.zero_stage=2", "--parallelism.tp_mode=reduce_scatter"))),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", FAMILY_RESUMES, ids=lambda x: x.name if hasattr(x, "name") else str(x))
def test_family_resumed_at_another_layout_matches_its_one_process_run(family, layout, references, tiny_data, tmp_path):
    ref = references[family]
    step2 = ref.dir / "checkpoints" / "step-2"
    resumed = family.run(tiny_data, tmp_path, "resumed", layout, f"--checkpoint.resume_from={step2}")
    assert len(resumed.losses) == family.steps - 2
    assert resumed.losses == pytest.approx(ref.losses[2:], rel=RTOL, abs=0)
    if family is MTP:
        assert resumed.series("mtp_loss") == pytest.approx(ref.series("mtp_loss")[2:], rel=RTOL, abs=0)
    difference = relative_difference(resumed.weights, ref.weights)
    print(f"{family.name} resumed at {layout}: weights rel diff {difference:.2e}")
    assert difference <= RTOL
