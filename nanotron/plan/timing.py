"""Step time and MFU of a layout from FLOPs, a stated compute efficiency and the bytes each parallel dimension
moves per step over stated NVLink / InfiniBand bandwidths.

Under training.float8 the converted linears' matmuls (nanotron.parallel.float8's rule: the decoder layers' linears;
the embedding, head, MoE routers and experts, and attention's SDPA stay in the compute dtype) run at the GPU's
float8 peak and the rest at its compute-dtype peak, both at the same efficiency; the casts to float8 are
memory-bound and charged at the GPU's HBM bandwidth; FSDP gathers the converted weights in 1 byte (tensorwise) and
all-reduces their scales once per step.

Assumptions (printed with every plan): FSDP/DP collectives overlap compute (the step pays the larger of
the two) except the first unit's gather of each pass and the last unit's reduction; tensor-parallel and
pipeline transfers are exposed; context parallelism's K/V ring overlaps each block's attention and is exposed
only where it takes longer; Muon's all-to-alls and Newton-Schulz are exposed; collectives run as rings at the
link's bandwidth per GPU; a group inside one node uses NVLink, a group spanning nodes InfiniBand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from nanotron.config import PP_ENGINES, Config
from nanotron.errors import ConfigError
from nanotron.gpu import GPU_FORMS, GPUS, LINK_GBPS, MEMORY_GIB, PEAK_TFLOPS, PLANNED, Device, math_mode
from nanotron.models.shapes import (
    element_bytes,
    flops_per_token,
    is_moe_layer,
    kv_bytes_per_token,
    layer_forward_flops,
)
from nanotron.optim.muon import assign_owners, is_muon_matrix, logical_matrices, newton_schulz_flops
from nanotron.parallel.float8 import fsdp_float8_all_gather
from nanotron.parallel.recompute import recompute_mode
from nanotron.parallel.regather import regathers
from nanotron.plan.float8 import float8_cast_bytes, float8_flops, float8_linears
from nanotron.plan.memory import FP32, coordinate_zero_split, micro_tokens, rank_stages, sequence_shards

UNCALIBRATED_EFFICIENCY = 0.55  # a GPU without published runs in the calibration set


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak compute: the default and the spread of the published runs it comes from
    (`benchmarks/calibration/published.csv`, `python -m benchmarks.plan_calibration`)."""

    default: float
    low: float | None = None
    high: float | None = None
    source: str = "uncalibrated: no published runs of this GPU in the calibration set"
    error: float | None = None  # the largest |planned / published - 1| over the set at `default`


# H100: the median and range of the efficiencies that reproduce six torchtitan bf16 runs (Llama 3.1 8B/70B,
# 8-256 GPUs). H200 has the H100's compute die; no bf16 H200 run is in the set, so it takes the H100's figures.
H100_EFFICIENCY = Efficiency(
    0.41, 0.36, 0.47, "median of 6 published H100 runs (torchtitan), range 0.36-0.47", error=0.11
)
# A100: the same over Megatron-LM's ten April 2021 weak-scaling runs (GPT 1.7B-1T, 32-3072 GPUs; TP exposed then,
# as nanotron's is). The efficiency rises with the model (0.44 at hidden 2304, 0.63 at 20480): bigger GEMMs, and
# perhaps a smaller pipeline bubble than the 1F1B one planned for the PP 8-64 runs (RESULTS).
A100_EFFICIENCY = Efficiency(
    0.52, 0.44, 0.63, "median of 10 published A100 runs (Megatron-LM 2021), range 0.44-0.63", error=0.17
)


# GPU (the model in nanotron.gpu.GPUS) -> its efficiency; a GPU the planner plans for has memory and links there.
EFFICIENCIES = {"H100": H100_EFFICIENCY, "H200": H100_EFFICIENCY, "A100": A100_EFFICIENCY}


@dataclass(frozen=True)
class Gpu:
    """A GPU as the planner sees it: its row of `nanotron.gpu.GPUS` (links as overridden) and its efficiency."""

    name: str
    device: Device
    efficiency: Efficiency = Efficiency(UNCALIBRATED_EFFICIENCY)


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]  # False for nan


def parse_gpu(text: str, nvlink_gbps: float | None = None, ib_gbps: float | None = None) -> Gpu:
    """`h100`, `h200`, `a100`, or `<memory GiB>,<peak bf16 TFLOP/s>` (TF32 at half of it, float8 at twice it as on
    every NVIDIA part with float8 tensor cores, no fp32 peak, the H100's links and HBM unless given)."""
    if text.lower() in PLANNED:
        model = text.upper()
        gpu = Gpu(text.lower(), GPUS[model, ""], EFFICIENCIES.get(model, Efficiency(UNCALIBRATED_EFFICIENCY)))
    else:
        try:
            memory, peak = (float(x) for x in text.split(","))
            if not (_within(memory, MEMORY_GIB) and _within(peak, PEAK_TFLOPS)):
                raise ValueError
        except ValueError:
            raise ConfigError(f"--gpu {text!r}: expected {GPU_FORMS}, such as '80,989'") from None
        device = replace(GPUS["H100", ""], bf16=peak, tf32=peak / 2, fp32=None, fp8=2 * peak, memory_gib=memory)
        gpu = Gpu(f"{memory:g}GiB/{peak:g}TF", device)
    links = {"nvlink_gbps": nvlink_gbps, "ib_gbps": ib_gbps}
    for name, gbps in links.items():
        if gbps is not None and not _within(gbps, LINK_GBPS):
            raise ConfigError(
                f"--{name}: expected GB/s in [{LINK_GBPS[0]:g}, {LINK_GBPS[1]:g}], got {gbps:g} (per GPU, e.g. "
                f"{getattr(GPUS['H100', ''], name):g} on an H100; leave it out for the --gpu default)"
            )
    chosen = {name: getattr(gpu.device, name) if gbps is None else gbps for name, gbps in links.items()}
    return replace(gpu, device=replace(gpu.device, **chosen))


def peak_tflops(cfg: Config, gpu: Gpu) -> tuple[str, float]:
    """(math mode, dense peak) the run's matmuls can reach: MFU's rule (bf16; fp32 on TF32 tensor cores when
    training.tf32, else full fp32)."""
    mode = math_mode(cfg.training.dtype, cfg.training.tf32)
    settings = f"training.dtype='{cfg.training.dtype}', training.tf32={str(cfg.training.tf32).lower()}"
    return mode, known_peak(gpu, mode, settings, "training.tf32=true or bfloat16")


def newton_schulz_peak_tflops(cfg: Config, gpu: Gpu) -> float:
    """The dense peak of Muon's Newton-Schulz matmuls: bf16 for optimizer.muon_ns_dtype 'bfloat16' and 'auto'
    (bf16 on CUDA), whatever the model's dtype; fp32 on TF32 tensor cores for 'float32' with training.tf32, else
    full fp32."""
    setting = cfg.optimizer.muon_ns_dtype
    mode = math_mode("float32" if setting == "float32" else "bfloat16", cfg.training.tf32)
    settings = f"optimizer.muon_ns_dtype='{setting}', training.tf32={str(cfg.training.tf32).lower()}"
    return known_peak(gpu, mode, settings, "optimizer.muon_ns_dtype='bfloat16' or training.tf32=true")


def known_peak(gpu: Gpu, mode: str, settings: str, hint: str) -> float:
    """The GPU's dense peak in math `mode`; one line naming the settings that chose it where it is unknown."""
    peak = gpu.device.peak(mode)
    if peak is None:
        raise ConfigError(
            f"--gpu {gpu.name}: no {mode} peak is known for it ({settings}); plan with {hint}, or a GPU of the table "
            f"({', '.join(PLANNED)})"
        )
    return peak


def float8_peak_tflops(cfg: Config, gpu: Gpu) -> float | None:
    """The dense e4m3 peak the converted linears' matmuls reach under training.float8; None when it is off."""
    if cfg.training.float8 == "off":
        return None
    if gpu.device.fp8 is None:
        raise ConfigError(
            f"--gpu {gpu.name}: no float8 matmuls (training.float8='{cfg.training.float8}' would run emulated, slower "
            f"than {cfg.training.dtype}); plan with training.float8='off', or a GPU with float8 tensor cores "
            f"({', '.join(name for name in PLANNED if GPUS[name.upper(), ''].fp8)})"
        )
    return gpu.device.fp8


def float8_scale_gb(cfg: Config, tp_local_linears: int) -> float:
    """GB each GPU sends in the per-step all-reduce of the float8 scales under the FSDP float8 all-gather (one fp32
    amax per converted linear of the rank's stages, over its FSDP shard group and tp: the DTensor weights' mesh).
    At 512 GPUs and 70B (560 linears) that is 2.2 KB: latency-bound, tens of microseconds against a step of
    seconds, exposed (it runs between the optimizer step and the next forward's first gather)."""
    if not fsdp_float8_all_gather(cfg):
        return 0.0
    return ring_gb(FP32 * tp_local_linears, cfg.fsdp_shard_size * cfg.parallelism.tp, all_reduce=True)


@dataclass(frozen=True)
class Transfer:
    """What one parallel dimension moves per step: gigabytes each GPU sends, over which link."""

    gb: float
    link: str
    gbps: float

    @property
    def seconds(self) -> float:
        return self.gb / self.gbps if self.gb else 0.0


@dataclass
class StepEstimate:
    step_s: float
    compute_s: float
    tokens_per_s: float
    mfu: float
    comm: dict[str, Transfer]  # by dimension: tp, pp, dp (FSDP/replicate), dp_replicate (HSDP)
    # The step's seconds by cause, summing to step_s: compute (model FLOPs), recompute (the extra forward that
    # memory forced), bubble (pipeline idle), and the exposed part of each dimension's traffic (tp, pp, cp,
    # ep, dp: what FSDP/DP collectives take beyond the compute they overlap).
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def limit(self) -> str:
        """What bounds this layout most: compute, or the largest cost beyond it."""
        waste = {k: v for k, v in self.parts.items() if k != "compute" and v > 0}
        worst = max(waste, key=waste.get, default=None)
        return "compute" if worst is None or waste[worst] < 0.05 * self.step_s else worst

    @property
    def traffic_gb(self) -> float:
        """GB each GPU sends per step over every dimension, hidden or not (a tie-break: what contends)."""
        return sum(t.gb for t in self.comm.values())


def ring_gb(bytes_: float, group: int, all_reduce: bool = False) -> float:
    """GB each GPU sends in a ring all-gather / reduce-scatter of `bytes_` (an all-reduce is both)."""
    return (2 if all_reduce else 1) * bytes_ * (group - 1) / group / 1e9 if group > 1 else 0.0


def estimate_step(cfg: Config, gpu: Gpu, gpus_per_node: int, efficiency: float) -> StepEstimate:
    """Step time of the layout at `efficiency` of the GPU's peak: compute (recompute and pipeline bubble included),
    plus each dimension's traffic less what overlaps compute."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    world = cfg.world_size
    peak = peak_tflops(cfg, gpu)[1] * 1e12
    tokens_step = t.global_batch_size * t.seq_len
    model_flops = flops_per_token(m, t.seq_len) * tokens_step
    # Every decoder layer's recompute mode: the model's, then the MTP modules' blocks (index num_layers + k), which
    # recompute and communicate as the model's layers do.
    modes = [recompute_mode(cfg, i) for i in range(m.num_layers + m.mtp_depth)]
    compute_s, parts = compute_time(cfg, gpu, modes, model_flops, peak, efficiency)
    # DP moves the worst pipeline rank's tp-local parameters (gathered) and gradients (reduced).
    tp_local = max(_tp_local(cfg, r) for r in range(p.pp))
    comm = traffic(cfg, gpu, gpus_per_node, modes, tp_local)
    overlapped = sum(comm[k].seconds for k in ("dp", "dp_replicate") if k in comm)
    floor_s = unhidden_dp_gb(cfg, tp_local) / comm["dp"].gbps
    data_parallel_s = max(compute_s + floor_s, overlapped)
    # CP's K/V ring hides under the attention blocks' own compute (4·seq·hidden forward FLOPs per token, 3x with
    # backward).
    attention_s = 3 * 4 * t.seq_len * m.hidden_size * tokens_step * len(modes) / world / (peak * efficiency)
    exposed_cp = max(0.0, comm["cp"].seconds - attention_s)
    # The float8 scales' all-reduce is exposed: it runs between the optimizer step and the first gather.
    scales_s = comm["float8_scales"].seconds if "float8_scales" in comm else 0.0
    parts["float8"] += scales_s
    step_s = data_parallel_s + comm["tp"].seconds + comm["pp"].seconds + exposed_cp + comm["ep"].seconds + scales_s
    parts |= {"tp": comm["tp"].seconds, "pp": comm["pp"].seconds, "cp": exposed_cp, "ep": comm["ep"].seconds}
    if cfg.optimizer.name == "muon":  # after backward, before the next forward: nothing to hide behind
        ns_peak = newton_schulz_peak_tflops(cfg, gpu) * 1e12
        comm["muon"], newton_schulz_s = muon_step(cfg, gpus_per_node, gpu, ns_peak * efficiency)
        parts["muon"] = comm["muon"].seconds + newton_schulz_s
        step_s += parts["muon"]
    parts["dp"] = data_parallel_s - compute_s
    mfu = model_flops / (step_s * world * peak)
    return StepEstimate(step_s, compute_s, tokens_step / step_s, mfu, comm, parts)


def muon_loads(cfg: Config, pp_rank: int) -> tuple[list[float], list[int], int]:
    """(Newton-Schulz FLOPs and matrix elements each rank of pipeline rank `pp_rank`'s stage owns, as `optim.muon`
    splits and assigns them; the Muon elements one rank holds)."""
    o, p = cfg.optimizer, cfg.parallelism
    split = coordinate_zero_split(p.tp, cfg.fsdp_shard_size, p.ep)
    pieces = []
    local = 0
    for stage in rank_stages(cfg, pp_rank):
        for param in stage.layers:
            if is_muon_matrix(param.name, len(param.shape), o.muon_adamw_names):
                local += split(param)[1]
                pieces += [(0, *where, param.shape[-1]) for where in logical_matrices(param.name, param.shape)]
    ranks = cfg.world_size // p.pp
    flops, owned = [0.0] * ranks, [0] * ranks
    for m in assign_owners(pieces, ranks):
        flops[m.owner] += newton_schulz_flops(*m.shape, o.muon_ns_steps)
        owned[m.owner] += m.shape[0] * m.shape[1]
    return flops, owned, local


def muon_step(cfg: Config, gpus_per_node: int, gpu: Gpu, achieved_flops: float) -> tuple[Transfer, float]:
    """Muon's two all-to-alls over a pipeline stage's ranks and the owners' Newton-Schulz seconds, for the busiest
    owner (the all-to-alls end when it is done): it sends its fp32 shards of every matrix, then the other ranks'
    shards of the updates of the whole matrices it owns (at least one: 560 matrices over 512 ranks leave a 70B
    MLP matrix's owner 1.4x the average), and receives as much. The worst pipeline rank."""
    p = cfg.parallelism
    ranks = cfg.world_size // p.pp
    worst_gb = worst_s = 0.0
    for pp_rank in range(p.pp):
        flops, owned, local = muon_loads(cfg, pp_rank)
        # Its shards but its own piece of its matrices, and those matrices but that piece (a 1/ranks share of each).
        sent = local + max(owned) * (1 - 2 / ranks) if ranks > 1 else 0
        worst_gb = max(worst_gb, FP32 * sent / 1e9)
        worst_s = max(worst_s, max(flops) / achieved_flops)
    link = ("NVLink", gpu.device.nvlink_gbps) if ranks <= gpus_per_node else ("InfiniBand", gpu.device.ib_gbps)
    return Transfer(worst_gb, *link), worst_s


def compute_time(
    cfg: Config, gpu: Gpu, modes: list[str], model_flops: float, peak: float, efficiency: float
) -> tuple[float, dict[str, float]]:
    """(seconds of compute per step, pipeline bubble included; its parts: compute for the model's FLOPs,
    recompute for the extra forward memory forced, float8 for its casts, bubble). `modes`: each layer's recompute
    mode."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    world = cfg.world_size
    tokens_step = t.global_batch_size * t.seq_len
    full = modes.count("full")
    selective = modes.count("selective")
    recompute_flops = tokens_step * full * layer_forward_flops(m, t.seq_len)  # one more forward of those layers
    if p.selective_matmuls == "every_other":  # selective reruns the k, o and up projections too
        rerun_matmuls = 2 * m.hidden_size * (m.num_kv_heads * m.head_dim + m.num_heads * m.value_dim)
        rerun_matmuls += 2 * m.hidden_size * m.intermediate_size
        recompute_flops += tokens_step * selective * rerun_matmuls
    else:
        rerun_matmuls = 0
    model_f8, recompute_f8 = float8_flops(cfg, modes, rerun_matmuls)
    f8_peak = (float8_peak_tflops(cfg, gpu) or 0.0) * 1e12

    def seconds(flops: float, f8: float) -> float:
        """Per rank: the float8 share at the float8 peak, the rest at the compute dtype's."""
        f8_s = f8 / (f8_peak * efficiency) if f8 else 0.0
        return ((flops - f8) / (peak * efficiency) + f8_s) / world

    bubble = PP_ENGINES[p.pp_engine].bubble_fraction(p.pp, t.grad_accum_steps, p.pp_stages_per_rank)
    # Selective recompute reruns element-wise ops only and float8's casts are element-wise: memory-bound, charged
    # at the GPU's memory bandwidth.
    hbm = gpu.device.hbm_gbps * 1e9
    rerun_s = tokens_step / world * selective * elementwise_rerun_bytes(cfg) / hbm
    cast_s = float8_cast_bytes(cfg, modes) / hbm
    parts = {"compute": seconds(model_flops, model_f8), "recompute": seconds(recompute_flops, recompute_f8) + rerun_s}
    parts["float8"] = cast_s
    compute_s = sum(parts.values()) * (1 + bubble)
    parts["bubble"] = compute_s - sum(parts.values())
    return compute_s, parts


def traffic(cfg: Config, gpu: Gpu, gpus_per_node: int, modes: list[str], tp_local: int) -> dict[str, Transfer]:
    """What each parallel dimension moves per step, over NVLink where its group fits in a node, else InfiniBand."""
    p = cfg.parallelism
    nvlink = ("NVLink", gpu.device.nvlink_gbps)
    ib = ("InfiniBand", gpu.device.ib_gbps)

    def link(ranks: int) -> tuple[str, float]:
        return nvlink if ranks <= gpus_per_node else ib

    comm = {
        "tp": Transfer(tp_gb(cfg, modes), *link(p.tp)),
        "pp": Transfer(pp_gb(cfg), *link(cfg.world_size)),
        "cp": Transfer(cp_gb(cfg, modes), *link(p.cp * p.tp)),
        "ep": Transfer(ep_gb(cfg, modes), *link(p.ep * p.tp)),
    }
    n_micro = cfg.training.grad_accum_steps
    shard = cfg.fsdp_shard_size
    if p.zero_stage == 0:
        comm["dp"] = Transfer(ring_gb(FP32 * tp_local, p.dp * p.cp, all_reduce=True), *link(p.dp * p.cp * p.tp))
    else:
        gathers = 2 * n_micro if p.zero_stage == 3 else 1
        reductions = n_micro if p.zero_stage >= 2 else 1
        gather_e = gathered_bytes_per_param(cfg)
        comm["dp"] = Transfer(ring_gb((gathers * gather_e + reductions * FP32) * tp_local, shard), *link(shard * p.tp))
        if cfg.dp_shard_size < p.dp:  # HSDP: the shards' gradients are all-reduced across replicas
            replicated = reductions * FP32 * tp_local / shard
            comm["dp_replicate"] = Transfer(ring_gb(replicated, p.dp // cfg.dp_shard_size, all_reduce=True), *ib)
    if fsdp_float8_all_gather(cfg):
        linears = math.ceil(len(float8_linears(cfg.model).shapes) / p.pp)
        comm["float8_scales"] = Transfer(float8_scale_gb(cfg, linears), *link(shard * p.tp))
    return comm


def tp_gb(cfg: Config, modes: list[str]) -> float:
    """TP: per layer, forward and backward each move 4 activations (2 all-gathers + 2 reduce-scatters, or 2
    all-reduces); a fully recomputed forward repeats the forward's share, a selective one its 2 all-gathers
    (sequence parallel; it keeps the reduced outputs), and with parallelism.sp_regather on a layer that is not
    recomputed gathers its attention and dense MLP inputs again in backward; plus embedding and head."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    e = element_bytes(t.dtype)
    tokens_micro = micro_tokens(cfg)
    sp = sequence_shards(cfg)
    units = 8 * len(modes) + 4 * modes.count("full") + (2 * modes.count("selective") if sp > 1 else 0)
    if regathers(cfg):
        units += sum(1 + (not is_moe_layer(m, i)) for i, mode in enumerate(modes) if mode == "none")
    tp_bytes = t.grad_accum_steps * (units / p.pp + 2) * tokens_micro * m.hidden_size * e
    return ring_gb(tp_bytes, p.tp)


def pp_gb(cfg: Config) -> float:
    """PP: each microbatch's activation forward and its gradient backward cross a stage boundary (this tp rank's
    sequence shard under sequence parallelism)."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    e = element_bytes(t.dtype)
    tokens_micro = micro_tokens(cfg)
    sp = sequence_shards(cfg)
    pp_bytes = 2 * t.grad_accum_steps * tokens_micro / sp * m.hidden_size * e if p.pp > 1 else 0
    return pp_bytes / 1e9


def cp_gb(cfg: Config, modes: list[str]) -> float:
    """CP: per layer, forward passes this rank's K/V on cp-1 times; backward passes K/V cp-1 times and their fp32
    gradients cp times; the recomputed forward repeats the forward's."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    e = element_bytes(t.dtype)
    tokens_micro = micro_tokens(cfg)
    recomputed = modes.count("full") + modes.count("selective")
    kv_block = tokens_micro * kv_bytes_per_token(m, 1)["expanded"] / p.tp  # elements; MLA: the expanded K/V
    forward = (p.cp - 1) * kv_block * e
    cp_layer = 2 * forward + p.cp * kv_block * FP32
    layers_per_rank = len(modes) / p.pp
    cp_bytes = t.grad_accum_steps * (layers_per_rank * cp_layer + recomputed / p.pp * forward) if p.cp > 1 else 0
    return cp_bytes / 1e9


def ep_gb(cfg: Config, modes: list[str]) -> float:
    """EP: per MoE layer, the token all-to-all there and back in forward, twice again in backward (and once more
    for a recomputed forward, full or selective): top_k copies of each token, (ep-1)/ep leave the rank. Not
    hidden: `parallelism.ep_overlap` hides the dispatch leg under the shared experts (up to their forward and
    backward time, `benchmarks/moe_overlap.py`), which is not credited here."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    e = element_bytes(t.dtype)
    tokens_micro = micro_tokens(cfg)
    moe = [is_moe_layer(m, i) for i in range(len(modes))]
    moe_units = sum(4 * is_moe + 2 * (is_moe and mode != "none") for is_moe, mode in zip(moe, modes)) / p.pp
    routed = m.moe.top_k * tokens_micro * m.hidden_size * e * (p.ep - 1) / p.ep
    ep_bytes = t.grad_accum_steps * moe_units * routed if p.ep > 1 else 0
    return ep_bytes / 1e9


def unhidden_dp_gb(cfg: Config, tp_local: int) -> float:
    """What no prefetch hides: the first FSDP unit's gather before any compute of a pass (ZeRO-3 frees and
    re-gathers for every microbatch's forward and backward; stages 1/2 keep the gathered parameters for the
    step) and the last unit's gradient reduction after the step's compute, one layer's worth each."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    shard = cfg.fsdp_shard_size
    unit = tp_local / max(1.0, m.num_layers / p.pp)
    if p.zero_stage == 0:
        return ring_gb(FP32 * unit, p.dp * p.cp, all_reduce=True)
    gathers = 2 * t.grad_accum_steps if p.zero_stage == 3 else 1
    return gathers * ring_gb(gathered_bytes_per_param(cfg) * unit, shard) + ring_gb(FP32 * unit, shard)


def gathered_bytes_per_param(cfg: Config) -> float:
    """Bytes FSDP all-gathers per parameter: the compute dtype's, or 1 for the float8 weights under tensorwise
    float8 (nanotron.parallel.float8: the decoder layers' linears), averaged over the model's parameters (the
    per-step scale all-reduce: `float8_scale_gb`)."""
    e = element_bytes(cfg.training.dtype)
    if not fsdp_float8_all_gather(cfg):
        return e
    lin = float8_linears(cfg.model)
    return e - (e - 1) * sum(lin.weights) / lin.params


def elementwise_rerun_bytes(cfg: Config) -> float:
    """Bytes per token that one selectively recomputed layer's rerun moves through memory: its two RMSNorms
    (fp32 cast, square, mean, scale, cast back, weight: ~8 passes of 4-byte values over the sequence shard),
    RoPE on q and k (~10 passes) and SwiGLU's silu and product (~5 passes of the intermediate width). An
    estimate: these kernels are memory-bound; their FLOPs are not in the model's."""
    m, p = cfg.model, cfg.parallelism
    e = element_bytes(cfg.training.dtype)
    sp = sequence_shards(cfg)
    norms = 2 * (8 * FP32 + 4 * e) * m.hidden_size / sp
    key_rope = m.qk_rope_head_dim if m.mla else m.num_kv_heads * m.head_dim / p.tp  # MLA: one head, every rank
    rope = 10 * e * (m.num_heads * m.rope_dim / p.tp + key_rope)
    swiglu = 5 * e * m.intermediate_size / p.tp
    return norms + rope + swiglu


def _tp_local(cfg: Config, pp_rank: int) -> int:
    p = cfg.parallelism
    split = coordinate_zero_split(p.tp, 1, p.ep)
    return sum(split(q)[0] for s in rank_stages(cfg, pp_rank) for q in s.root + s.layers)
