"""Muon in one process: the stated update (Nesterov momentum, then Newton-Schulz per logical matrix, then Moonlight's
scaling and decoupled decay), the rule that splits parameters between Muon and AdamW, and its bad settings. Its
layouts are held to one process in tests/test_parallel.py (the MUON family)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import REPO, TINY_MODEL
from matrix import MOE
from torch.utils._python_dispatch import TorchDispatchMode

import nanotron.train
from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.optim import build_optimizer, set_lr
from nanotron.optim.muon import (
    COEFFICIENTS,
    Muon,
    assign_owners,
    describe,
    is_muon_matrix,
    logical_matrices,
    newton_schulz,
    ns_dtype,
)
from nanotron.parallel.init import init_weights
from nanotron.plan.memory import stage_memory
from nanotron.plan.timing import estimate_step, parse_gpu


def test_cubic_newton_schulz_converges_to_the_orthogonal_factor_and_jordans_lands_near_it():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    exact = newton_schulz(g, 60, COEFFICIENTS["cubic"])
    assert torch.allclose(exact.double(), u @ vh, atol=1e-4)
    assert torch.allclose(newton_schulz(g.T, 60, COEFFICIENTS["cubic"]).double(), (u @ vh).T, atol=1e-4)  # tall
    singular = torch.linalg.svdvals(newton_schulz(g, 5, COEFFICIENTS["jordan"]).double())
    assert singular.min() > 0.6 and singular.max() < 1.25, singular  # Jordan's quintic: fast, not exact


def test_bf16_newton_schulz_keeps_the_fp32_spectrum_and_the_quintic_band():
    """optimizer.muon_ns_dtype=bfloat16 (auto's choice on CUDA): the bf16 iteration's output has the fp32 one's
    singular values to 0.03 (measured <= 0.024) and, on a Gaussian matrix, the band Jordan's quintic gives (fp32:
    0.68 to 1.13); its elements differ by bf16's rounding carried through 5 iterations: 2.8e-2 to 3.4e-2 Frobenius
    relative on a Gaussian matrix (wide or tall), 1.2e-1 to 1.3e-1 on a gradient-like one (4 large directions over
    noise), whose nearly equal small singular values leave their vectors free to turn within their cluster."""
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(64, 160, generator=generator)
    low_rank = torch.randn(96, 4, generator=generator) @ torch.randn(4, 256, generator=generator)
    gradient_like = low_rank + 0.05 * torch.randn(96, 256, generator=generator)
    for matrix, frobenius in ((gaussian, 5e-2), (gaussian.T, 5e-2), (gradient_like, 2e-1)):
        fp32 = newton_schulz(matrix, 5, COEFFICIENTS["jordan"])
        bf16 = newton_schulz(matrix, 5, COEFFICIENTS["jordan"], torch.bfloat16)
        assert bf16.dtype == torch.bfloat16 and bf16.shape == fp32.shape
        assert (bf16.float() - fp32).norm() / fp32.norm() < frobenius
        singular, reference = torch.linalg.svdvals(bf16.double()), torch.linalg.svdvals(fp32.double())
        assert (singular - reference).abs().max() < 0.03, (singular - reference).abs().max()
        if matrix is not gradient_like:
            assert singular.min() > 0.6 and singular.max() < 1.25, singular


def muon_model(*flags: str):
    cfg = load_config(*parse_overrides([*TINY_MODEL, *MOE, "--optimizer.name=muon", *flags]))
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    return cfg, model


def test_muon_step_is_momentum_then_newton_schulz_per_matrix_then_scaled_with_decoupled_decay():
    cfg, model = muon_model()
    o = cfg.optimizer
    optimizer = build_optimizer(model, o, torch.device("cpu"), cfg.model)
    assert isinstance(optimizer, Muon)
    params = dict(model.named_parameters())
    muon = {id(p) for group in optimizer.param_groups if group.get("muon") for p in group["params"]}
    to_muon = sorted(name for name, p in params.items() if id(p) in muon)
    assert "model.layers.0.self_attn.q_proj.weight" in to_muon and "model.layers.1.mlp.experts.gate_up_proj" in to_muon
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight"):
        assert name not in to_muon, name  # embedding, head, norms, routers: AdamW

    lr, mu, ns = 0.01, o.muon_momentum, (o.muon_ns_steps, COEFFICIENTS[o.muon_coefficients])
    set_lr(optimizer, lr)
    q, experts = params["model.layers.0.self_attn.q_proj.weight"], params["model.layers.1.mlp.experts.gate_up_proj"]
    want_q, want_experts = q.detach().clone(), experts.detach().clone()
    buffer_q, buffer_experts = torch.zeros_like(q), torch.zeros_like(experts)
    rows = experts.shape[1] // 2

    def expected(weight, update):  # W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) NS(U), each logical matrix alone
        return weight * (1 - lr * o.weight_decay) - lr * o.muon_update_rms * math.sqrt(max(update.shape)) * (
            newton_schulz(update, *ns)
        )

    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step sees the first one's momentum
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator)
        buffer_q = mu * buffer_q + q.grad
        buffer_experts = mu * buffer_experts + experts.grad
        want_q = expected(want_q, q.grad + mu * buffer_q)
        nesterov = experts.grad + mu * buffer_experts
        for e in range(experts.shape[0]):
            for half in (slice(0, rows), slice(rows, 2 * rows)):  # gate and up: two matrices per expert
                want_experts[e, half] = expected(want_experts[e, half], nesterov[e, half])
        optimizer.step()
    assert torch.allclose(q.detach(), want_q, rtol=1e-5, atol=1e-7)
    assert torch.allclose(experts.detach(), want_experts, rtol=1e-5, atol=1e-7)


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of every matrix product run while it is on."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("setting", "expected"), [("bfloat16", torch.bfloat16), ("auto", torch.float32)])
def test_muon_ns_dtype_is_the_dtype_of_the_owners_newton_schulz_matmuls(setting, expected):
    """The key reaches the iteration: every matrix product of a Muon step (the owner's Newton-Schulz: AdamW's and
    the momentum's work are elementwise) runs in the dtype it names; auto is fp32 here (CPU) and bf16 on CUDA. The
    start-up line says which."""
    cfg, model = muon_model(f"--optimizer.muon_ns_dtype={setting}")
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with MatmulDtypes() as seen:
        optimizer.step()
    assert seen.dtypes == {expected}
    assert f"Newton-Schulz in {str(expected).removeprefix('torch.')} (optimizer.muon_ns_dtype={setting})" in (
        describe(optimizer, model)
    )
    assert ns_dtype("auto", torch.device("cuda")) == torch.bfloat16 and ns_dtype("float32", torch.device("cuda")) == (
        torch.float32
    )


def test_a_rule_leaving_muon_nothing_is_one_line(tiny_data, tmp_path, capsys):
    flags = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--optimizer.name=muon"]
    flags.append("--optimizer.muon_adamw_names=layers")
    assert nanotron.train.main(flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "optimizer.muon_adamw_names=['layers'] leaves no decoder-layer matrix" in errors[0]


@pytest.mark.parametrize(
    ("names", "hint"),
    [
        ("mlp.gate.weigth", "did you mean 'mlp.gate.weight'?"),
        ("mlp.gate.weight,o_prj", "the decoder layers' parameters are input_layernorm.weight, mlp.down_proj.weight, "),
    ],
)
def test_a_muon_adamw_name_matching_no_parameter_is_one_line_naming_it(names, hint):
    """A typo matched nothing and left its matrices (here the routers) to Muon without a word. The default's routers
    are absent from a dense model, which is no typo."""
    cfg, model = muon_model(f"--optimizer.muon_adamw_names={names}")
    entry = names.split(",")[-1]
    message = f"optimizer.muon_adamw_names: {entry!r} is part of no parameter's name; {hint}"
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
    dense = load_config(*parse_overrides([*TINY_MODEL, "--optimizer.name=muon"]))
    assert dense.optimizer.muon_adamw_names == ["mlp.gate.weight"]
    build_optimizer(LlamaForCausalLM(dense.model), dense.optimizer, torch.device("cpu"), dense.model)


@pytest.mark.parametrize(
    ("key", "value", "named"), [("muon_coefficients", "polar", "jordan"), ("muon_ns_dtype", "float16", "bfloat16")]
)
def test_an_unknown_coefficient_set_or_iteration_dtype_is_one_line(key, value, named, capsys):
    flags = ["--config", f"{REPO}/configs/tiny.toml", f"--optimizer.{key}={value}"]
    assert nanotron.train.main(flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and f"optimizer.{key}" in errors[0] and named in errors[0], errors


@pytest.mark.parametrize(
    "ns_dtype, tf32, mode", [("auto", True, "bf16"), ("bfloat16", False, "bf16"), ("float32", True, "tf32"),
                             ("float32", False, "fp32")]
)  # fmt: skip
def test_the_plan_charges_newton_schulz_at_the_peak_of_its_own_dtype(ns_dtype, tf32, mode):
    """auto (bf16 on CUDA) and bfloat16 at the bf16 peak whatever the model's dtype; float32 at TF32's with
    training.tf32, else full fp32's (an fp32 model: its matmuls at TF32 either way)."""
    cfg, _ = muon_model()
    overrides = [*TINY_MODEL, f"--model.num_layers={cfg.model.num_layers}", "--training.global_batch_size=8"]
    overrides += ["--optimizer.name=muon", f"--optimizer.muon_ns_dtype={ns_dtype}", f"--training.tf32={tf32}"]
    gpu = parse_gpu("h100")
    muon = load_config(*parse_overrides(overrides))
    adamw = load_config(*parse_overrides([*overrides[:-3], "--optimizer.name=adamw", f"--training.tf32={tf32}"]))
    base, step = (estimate_step(c, gpu, gpus_per_node=8, efficiency=0.5) for c in (adamw, muon))
    newton_schulz_s = step.step_s - base.step_s - step.comm["muon"].seconds
    flops = newton_schulz_s * gpu.device.peak(mode) * 1e12 * 0.5
    shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)]  # q k v o gate up down
    assert flops == pytest.approx(4 * sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes), rel=1e-6)


def test_the_plan_counts_one_momentum_buffer_the_exchange_and_newton_schulz():
    """Optimizer state: the bytes the real optimizer holds (Muon's matrices one fp32 buffer, AdamW two moments and
    a step). Step time: Muon adds its all-to-alls and the Newton-Schulz FLOPs (5 x (4 m^2 n + 2 m^3), m the shorter
    side) of the busiest owner: all of them on one rank; on two, between half and all of them, and the rank's own
    shards plus the other rank's part of its owned matrices sent (tests/test_benchmarks.py holds that to the real
    routes of the busiest rank)."""
    cfg, model = muon_model()
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), cfg.model)
    held = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    assert stage_memory(cfg, 0)["optimizer"] == held

    dense = [f"--model.num_layers={cfg.model.num_layers}", "--training.global_batch_size=8"]
    gpu = parse_gpu("h100")
    shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)]  # q k v o gate up down
    flops = 4 * sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    elements = 4 * sum(r * c for r, c in shapes)
    for world in (1, 2):
        layout = [f"--parallelism.dp={world}", "--parallelism.zero_stage=3"]
        adamw, muon = (
            load_config(*parse_overrides([*TINY_MODEL, *dense, *layout, f"--optimizer.name={name}"]))
            for name in ("adamw", "muon")
        )
        base, step = (estimate_step(c, gpu, gpus_per_node=8, efficiency=0.5) for c in (adamw, muon))
        newton_schulz_s = step.step_s - base.step_s - step.comm["muon"].seconds
        all_flops_s = flops / (gpu.device.peak("bf16") * 1e12 * 0.5)  # auto: bf16 on CUDA
        gb = step.comm["muon"].gb
        if world == 1:
            assert gb == 0 and newton_schulz_s == pytest.approx(all_flops_s, rel=1e-6)
        else:
            assert all_flops_s / 2 <= newton_schulz_s * (1 + 1e-9) and newton_schulz_s < all_flops_s
            assert (
                4 * (elements / 2 + elements / 2) / 2 / 1e9 <= gb * (1 + 1e-9) < 4 * (elements / 2 + elements) / 2 / 1e9
            )


def test_owners_spread_the_newton_schulz_work_over_the_ranks():
    """Largest first to the least-loaded rank: every rank owns matrices and the loads differ by at most one matrix."""
    _, model = muon_model()
    pieces = [
        (i, *where, p.shape[-1])
        for i, (name, p) in enumerate(model.named_parameters())
        if is_muon_matrix(name, p.ndim, [])
        for where in logical_matrices(name, p.shape)
    ]
    cost = {piece: (piece[3] - piece[2]) * piece[4] * min(piece[3] - piece[2], piece[4]) for piece in pieces}
    matrices = assign_owners(pieces, 4)
    load = [sum(cost[(m.param, m.lead, m.start, m.stop, m.cols)] for m in matrices if m.owner == r) for r in range(4)]
    assert min(load) > 0 and max(load) - min(load) <= max(cost.values()), load


def test_an_empty_route_in_the_exchange_is_on_the_matrices_device(monkeypatch):
    """A rank that sends a peer nothing (more ranks than matrices) sends an empty tensor: it must be on the
    matrices' device, or the concatenation (and NCCL's all-to-all) gets a CPU tensor among CUDA ones. Fake CUDA
    tensors (FakeTensorMode: no GPU) and a recorded all-to-all play rank 0 of 2."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from nanotron.optim import muon

    sent = []
    monkeypatch.setattr(muon.dist, "all_to_all_single", lambda out, send, *args, **kwargs: sent.append(send.device))
    optimizer = SimpleNamespace(plan=SimpleNamespace(size=2, group=None))
    with FakeTensorMode():
        piece = torch.ones(4, device="cuda")
        received = muon.Muon._exchange(optimizer, [[piece], []], [4, 0], piece)
    assert sent == [torch.device("cuda", 0)] and [t.device.type for t in received] == ["cuda", "cuda"]
