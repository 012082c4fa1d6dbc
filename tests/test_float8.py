"""Float8 training (`training.float8`, torchao): which linears convert, the one-line refusals, a 1-process emulated
run and its start-up line, and checkpoints that stay ordinary (resumed with float8 off at another layout). The
layout matrix's float8 rows are in test_parallel.py."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import TINY_MODEL, TINY_MUP, run_train, train_losses
from matrix import FLOAT8_MODEL, MLA_MODEL, RTOL, weights
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.float8 import (
    Float8Plan,
    check_float8,
    convert_to_float8,
    describe_float8,
    precompute_float8_scales,
)
from nanotron.parallel.mesh import destroy_distributed, init_distributed
from nanotron.parallel.parallelize import build_model

LAYER_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE = ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.num_shared_experts=1"]


# FSDP (zero 1) with float8 all-gather in one process: in bf16, as one fp32 process is not wrapped in FSDP at all
# (`nanotron.config.parallelism.fsdp_wraps`).
FSDP_FLOAT8_ONE_PROCESS = ("--training.float8=tensorwise", "--parallelism.zero_stage=1", "--training.dtype=bfloat16")


def config(*overrides: str):
    return load_config(*parse_overrides(["--config", "configs/tiny.toml", *TINY_MODEL, *overrides]))


def test_decoder_layer_linears_convert_and_the_embedding_head_and_routers_stay():
    cfg = config("--training.float8=tensorwise", *MOE, "--model.moe.first_dense_layers=1")
    model = LlamaForCausalLM(cfg.model)
    convert_to_float8(model, cfg, torch.device("cpu"))
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    dense = [f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for p in LAYER_LINEARS]
    shared = [f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2, 3) for p in LAYER_LINEARS[4:]]
    attention = [f"model.layers.{i}.self_attn.{p}" for i in (1, 2, 3) for p in LAYER_LINEARS[:4]]
    assert converted == sorted(dense + shared + attention)
    assert all(m.config.emulate for m in model.modules() if isinstance(m, Float8Linear))  # no float8 matmul on CPU
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert not any(isinstance(m, Float8Linear) for m in model.model.layers["1"].mlp.gate.modules())  # the router
    assert set(model.state_dict()) == set(LlamaForCausalLM(cfg.model).state_dict())  # checkpoint names unchanged


def test_a_linear_whose_dimensions_float8_kernels_cannot_take_stays_and_is_listed():
    cfg = config("--training.float8=rowwise", "--model.intermediate_size=40")
    plan = Float8Plan.of(LlamaForCausalLM(cfg.model))
    assert len(plan.converted) == 4 * 4 and not any(".mlp." in name for name in plan.converted)
    assert "lm_head" in plan.kept and "model.layers.3.mlp.down_proj" in plan.kept
    line = describe_float8(cfg, torch.device("cpu"))
    assert line.startswith("float8: rowwise scaling, emulated (cpu has no float8 matmul")
    assert "16 decoder-layer linears converted" in line and "model.layers.*.mlp.gate_proj" in line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--training.float8=e4m3"], "training.float8: expected one of 'off', 'tensorwise', 'rowwise', 'mxfp8', got"),
        (["--training.float8=mxfp8"], "training.float8='mxfp8' is not supported yet"),
        (  # measured: the 1-process float8 losses off by 2.6e-4 (relative) at step 2 under cp=2
            ["--training.float8=rowwise", "--parallelism.cp=2"],
            "training.float8='rowwise' with parallelism.cp=2 is not supported yet: each cp rank would scale",
        ),
        (
            ["--training.float8=tensorwise", "--training.seq_len=12", "--training.micro_batch_size=1"],
            "training.float8='tensorwise' needs micro_batch_size * seq_len / cp = 12 tokens per microbatch",
        ),
    ],
)
def test_a_bad_float8_setting_is_one_line_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)) as error:
        config(*overrides)
    assert "\n" not in str(error.value)


def test_a_tp_shard_float8_kernels_cannot_take_is_refused_not_left_unconverted():
    """At tp=2 TINY_MODEL's k_proj ([16, 32]) would keep 8 rows per rank: converting it at tp=1 only would change
    the numbers with the layout."""
    with pytest.raises(ConfigError, match=re.escape("with parallelism.tp=2: model.layers.0.self_attn.k_proj would")):
        check_float8(config("--training.float8=tensorwise", "--parallelism.tp=2"), torch.device("cpu"))
    check_float8(config("--training.float8=tensorwise", "--parallelism.tp=2", *FLOAT8_MODEL), torch.device("cpu"))
    with pytest.raises(ConfigError, match=re.escape("emulation is eager-only; set training.compile=false")):
        check_float8(config("--training.float8=rowwise", "--training.compile=true"), torch.device("cpu"))


@pytest.mark.slow
def test_one_process_float8_run_trains_and_says_it_is_emulated(tiny_data, tmp_path):
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=f8", "--training.steps=8"]
    proc = run_train([*args, "--training.float8=tensorwise"])
    lines = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if " float8: " in line]
    assert len(lines) == 1 and "tensorwise scaling, emulated (cpu has no float8 matmul" in lines[0], lines
    assert "28 decoder-layer linears converted" in lines[0] and "kept in float32: lm_head, the embedding" in lines[0]
    losses = train_losses(tmp_path / "f8")
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_a_float8_checkpoint_is_ordinary_and_resumes_with_or_without_float8_at_another_layout(tiny_data, tmp_path):
    """Saved by dp2 ZeRO-3 with float8 all-gather (torchao's weight subclass inside FSDP's DTensor, and optimizer
    moments created like it), the checkpoint holds plain fp32 tensors under the usual names, loadable where torchao
    is not imported; resumed with float8 off in one process it continues as the 1-process float8 run's checkpoint
    does. And the 1-process checkpoint resumed with float8 at dp2 ZeRO-3 (loaded into the float8 weights, scales
    precomputed from the loaded values) continues as the uninterrupted 1-process run."""
    common = [*TINY_MODEL, *FLOAT8_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}"]
    common += ["--checkpoint.save_final=true", "--optimizer.decay_steps=4", "--checkpoint.interval=2"]
    float8, fsdp = [*common, "--training.float8=tensorwise"], ["--parallelism.dp=2", "--parallelism.zero_stage=3"]
    run_train([*float8, "--job.name=one", "--training.steps=4"])
    run_train([*float8, "--job.name=fsdp", "--training.steps=2", *fsdp], nproc=2)
    files = [f for f in (tmp_path / "fsdp" / "checkpoints" / "step-2").rglob("*") if f.is_file()]
    assert files and not [f.name for f in files if b"torchao" in f.read_bytes()]  # no pickled torchao subclass
    saved = weights(tmp_path / "fsdp", step=2)
    plain = LlamaForCausalLM(config(*FLOAT8_MODEL).model).state_dict()
    assert saved.keys() == plain.keys()
    for name, tensor in saved.items():
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32 and tensor.shape == plain[name].shape
    legs = {  # name: (resumed run, float8 or not, layout, processes)
        "fsdp-off": ("fsdp", common, [], 1),
        "one-off": ("one", common, [], 1),
        "one-fsdp": ("one", float8, fsdp, 2),
    }
    losses = {}
    for name, (source, flags, layout, nproc) in legs.items():
        resume = f"--checkpoint.resume_from={tmp_path / source / 'checkpoints' / 'step-2'}"
        run_train([*flags, f"--job.name={name}", "--training.steps=4", resume, *layout], nproc=nproc)
        losses[name] = train_losses(tmp_path / name)
    assert len(losses["one-off"]) == 2
    assert losses["fsdp-off"] == pytest.approx(losses["one-off"], rel=RTOL, abs=0)
    assert losses["one-fsdp"] == pytest.approx(train_losses(tmp_path / "one")[2:], rel=RTOL, abs=0)


def test_fsdp_float8_scales_are_precomputed_from_the_current_weights():
    """One process, FSDP (zero 1) with float8 all-gather: after `precompute_float8_scales` each converted weight
    carries torchao's tensorwise scale of its current values (e4m3's max / amax), which the next all-gather uses.
    In bf16: one fp32 process is not wrapped in FSDP at all (`nanotron.config.parallelism.fsdp_wraps`)."""
    cfg = config(*FSDP_FLOAT8_ONE_PROCESS)
    ctx = init_distributed(cfg)
    try:
        (_, model), *_ = build_model(cfg, ctx)
        with torch.no_grad():
            model.model.layers["0"].mlp.up_proj.weight.mul_(3.0)  # as an optimizer step would change it
        precompute_float8_scales([model])
        scales = current_scales([model])
        assert len(scales) == 28 and not stale(scales), scales
    finally:
        destroy_distributed()


def test_the_trainer_refreshes_the_float8_scales_after_every_optimizer_step(tiny_data, tmp_path):
    """FSDP gathers a float8 weight with the scale precomputed when the weights last changed: after every optimizer
    step, not once. At each step's end every converted weight's scale is the one of its current values. (A stale
    scale moves a layout's losses from step 3 on by ~1e-4, within the layout matrix's flip bounds: held here.)"""
    from nanotron.trainer import Trainer

    overrides = [*TINY_MODEL, *FLOAT8_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=3"]
    cfg = load_config(*parse_overrides([*overrides, *FSDP_FLOAT8_ONE_PROCESS]))
    trainer = Trainer(cfg)
    seen: list[tuple[int, list[str]]] = []
    train_step = trainer.train_step

    def checked_step():
        result = train_step()
        scales = current_scales(trainer.modules)
        seen.append((len(scales), stale(scales)))
        return result

    trainer.train_step = checked_step
    try:
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    assert seen == [(28, [])] * 3, seen


def current_scales(modules: list[nn.Module]) -> list[tuple[str, float, float]]:
    """(name, precomputed scale, torchao's tensorwise scale of the current values: e4m3's max / amax) of every
    converted weight of these FSDP-wrapped modules (one process: the local shard is the whole weight)."""
    scales = []
    for module in modules:
        for name, linear in module.named_modules():
            if isinstance(linear, Float8Linear):
                local = linear.weight._local_tensor  # to_local() would hand back a fresh wrapper without the scale
                expected = torch.finfo(torch.float8_e4m3fn).max / local._tensor.abs().max().double()
                scale = local._precomputed_scale  # None: never precomputed (the all-gather computes its own)
                scales.append((name, None if scale is None else scale.item(), expected.item()))
    return scales


def stale(scales: list[tuple[str, float | None, float]]) -> list[str]:
    return [name for name, scale, want in scales if scale is None or not math.isclose(scale, want, rel_tol=1e-6)]


def test_the_sequence_parallel_regather_hook_passes_over_a_float8_copy():
    """Under torchao's float8 TP plans (CUDA) a float8 linear keeps its input's float8 copy, a wrapper without
    storage: the re-gather hook, which matches saved tensors by storage, must pass over it, not fail."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from nanotron.parallel.regather import _storage

    copy = hp_tensor_to_float8_dynamic(torch.randn(4, 16), torch.float8_e4m3fn, LinearMMConfig())
    assert _storage(copy) is None
    plain = torch.ones(2)
    assert _storage(plain) == plain.untyped_storage().data_ptr()


MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def test_latent_attention_linears_convert_by_the_same_rule_and_configs_mla_converts_them_all():
    """Multi-head latent attention's linears follow every layer linear's rule (both weight dimensions multiples of
    16). configs/mla.toml's widths all qualify (q_a 96 x 128, q_b 4 x 48 x 96, kv_a (64 + 16) x 128, kv_b 4 x 64 x
    64, o 128 x 128); at the layout matrix's MLA widths the keys' down-projection (16 + 4 = 20 rows), kv_b (56 rows)
    and o_proj (24 columns) stay in the compute dtype and the query latents' convert."""
    big = load_config(*parse_overrides(["--config", "configs/mla.toml", "--training.float8=tensorwise"]))
    with torch.device("meta"):
        converted = set(Float8Plan.of(LlamaForCausalLM(big.model)).converted)
    assert {f"model.layers.{i}.self_attn.{name}" for i in range(4) for name in MLA_LINEARS} <= converted
    small = Float8Plan.of(LlamaForCausalLM(config("--training.float8=tensorwise", *MLA_MODEL).model))
    attention = {name.rsplit(".", 1)[1] for name in small.converted if ".self_attn." in name}
    assert attention == {"q_a_proj", "q_b_proj"}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in small.kept


@pytest.mark.slow
def test_configs_mla_trains_in_float8_at_one_process(tiny_data, tmp_path):
    """`--training.float8=tensorwise` on configs/mla.toml (emulated here), cut to 2 short steps: its 32 layer linears
    convert (20 of MLA, 3 dense, 9 shared-expert); the losses are those of float32 to within float8's error (measured:
    2.1e-4 relative at step 1, 9.0e-4 at step 2)."""
    args = ["--config", "configs/mla.toml", *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=f8"]
    args += ["--training.steps=2", "--training.seq_len=32", "--training.global_batch_size=4"]
    args += ["--training.micro_batch_size=2", "--training.eval_interval=0", "--checkpoint.save_final=false"]
    proc = run_train([*args, "--training.float8=tensorwise", "--logging.log_interval=1"])
    line = next(line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if " float8: " in line)
    assert "tensorwise scaling, emulated" in line and "32 decoder-layer linears converted" in line, line
    losses = train_losses(tmp_path / "f8")
    float32 = [9.033479690551758, 9.012457847595215]  # the same run with training.float8=off
    assert len(losses) == 2 and losses == pytest.approx(float32, rel=2e-3), losses
    assert losses[0] != pytest.approx(float32[0], rel=2e-5), losses  # float8 ran: its rounding shows


@pytest.mark.parametrize("regather", ["off", "on"])
def test_under_float8_tp_plans_sequence_parallel_gathers_the_norm_outputs_in_float8(monkeypatch, regather):
    """torchao's float8 TP plans (CUDA: gloo has no float8 collectives) with sequence parallelism: the attention and
        the MLP receive their input as a float8 tensor made Replicate by the all-gather, i.e. cast once before it (half
        the bytes, one cast for q/k/v) rather than gathered in the compute dtype and cast by each linear. Rank 0 of tp2
        on the fake process group (one process; the wiring, not the values: RESULTS states why no CPU test can hold
        the float8 gather's numbers to one process); forward and backward run through it, with the gathered inputs
    kept gathered or re-gathered in backward (sp_regather: the float8 copy, a wrapper without storage, is kept)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from nanotron.parallel import parallelize
    from nanotron.parallel.mesh import ParallelContext, build_mesh
    from nanotron.parallel.torch_private import fake_process_group

    cfg = config(
        *FLOAT8_MODEL, "--training.float8=tensorwise", "--parallelism.tp=2", f"--parallelism.sp_regather={regather}"
    )
    monkeypatch.setattr(parallelize, "float8_tp_collectives", lambda cfg, device: True)
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        ctx = ParallelContext(build_mesh(cfg, "cpu"), torch.device("cpu"), 0, cfg.world_size, 0, 0, 0)
        (_, model), *_ = build_model(cfg, ctx)
        seen = []

        def gathered(module, args):
            x = args[0]
            seen.append(isinstance(x, DTensor) and x.placements == (Replicate(),))
            seen.append(isinstance(x.to_local() if isinstance(x, DTensor) else x, Float8TrainingTensor))

        for layer in model.model.layers.values():
            layer.self_attn.register_forward_pre_hook(gathered)
            layer.mlp.register_forward_pre_hook(gathered)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.training.seq_len))
        out = model(tokens)
        (out.to_local() if isinstance(out, DTensor) else out).float().sum().backward()
        assert seen == [True] * 4 * cfg.model.num_layers, seen
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_a_float8_trained_model_exports_to_hf_as_a_plain_model_does(tiny_data, tmp_path):
    """Trained with float8 and FSDP's float8 weights (ZeRO-1: torchao's weight subclass inside the DTensor), the HF
    export is the plain layout: exactly the tensors transformers' Llama has, with its shapes, all float32 (no
    float8 tensor, nothing of torchao in the files), the master weights' values, a config.json without
    quantisation, and transformers' model from it gives the checkpoint's logits."""
    import json

    import transformers
    from safetensors.torch import load_file

    from nanotron.checkpoint.full_model import load_model
    from nanotron.commands.convert import main as convert_main

    args = [*TINY_MODEL, *FLOAT8_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=f8"]
    run_train([*args, "--training.steps=2", "--training.float8=tensorwise", "--parallelism.zero_stage=1"])
    step = tmp_path / "f8" / "checkpoints" / "step-2"
    assert convert_main(["to-hf", str(step), str(tmp_path / "hf")]) == 0
    files = [f for f in (tmp_path / "hf").iterdir() if f.is_file()]
    assert not [f.name for f in files if b"torchao" in f.read_bytes() or b"float8" in f.read_bytes()]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    layout = {name: (tuple(t.shape), torch.float32) for name, t in hf.state_dict().items()}
    assert {name: (tuple(t.shape), t.dtype) for name, t in exported.items()} == layout
    # The fp32 master weights, not float8 copies of them (which a float32 export would hold as float32 values too):
    # nearly all of a trained matrix's values lie off e4m3's grid.
    for name, t in exported.items():
        assert t.dim() == 1 or (t != t.to(torch.float8_e4m3fn).float()).float().mean() > 0.9, name
    ours, _ = load_model(step)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_mup_multipliers_act_outside_the_float8_matmuls():
    """µP at twice its base width and depth (residual branches x1/2, logits x1/2, attention scale 1/4 instead of
    1/sqrt(8)) with float8: each multiplier scales a float8 matmul's output after it (the residual stream gets
    exactly x + r^-1 attn + r^-1 mlp of the Float8Linear outputs; the logits are the bf16 head's times 1/m), never
    an operand whose dynamic scale would absorb it; the logits stay within float8's error of the fp32 µP model's."""
    from nanotron.models.parametrization import multipliers
    from nanotron.parallel.init import init_weights

    cfg = config("--training.float8=tensorwise", *TINY_MUP)
    factors = multipliers(cfg.model)
    assert (factors.residual, factors.logits, factors.attention_scale) == (0.5, 0.5, 0.25)
    plain = LlamaForCausalLM(cfg.model)
    init_weights(plain, seed=0)
    model = LlamaForCausalLM(cfg.model)
    model.load_state_dict(plain.state_dict())
    convert_to_float8(model, cfg, torch.device("cpu"))
    seen: dict[str, torch.Tensor] = {}
    for i, layer in model.model.layers.items():
        assert isinstance(layer.self_attn.o_proj, Float8Linear) and isinstance(layer.mlp.down_proj, Float8Linear)
        layer.register_forward_pre_hook(lambda m, args, i=i: seen.update({f"{i}.in": args[0]}))
        layer.register_forward_hook(lambda m, args, out, i=i: seen.update({f"{i}.out": out}))
        for name in ("self_attn", "mlp"):
            branch = layer.get_submodule(name)
            branch.register_forward_hook(lambda m, args, out, key=f"{i}.{name}": seen.update({key: out}))
    model.lm_head.register_forward_hook(lambda m, args, out: seen.update({"head": out}))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    for i in model.model.layers:
        residual = seen[f"{i}.in"] + 0.5 * seen[f"{i}.self_attn"]
        assert torch.equal(seen[f"{i}.out"], residual + 0.5 * seen[f"{i}.mlp"]), i
    assert type(model.lm_head) is nn.Linear and torch.equal(logits, 0.5 * seen["head"])
    error = ((logits - plain(tokens[:, :-1])).norm() / logits.norm()).item()
    assert 1e-3 < error < 1e-2, error  # float8 in effect, at its size here (0.29 % measured)
