"""The plan as text: a layout's memory table, fit verdict and step time (`describe`), the `--search` ranking and
the `--check` table; what `nanotron plan` prints and the Slurm launcher checks before it submits."""

from __future__ import annotations

import copy
from dataclasses import replace

from nanotron.config import Config, ParallelismConfig
from nanotron.errors import ConfigError
from nanotron.models.shapes import active_params, element_bytes, flops_per_token, num_params
from nanotron.parallel.regather import can_regather, regathers
from nanotron.plan.float8 import float8_linears
from nanotron.plan.memory import GIB, PARTS, stage_memory, worst_stage
from nanotron.plan.search import (
    MEMORY_MARGIN,
    RECOMPUTE_CHOICES,
    Candidate,
    choose_sp_regather,
    is_tight,
    reserve_bytes,
    search,
    shown_seconds,
    sp_regather_line,
    usable_bytes,
    with_sp_regather,
)
from nanotron.plan.timing import (
    Gpu,
    StepEstimate,
    estimate_step,
    float8_peak_tflops,
    gathered_bytes_per_param,
    peak_tflops,
)

ASSUMPTIONS = (
    "assumptions: compute at {eff:.0%} of the {peak:g} TFLOP/s {mode} peak ({source}); FSDP/DP collectives overlap "
    "compute (but the first unit's gather of each pass and the last unit's reduction), TP and PP "
    "transfers are exposed, the cp K/V ring is exposed only beyond the attention it overlaps; ring collectives at "
    "{nvlink:g} GB/s per GPU over NVLink inside a node, {ib:g} GB/s over InfiniBand across nodes; reserve "
    "{reserve:.1f} GiB per GPU for CUDA context, NCCL and fragmentation"
)


def for_gpu(cfg: Config, gpu: Gpu) -> Config:
    """cfg with parallelism.sp_regather as a run on `gpu` resolves it (`choose_sp_regather`): what the plan plans."""
    return with_sp_regather(cfg, choose_sp_regather(cfg, gpu.device.memory_gib)[0])


def describe(cfg: Config, gpu: Gpu, nodes: int, gpus_per_node: int, efficiency: float) -> list[str]:
    """The plan of cfg's layout: memory per part for each pipeline rank, the verdict, step time and MFU."""
    asked, cfg = cfg, for_gpu(cfg, gpu)
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    dp = f"dp={p.dp}" + (f" (HSDP {p.dp // cfg.dp_shard_size}x{cfg.dp_shard_size})" if cfg.dp_shard_size < p.dp else "")
    dp += f" cp={p.cp}" if p.cp > 1 else ""
    dp += f" ep={p.ep}" if p.ep > 1 else ""
    float8 = f" float8={t.float8}" if t.float8 != "off" else ""
    params = f"{num_params(m) / 1e9:.2f}B params"
    params += f" ({active_params(m) / 1e9:.2f}B active)" if m.moe.enabled else ""
    lines = [
        f"model {params} | {dp} tp={p.tp} pp={p.pp} ({p.pp_engine}) zero_stage={p.zero_stage}"
        f" recompute={recompute_label(p)} {t.dtype}{float8} | {cfg.world_size} of {nodes}x{gpus_per_node} GPUs "
        f"({gpu.name}, {gpu.device.memory_gib:g} GiB)",
        f"global batch {t.global_batch_size} x {t.seq_len} tokens = micro_batch_size {t.micro_batch_size} x "
        f"{t.grad_accum_steps} microbatches x dp {p.dp}",
        "",
        "memory per GPU in GiB, worst rank of each pipeline stage:",
        "| pp rank | " + " | ".join(label for _, label in PARTS) + " | total | fits |",
        "|" + "---|" * (len(PARTS) + 3),
    ]
    usable = usable_bytes(gpu)
    for pp_rank in range(p.pp):
        mem = stage_memory(cfg, pp_rank)
        cells = " | ".join(f"{mem[key] / GIB:.2f}" for key, _ in PARTS)
        fits = "yes" if mem["total"] <= usable else "NO"
        lines.append(f"| {pp_rank} | {cells} | {mem['total'] / GIB:.2f} | {fits} |")
    pp_rank, worst = worst_stage(cfg)
    by_mode = []
    for mode, matmuls in RECOMPUTE_CHOICES:
        other = copy.deepcopy(cfg)
        other.parallelism.recompute = mode
        other.parallelism.selective_matmuls = matmuls
        label = recompute_label(other.parallelism, every=False)
        by_mode.append(f"{stage_memory(other, pp_rank)['activations'] / GIB:.2f} GiB {label}")
    every = f" (on every {p.recompute_every}th layer)" if p.recompute_every > 1 else ""
    lines += [
        f"activations on pp rank {pp_rank} by parallelism.recompute{every}: {', '.join(by_mode)} "
        f"({worst['flights']:g} microbatches in flight)",
        *regather_lines(asked, gpu, gpus_per_node, efficiency),
        fit_line(cfg, gpu),
        "",
    ]
    step = estimate_step(cfg, gpu, gpus_per_node, efficiency)
    comm = ", ".join(
        f"{name} {t.gb:.2f} GB/GPU over {t.link} {t.seconds:.3f}s"
        for name, t in step.comm.items()
        if t.gb and name != "float8_scales"
    )
    spread = ""
    e = gpu.efficiency
    if e.low is not None and e.high is not None and e.low <= efficiency <= e.high:
        fast, slow = (estimate_step(cfg, gpu, gpus_per_node, x).step_s for x in (e.high, e.low))
        spread = f" (range {fast:.2f}-{slow:.2f}s at the published runs' efficiencies {e.low:g}-{e.high:g})"
    mode, peak = peak_tflops(cfg, gpu)
    lines += [
        f"step time ~{step.step_s:.2f}s{spread} (compute {step.compute_s:.2f}s incl. pipeline bubble; communication "
        f"per step: {comm or 'none'}) "
        f"-> {step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1%}",
        *float8_lines(cfg, gpu, gpus_per_node, efficiency, step),
        ASSUMPTIONS.format(
            eff=efficiency,
            source=gpu.efficiency.source if efficiency == gpu.efficiency.default else "--efficiency",
            peak=peak,
            mode=mode,
            nvlink=gpu.device.nvlink_gbps,
            ib=gpu.device.ib_gbps,
            reserve=reserve_bytes(gpu) / GIB,
        ),
    ]
    return lines


def float8_lines(cfg: Config, gpu: Gpu, gpus_per_node: int, efficiency: float, step: StepEstimate) -> list[str]:
    """Under training.float8: what runs in float8 and at which peak, what stays in the compute dtype, what the casts
    and the FSDP gathers cost, and the step without float8."""
    t, m = cfg.training, cfg.model
    if t.float8 == "off":
        return []
    lin = float8_linears(m)
    share = 6 * sum(lin.weights) / flops_per_token(m, t.seq_len)
    kept = "the embedding, head, attention's SDPA" + (", MoE routers and experts" if m.moe.enabled else "")
    kept += f", {lin.kept} decoder-layer linears with a dimension not a multiple of 16" if lin.kept else ""
    off = estimate_step(replace(cfg, training=replace(t, float8="off")), gpu, gpus_per_node, efficiency)
    gather, casts_s = "", step.parts["float8"]
    if "float8_scales" in step.comm:
        casts_s -= step.comm["float8_scales"].seconds
        gather = (
            f"; FSDP gathers {gathered_bytes_per_param(cfg):.2f} bytes per parameter instead of "
            f"{element_bytes(t.dtype)}, and all-reduces the scales once per step "
            f"({step.comm['float8_scales'].gb * 1e9:,.0f} bytes per GPU)"
        )
    return [
        f"float8 ({t.float8}): {len(lin.shapes)} decoder-layer linears, {share:.0%} of the model's FLOPs, at "
        f"{efficiency:.0%} of the {float8_peak_tflops(cfg, gpu):g} TFLOP/s e4m3 peak; kept in {t.dtype}: {kept}; "
        f"casts {casts_s:.3f}s per step at {gpu.device.hbm_gbps:g} GB/s HBM{gather}; without float8: step "
        f"~{off.step_s:.2f}s ({off.step_s / step.step_s:.2f}x float8's); MFU against the {t.dtype} peak "
        "(float8 has no single peak)"
    ]


def regather_lines(cfg: Config, gpu: Gpu, gpus_per_node: int, efficiency: float) -> list[str]:
    """Where the sequence-parallel re-gather can act: the setting the plan takes, and the worst rank's memory and
    the step time with it on and off."""
    if not can_regather(cfg):
        return []
    costs = []
    for on in (True, False):
        other = with_sp_regather(cfg, on)
        memory = worst_stage(other)[1]["total"] / GIB
        step = estimate_step(other, gpu, gpus_per_node, efficiency).step_s
        costs.append(f"{'on' if on else 'off'} {memory:.2f} GiB, step {step:.3f}s")
    return [f"{sp_regather_line(cfg, *choose_sp_regather(cfg, gpu.device.memory_gib))}: {'; '.join(costs)}"]


HINTS = {
    "params": "shard them: zero_stage >= 1, a larger dp_shard, more tp or pp",
    "grads": "zero_stage 2 or 3 keeps only the gradient shard; or more tp or pp",
    "optimizer": "shard it: zero_stage >= 1, a larger dp_shard, more tp or pp",
    "working": "zero_stage=3 frees gathered parameters after forward; or more tp or pp",
    "activations": "parallelism.recompute='selective' (or 'full'), a smaller micro_batch_size, or more tp/pp",
    "logits": "a smaller micro_batch_size or more tp",
    "buffers": "fewer microbatches (global_batch_size) or a larger micro_batch_size",
    "rope": "a smaller model.max_seq_len (the tables' rows), or cp > 1 (a rank keeps its seq_len / cp rows)",
}


def fit_line(cfg: Config, gpu: Gpu) -> str:
    """One line: the worst rank's total against the device, and when it does not fit, the largest part."""
    cfg = for_gpu(cfg, gpu)
    pp_rank, mem = worst_stage(cfg)
    total, usable = mem["total"] / GIB, usable_bytes(gpu) / GIB
    where = f" (pp rank {pp_rank})" if cfg.parallelism.pp > 1 else ""
    if mem["total"] <= usable_bytes(gpu):
        line = f"memory: fits: {total:.1f} GiB per GPU{where} of {usable:.1f} GiB usable on {gpu.name}"
        if is_tight(mem["total"], gpu):
            line += f" (tight: less than the plan's {MEMORY_MARGIN:.0%} margin to spare; it may not fit)"
        return line
    key, label = max(PARTS, key=lambda part: mem[part[0]])
    return (
        f"memory: does not fit: {total:.1f} GiB per GPU{where} but {usable:.1f} GiB usable on {gpu.name}; largest "
        f"part: {label} {mem[key] / GIB:.1f} GiB ({HINTS[key]})"
    )


def recompute_label(p: ParallelismConfig, every: bool = True) -> str:
    """'selective(every_other)' for selective keeping every other matmul; '/k' on every k-th layer."""
    label = p.recompute + ("(every_other)" if p.recompute == "selective" and p.selective_matmuls != "all" else "")
    return label + (f"/{p.recompute_every}" if every and p.recompute != "none" and p.recompute_every > 1 else "")


def fits(cfg: Config, gpu: Gpu) -> bool:
    return worst_stage(for_gpu(cfg, gpu))[1]["total"] <= usable_bytes(gpu)


def search_table(cfg: Config, world: int, gpu: Gpu, gpus_per_node: int, efficiency: float, top: int) -> list[str]:
    found, considered = search(cfg, world, gpus_per_node, gpu, efficiency)
    lines = [
        f"{len(found)} of {considered} valid layouts fit {world} x {gpu.name} (each with the least recompute that "
        f"fits with a {MEMORY_MARGIN:.0%} memory margin) at global batch "
        f"{cfg.training.global_batch_size} x {cfg.training.seq_len}; fastest first, tight ones last:",
        "| # | dp | dp_shard | cp | ep | tp | pp | zero | recompute | micro batch | accum | memory GiB | step s "
        "| tokens/s | MFU | traffic GB | limit | within error | sp_regather | float8 |",
        "|" + "---|" * 20,
    ]
    error = gpu.efficiency.error if efficiency == gpu.efficiency.default else None
    best = shown_seconds(found[0].step.step_s) if found else 0.0  # compared as shown
    for index, c in enumerate(found[:top], 1):
        equivalent = "?" if error is None else ("yes" if shown_seconds(c.step.step_s) <= best * (1 + error) else "no")
        p, t = c.cfg.parallelism, c.cfg.training
        lines.append(
            f"| {index} | {p.dp} | {c.cfg.dp_shard_size} | {p.cp} | {p.ep} | {p.tp} | {p.pp} | {p.zero_stage} | "
            f"{recompute_label(p)} | {t.micro_batch_size} | {t.grad_accum_steps} | "
            f"{c.memory['total'] / GIB:.1f}{' tight' if c.tight else ''} | {shown_seconds(c.step.step_s):g} | "
            f"{c.step.tokens_per_s:,.0f} | "
            f"{c.step.mfu:.1%} | {c.step.traffic_gb:,.1f} | {_limit(c)} | {equivalent} | {_regather(c.cfg)} | "
            f"{t.float8} |"
        )
    lines.append(
        f"tight: less than {MEMORY_MARGIN:.0%} of the usable memory to spare (the plan is 0.85-1.02x of published "
        "peaks): listed only where no safer recompute fits; "
        "accum: microbatches per step; traffic: GB each GPU sends per step, hidden or not (equal step times rank "
        "by it, then by memory); limit: what bounds the layout: compute, or the largest cost beyond the model's "
        "FLOPs (bubble, recompute = the memory that forced it, or exposed tp/pp/cp/ep/dp traffic); within error: "
        "step time within the planner's error on published runs of this GPU of the best row's "
        + (f"(+{error:.0%}): the plan cannot tell these apart" if error is not None else "(? = not calibrated)")
        + "; sp_regather: the sequence-parallel norm outputs kept as shards and gathered again in backward (on: "
        "less memory, 2 more all-gathers per layer), or kept gathered (off); - where there is nothing to re-gather; "
        "float8: training.float8 (where the config sets a recipe, each layout is planned with it and off)"
    )
    return lines


def _regather(cfg: Config) -> str:
    return ("on" if regathers(cfg) else "off") if can_regather(cfg) else "-"


def _limit(c: Candidate) -> str:
    limit = c.step.limit
    return f"{limit} {c.step.parts[limit] / c.step.step_s:.0%}" if limit != "compute" else "compute"


def check_table(cfg: Config) -> list[str]:
    from nanotron.plan.check import check_ranks

    results = check_ranks(cfg)
    lines = [
        f"--check: built {len(results)} distinct ranks of {cfg.world_size} on a fake process group:",
        "| rank | pp | dp | cp | tp | parameter bytes built | formula | equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = "yes" if r.built_bytes == r.formula_bytes else "NO"
        lines.append(
            f"| {r.rank} | {r.pp_rank} | {r.dp_rank} | {r.cp_rank} | {r.tp_rank} | {r.built_bytes} | "
            f"{r.formula_bytes} | {same} |"
        )
    if any(r.built_bytes != r.formula_bytes for r in results):
        raise ConfigError("plan --check: the built parameter shards differ from the formula:\n" + "\n".join(lines))
    return lines
