"""µP: its rules (init std, LR scale, multipliers), equal to standard parametrization at the base shape, the
same training and activation statistics at every layout as in one process, exact resume at another layout,
and param-group settings that follow the config on resume."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL
from matrix import MUP, RTOL, Layout, Run, assert_matches

from nanotron.checkpoint.state import OptimizerState
from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.parametrization import (
    fan_ratios,
    multipliers,
    param_eps_scale,
    param_init_std,
    param_lr_scale,
    param_weight_decay_scale,
)
from nanotron.optim import build_optimizer, set_lr
from nanotron.parallel.init import init_weights


def config(*extra: str):
    return load_config(*parse_overrides([*TINY_MODEL, *extra]))


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_mup_rules_per_parameter(alpha):
    m = config(*MUP.flags, f"--model.mup_depth_exponent={alpha}").model  # m = 2, r = 2, base head dim 16 / 4 = 4
    assert asdict(m.mup_base) == dict(hidden=16, intermediate=32, heads=4, kv_heads=2, head_dim=4, layers=2)
    std, lr = (lambda name: param_init_std(m, name)), (lambda name: param_lr_scale(m, name))
    assert std("model.embed_tokens.weight") == std("lm_head.weight") == 0.02
    assert std("model.layers.3.self_attn.q_proj.weight") == pytest.approx(0.02 / 2**0.5)
    assert std("model.layers.0.mlp.up_proj.weight") == pytest.approx(0.02 / 2**0.5)
    assert std("model.layers.1.mlp.down_proj.weight") == pytest.approx(0.02 / (2 * 2) ** 0.5 / 2**0.5)
    assert std("model.layers.1.input_layernorm.weight") is None and std("model.norm.weight") is None
    assert lr("model.embed_tokens.weight") == lr("lm_head.weight") == lr("model.norm.weight") == 1.0
    depth_lr = 2 ** (alpha - 1)  # 1 for CompleteP, 1/sqrt(2) for depth-µP
    assert lr("model.layers.2.self_attn.o_proj.weight") == pytest.approx(depth_lr / 2)
    assert lr("model.layers.2.post_attention_layernorm.weight") == pytest.approx(depth_lr)
    mult = multipliers(m)
    assert mult.attention_scale == pytest.approx(4**0.5 / 8)  # 1/head_dim, = 1/sqrt(4) at the base head dim
    assert (mult.residual, mult.logits) == (pytest.approx(2**-alpha), 0.5)


def base(**shape: int) -> list[str]:
    return ["--model.parametrization=mup", *(f"--model.mup_base.{k}={v}" for k, v in shape.items())]


def test_a_head_count_change_at_fixed_head_dim_keeps_the_standard_attention_scale():
    """TINY_MODEL (4 heads of 8) grown from a 1-head base of 8: µP's 1/head_dim scale equals 1/sqrt(8) at the
    base head dim, so the logits keep the standard scale; a base of 4 heads of 2 at the same width gives sqrt(2)/8."""
    m = config(*base(hidden=8, heads=1, kv_heads=1, intermediate=16)).model
    assert m.mup_base.head_dim == 8 and multipliers(m).attention_scale is None  # SDPA's 1/sqrt(head_dim)
    assert multipliers(m).logits == 0.25  # the width ratio is still 4
    narrow = config(*base(hidden=8, heads=4, intermediate=16)).model
    assert narrow.mup_base.head_dim == 2 and multipliers(narrow).attention_scale == pytest.approx(2**0.5 / 8)


def test_each_matrix_scales_by_its_own_fans():
    """Grouped-query attention at a fixed K/V width and an MLP width that did not grow: k/v and gate/up only gain
    fan-in (output-like: init / m_in, LR / m_in), down_proj only fan-out (input-like: unchanged), q/o both."""
    m = config(*base(hidden=16, heads=2, kv_heads=1, intermediate=64), "--model.num_kv_heads=2").model
    # model: hidden 32 = 4 heads of 8, 2 K/V heads (K/V width 16); base: 2 heads of 8, 1 K/V head (width 8).
    std, lr = (lambda name: param_init_std(m, name)), (lambda name: param_lr_scale(m, name))
    assert std("model.layers.0.self_attn.q_proj.weight") == pytest.approx(0.02 / 2**0.5)
    assert lr("model.layers.0.self_attn.q_proj.weight") == lr("model.layers.0.self_attn.k_proj.weight") == 0.5
    assert std("model.layers.0.self_attn.k_proj.weight") == pytest.approx(0.02 / 2**0.5)  # K/V width grew 2x too
    assert std("model.layers.1.mlp.up_proj.weight") == pytest.approx(0.02 / 2)  # fan-out stayed at 64
    assert lr("model.layers.1.mlp.up_proj.weight") == 0.5
    assert std("model.layers.1.mlp.down_proj.weight") == pytest.approx(0.02 / (2 * 4) ** 0.5)  # fan-in stayed
    assert lr("model.layers.1.mlp.down_proj.weight") == 1.0
    fixed_kv = config(*base(hidden=16, heads=2, kv_heads=2, intermediate=32)).model  # K/V width 16 at both
    assert param_init_std(fixed_kv, "model.layers.0.self_attn.v_proj.weight") == pytest.approx(0.02 / 2)
    assert param_lr_scale(fixed_kv, "model.layers.0.self_attn.v_proj.weight") == 0.5


def first_step(cfg, lr: float) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    """The model after one optimizer step at `lr` on a fixed random batch, and its weights before it."""
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = torch.randint(0, 512, (8, 17), generator=torch.Generator().manual_seed(0))
    set_lr(optimizer, lr)
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    return model, before


def test_muons_first_step_meets_the_spectral_condition_at_2x_width():
    """Under µP, Muon's update of each layer matrix has the spectral norm its base-width counterpart has (lr x
    update_rms x sqrt(max(fans at the base))), times sqrt(m_out / m_in): the spectral condition, not Adam's 1/m_in.
    The cubic iteration run to convergence makes the orthogonal factor's norm exactly 1."""
    muon = ["--optimizer.name=muon", "--optimizer.muon_coefficients=cubic", "--optimizer.muon_ns_steps=40"]
    cfg = config(*MUP.flags, *muon, "--optimizer.weight_decay=0")  # m = 2, r = 2 (CompleteP: depth factor 1)
    model, before = first_step(cfg, lr=1e-2)
    checked = 0
    for name, param in model.named_parameters():
        if not name.startswith("model.layers.") or param.ndim != 2:
            continue
        m_in, m_out = fan_ratios(cfg.model, name)
        base_out, base_in = param.shape[0] / m_out, param.shape[1] / m_in
        expected = 1e-2 * 0.2 * max(base_in, base_out) ** 0.5 * (m_out / m_in) ** 0.5
        moved = torch.linalg.matrix_norm(param.detach() - before[name], ord=2).item()
        assert moved == pytest.approx(expected, rel=1e-4), name
        checked += 1
    assert checked == 7 * cfg.model.num_layers


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_eps_and_weight_decay_follow_completep_and_the_weight_decay_mode(alpha):
    """eps / m outside the layers and eps / (m r^alpha) inside (CompleteP); weight decay x m_in under
    `independent`, so lr x weight_decay is the same at every width; coupled and fixed leave the config's."""
    extra = ("--optimizer.weight_decay_mode=independent", f"--model.mup_depth_exponent={alpha}")
    cfg = config(*MUP.flags, *extra)  # m = 2, r = 2
    m, eps, wd = cfg.model, cfg.optimizer.eps, cfg.optimizer.weight_decay
    model = LlamaForCausalLM(m)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), m)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, param in model.named_parameters():
        group, layer = group_of[id(param)], name.startswith("model.layers.")
        assert group["eps"] == pytest.approx(eps / 2 / (2**alpha if layer else 1.0)), name
        matrix = layer and not name.endswith("norm.weight")
        assert group["weight_decay"] == pytest.approx(wd * 2 if matrix else (wd if name == "lm_head.weight" else 0))
        if matrix:  # the decay per step, lr x lr_scale x weight_decay, does not shrink with width
            assert group["lr_scale"] * group["weight_decay"] == pytest.approx(wd * 2 ** (alpha - 1))
    plain = config(*MUP.flags, "--optimizer.eps_mode=fixed").model
    assert param_eps_scale(plain, "model.layers.0.mlp.up_proj.weight", "fixed") == 1.0
    assert param_weight_decay_scale(m, "model.layers.0.mlp.up_proj.weight", "coupled") == 1.0
    standard = config().model
    assert param_eps_scale(standard, "model.norm.weight") == param_weight_decay_scale(standard, "x", "independent")


@pytest.mark.parametrize("tied", [False, True])
def test_mup_at_its_base_shape_is_standard_parametrization_bit_for_bit(tied):
    """Every µP factor is 1 at the base shape: same init, same LR per group, same losses, exactly."""
    extra = [f"--model.tie_word_embeddings={str(tied).lower()}"]
    base = ["--model.parametrization=mup", "--model.mup_base.hidden=32", "--model.mup_base.layers=4"]
    losses = []
    for cfg in (config(*extra), config(*extra, *base)):
        model = LlamaForCausalLM(cfg.model)
        init_weights(model, cfg.job.seed)
        optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
        assert {group["lr_scale"] for group in optimizer.param_groups} == {1.0}
        batch = torch.randint(0, 512, (8, 17), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            set_lr(optimizer, 3e-3)
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[:3] == losses[3:]


def test_the_first_adam_step_moves_each_weight_by_its_scaled_learning_rate():
    """Adam's first step moves every weight with a gradient by lr x its group's lr_scale (|m/sqrt(v)| = 1):
    the factors reach the update, not only the param groups."""
    cfg = config(*MUP.flags, "--optimizer.weight_decay=0", "--optimizer.eps=1e-30")
    model, before = first_step(cfg, lr=1e-2)
    for name, param in model.named_parameters():
        moved = (param.detach() - before[name]).abs().max().item()
        assert moved == pytest.approx(1e-2 * param_lr_scale(cfg.model, name), rel=1e-3), name


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--model.mup_depth_exponent=0.5"], "model.mup_depth_exponent=0.5 only applies with"),
        (["--model.parametrization=mup", "--model.mup_depth_exponent=2"], r"expected a value in \[0.5, 1\]"),
        (["--model.mup_base.hidden=16"], "model.mup_base.hidden=16 only applies with model.parametrization='mup'"),
        (base(hidden=16), "the base's attention shape is unset: set model.mup_base.heads"),
        (base(hidden=16, heads=2), "model.mup_base.intermediate is unset .*e.g. 32 for this model's ratio"),
        (base(hidden=16, heads=2, intermediate=32), "model.mup_base.kv_heads is unset"),
        (base(hidden=16, heads=3), "model.mup_base.hidden=16 is not divisible by model.mup_base.heads=3"),
        (base(hidden=16, heads=2, head_dim=4), "heads x head_dim = 2 x 4 is not hidden=16"),
        (base(heads=4, kv_heads=3), "model.mup_base.heads=4 is not divisible by model.mup_base.kv_heads=3"),
    ],
)
def test_mup_misconfigurations_name_the_key(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        config(*overrides)


def test_resumed_param_groups_take_lr_scale_weight_decay_and_eps_from_the_config():
    """Torch would copy each group's settings from the checkpoint; the config's must win (like the LR)."""
    cfg = config(*MUP.flags)
    model = LlamaForCausalLM(cfg.model)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
    state = OptimizerState([model], [optimizer])
    saved = state.state_dict()
    for key in saved:  # a checkpoint of another µP base and weight decay
        if key.endswith((".lr_scale", ".weight_decay", ".eps")):
            saved[key] = 0.123
    state.load_state_dict(saved)
    by_name = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        names = [by_name[id(p)] for p in group["params"]]
        assert {param_lr_scale(cfg.model, n) for n in names} == {group["lr_scale"]}
        assert group["weight_decay"] in (0.0, cfg.optimizer.weight_decay)
        assert {cfg.optimizer.eps * param_eps_scale(cfg.model, n) for n in names} == {group["eps"]}


# ---- every layout against one process (slow: real process groups) -------------------------------------------


def assert_same_activations(run: Run, ref: Run, steps: list[int]) -> None:
    assert sorted(run.stats) == steps and len(ref.stats[steps[0]]) == 1 + 3 * 4 + 2  # embed, 4 layers, norm, logits
    for step in steps:
        assert run.stats[step] == pytest.approx(ref.stats[step], rel=RTOL, abs=0), step


# µP at 3D. The activation statistics at every other layout, both tp modes included, are checked under
# standard parametrization in test_parallel.py (the statistics do not depend on the parametrization).
LAYOUTS = [Layout(dp=2, tp=2, pp=2, flags=("--parallelism.zero_stage=3", "--parallelism.recompute=full"))]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mup_training_and_activation_stats_match_one_process(layout, references, tiny_data, tmp_path):
    ref = references[MUP]
    run = MUP.run(tiny_data, tmp_path, "run", layout)
    assert sorted(ref.stats) == [2, 4, 6] and len(ref.stats[2]) == 1 + 3 * 4 + 2  # embed, 4 layers, norm, logits
    print(f"{layout}: {assert_matches(run, ref, MUP)}")


@pytest.mark.slow
def test_mup_resume_at_another_layout_is_exact(references, tiny_data, tmp_path):
    """Saved at dp2 x pp2 (zero 1) after 3 steps, resumed at tp2: the losses and activations of the
    uninterrupted 1-process run, so model, optimizer state (every group's lr_scale too) and data position all
    resharded."""
    ref = references[MUP]
    saved_layout = Layout(dp=2, pp=2, flags=("--parallelism.zero_stage=1",))
    saved = Run(MUP.train(tiny_data, tmp_path, "saved", saved_layout, steps=3), 3)
    step3 = saved.dir / "checkpoints" / "step-3"
    resumed = MUP.run(tiny_data, tmp_path, "resumed", Layout(tp=2), f"--checkpoint.resume_from={step3}")
    assert saved.losses == pytest.approx(ref.losses[:3], rel=RTOL, abs=0)
    assert resumed.losses == pytest.approx(ref.losses[3:], rel=RTOL, abs=0)
    assert_same_activations(resumed, ref, [4, 6])
    first = next(r for r in resumed.metrics if "loss" in r)
    assert (first["step"], first["consumed_samples"]) == (4, 32)  # the data continues at global sample 24
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["layout"] == {"dp": 2, "cp": 1, "ep": 1, "tp": 1, "pp": 2, "zero_stage": 1}
