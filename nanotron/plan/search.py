"""`nanotron plan --search`: every layout of a cluster that passes the config checks, estimated and ranked."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from nanotron.config import Config, validate
from nanotron.errors import ConfigError
from nanotron.parallel.regather import can_regather
from nanotron.plan.float8 import float8_tp_fits
from nanotron.plan.memory import GIB, shared_model, worst_stage
from nanotron.plan.timing import Gpu, StepEstimate, estimate_step, float8_peak_tflops

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
# Against 15 published peaks the plan's worst rank is 0.85-1.02x (median 0.91x): a layout whose plan leaves less
# than this share of the usable memory free is tight, kept only where nothing safer exists and ranked last.
MEMORY_MARGIN = 0.10


@dataclass
class Candidate:
    cfg: Config
    pp_rank: int  # the pipeline rank needing the most memory
    memory: dict[str, float]
    step: StepEstimate
    tight: bool = False  # fits, but within MEMORY_MARGIN of the usable memory


def divisors(n: int) -> list[int]:
    """In O(sqrt n): a search of a large cluster takes the divisors of its GPU count many times."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def layouts(base: Config, world: int, gpus_per_node: int) -> Iterator[Config]:
    """(dp, dp_shard, cp, tp, pp, zero_stage, recompute, micro_batch_size, ep, float8) over `world` GPUs at the base
    config's global batch: tp within a node, HSDP shard groups that fit in a node beside tp, cp from 1 up to
    the sequence's limit, float8 as the base sets it and off (`float8_options`), and only combinations the trainer
    itself would accept (the same `validate`, and float8's tp shapes)."""
    for tp in divisors(gpus_per_node):
        for cp in [c for c in divisors(world // tp) if c <= MAX_CP] if world % tp == 0 else []:
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if base.training.global_batch_size % dp == 0:  # what validate requires: skip its ~100 variants
                    yield from _variants(base, world, gpus_per_node, dp, cp, tp, pp)


# (parallelism.recompute, selective_matmuls), least recompute first: each keeps less and reruns more.
RECOMPUTE_CHOICES = (("none", "all"), ("selective", "all"), ("selective", "every_other"), ("full", "all"))
MAX_CP = 32  # 128k tokens at 4k per rank; beyond it the ring's latency dominates


def _variants(base: Config, world: int, gpus_per_node: int, dp: int, cp: int, tp: int, pp: int) -> Iterator[Config]:
    for zero in (0, 1, 2, 3):
        hsdp = [d for d in divisors(dp) if 1 < d < dp and d * cp * tp <= gpus_per_node] if zero else []
        for dp_shard in [0, *hsdp]:
            for recompute, matmuls in RECOMPUTE_CHOICES:
                for micro in MICRO_BATCH_SIZES:
                    for ep in expert_degrees(base, dp * cp):
                        # Only parallelism and training differ between candidates: the other sections (the model
                        # among them, already resolved) are shared, not deep-copied (thousands of candidates).
                        parallelism = replace(
                            base.parallelism,
                            dp=dp,
                            cp=cp,
                            tp=tp,
                            pp=pp,
                            ep=ep,
                            dp_shard=dp_shard,
                            zero_stage=zero,
                            recompute=recompute,
                            recompute_every=1,
                            selective_matmuls=matmuls,
                        )
                        for float8 in float8_options(base):
                            # grad_accum_steps 0: validate derives it from the global batch.
                            training = replace(base.training, micro_batch_size=micro, grad_accum_steps=0, float8=float8)
                            cfg = replace(base, parallelism=parallelism, training=training)
                            try:
                                validate(cfg, world)
                            except ConfigError:
                                continue
                            if float8 == "off" or float8_tp_fits(cfg):
                                yield cfg


def float8_options(base: Config) -> tuple[str, ...]:
    """training.float8 for the search's candidates: the base's recipe and off where it sets one (float8 changes the
    numbers, so a search never turns it on unasked; where it is on, the table shows what off would cost); off."""
    return (base.training.float8, "off") if base.training.float8 != "off" else ("off",)


def expert_degrees(base: Config, dp_cp: int) -> list[int]:
    """ep for a mixture of experts: every divisor of dp x cp that divides the experts (1 for a dense model)."""
    experts = base.model.moe.num_experts
    return [e for e in divisors(dp_cp) if experts % e == 0] if experts else [1]


def search(base: Config, world: int, gpus_per_node: int, gpu: Gpu, efficiency: float) -> tuple[list[Candidate], int]:
    """(layouts that fit, fastest first, tight ones last; how many layouts were considered).

    Of the recompute modes of one layout only the first that fits with the memory margin is kept (none, then
    none with the sequence-parallel re-gather where the base's parallelism.sp_regather is auto, selective,
    selective keeping every other matmul, then full: each is slower than the one before and buys only memory
    that the fitting one does not need); where none does, the first that fits at all, marked tight."""
    float8_peak_tflops(base, gpu)  # float8 on a GPU without float8 matmuls: the one-line refusal, before any work
    chosen: dict[tuple, Candidate] = {}
    considered = 0
    with shared_model():  # every candidate shares base.model (see _variants), unchanged during the search
        for layout_cfg in layouts(base, world, gpus_per_node):
            considered += 1
            for cfg in sp_regather_options(layout_cfg):
                p, t = cfg.parallelism, cfg.training
                layout = (p.dp, cfg.dp_shard_size, p.cp, p.ep, p.tp, p.pp, p.zero_stage, t.micro_batch_size, t.float8)
                if layout in chosen and not chosen[layout].tight:
                    break
                pp_rank, memory = worst_stage(cfg)
                tight = is_tight(memory["total"], gpu)
                if memory["total"] > usable_bytes(gpu) or (layout in chosen and tight):
                    continue  # does not fit, or no better than the tight mode already chosen
                step = estimate_step(cfg, gpu, gpus_per_node, efficiency)
                chosen[layout] = Candidate(cfg, pp_rank, memory, step, tight)
    # Equal step times (communication hidden under compute) rank by what is measurable beyond them: the traffic
    # each GPU sends per step (hidden collectives still contend for links and SMs), then the memory headroom.
    fitting = sorted(
        chosen.values(),
        key=lambda c: (c.tight, shown_seconds(c.step.step_s), round(c.step.traffic_gb, 1), c.memory["total"]),
    )
    return fitting, considered


def with_sp_regather(cfg: Config, on: bool) -> Config:
    return replace(cfg, parallelism=replace(cfg.parallelism, sp_regather="on" if on else "off"))


def sp_regather_options(cfg: Config) -> list[Config]:
    """The settings of parallelism.sp_regather a search plans for one candidate, the faster first: under 'auto'
    where it can act, off then on; else the candidate as set."""
    if cfg.parallelism.sp_regather == "auto" and can_regather(cfg):
        return [with_sp_regather(cfg, False), with_sp_regather(cfg, True)]
    return [cfg]


def choose_sp_regather(cfg: Config, memory_gib: float | None) -> tuple[bool, str]:
    """(whether the model re-gathers the sequence-parallel norm outputs in backward, why): as set, or under 'auto'
    on only where the plan of this config does not keep the memory margin on a device of `memory_gib` without
    it (it saves memory at the price of 2 all-gathers per layer in backward); unknown memory (CPU): off."""
    setting = cfg.parallelism.sp_regather
    if not can_regather(cfg):
        return False, (
            "does not apply: it needs tp > 1, tp_mode='reduce_scatter', training.compile=false and a layer that is "
            "not recomputed"
        )
    if setting != "auto":
        return setting == "on", "as set"
    if memory_gib is None:
        return False, "device memory unknown: off is the faster"
    budget = (1 - MEMORY_MARGIN) * device_usable_bytes(memory_gib)
    off = worst_stage(with_sp_regather(cfg, False))[1]["total"]
    usable = f"{device_usable_bytes(memory_gib) / GIB:.1f} GiB usable, {MEMORY_MARGIN:.0%} margin"
    if off <= budget:
        return False, f"the plan fits without it: {off / GIB:.1f} GiB of {usable}"
    on = worst_stage(with_sp_regather(cfg, True))[1]["total"]
    return True, f"activations are the limit: {off / GIB:.1f} GiB without it, {on / GIB:.1f} GiB with it, of {usable}"


def sp_regather_line(cfg: Config, on: bool, why: str) -> str:
    """The decision as start-up and `nanotron plan` say it: 'parallelism.sp_regather=auto -> off (why)'."""
    return f"parallelism.sp_regather={cfg.parallelism.sp_regather} -> {'on' if on else 'off'} ({why})"


def is_tight(total_bytes: float, gpu: Gpu) -> bool:
    """Fits, but with less than MEMORY_MARGIN of the usable memory to spare: the plan's own error could use it."""
    return total_bytes > (1 - MEMORY_MARGIN) * usable_bytes(gpu)


def shown_seconds(seconds: float) -> float:
    """A step time to 3 significant digits: how the table shows it, and what counts as equal when ranking
    (differences below that are under the model's own error)."""
    return float(f"{seconds:.3g}")


def reserve_bytes(gpu: Gpu) -> float:
    return gpu.device.memory_gib * 2**30 - usable_bytes(gpu)


def usable_bytes(gpu: Gpu) -> float:
    return device_usable_bytes(gpu.device.memory_gib)


def device_usable_bytes(memory_gib: float) -> float:
    """A device's memory less what is kept free for the CUDA context, NCCL and allocator fragmentation: 5% of it,
    at least 2 GiB."""
    return (memory_gib - max(2.0, 0.05 * memory_gib)) * 2**30
