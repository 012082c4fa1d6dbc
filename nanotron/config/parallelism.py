"""The [parallelism] section (the layout: degrees, ZeRO stage, pipeline engine, recompute) and [distributed]
(how long a collective may wait)."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.config.engines import PP_ENGINES
from nanotron.config.option import opt

RECOMPUTE_MODES = ("none", "selective", "full")
SP_REGATHER_MODES = ("auto", "on", "off")


@dataclass
class ParallelismConfig:
    dp: int = opt(1, "data-parallel degree (replicas x shards)", min=1)
    dp_shard: int = opt(
        0,
        "FSDP group size: ranks that share one sharded copy of the model (tp, then dp_shard, are the innermost "
        "mesh dims: keep tp*dp_shard within a node); dp/dp_shard such groups replicate it and all-reduce "
        "gradients (HSDP); 0 = dp (plain FSDP); needs zero_stage >= 1",
        min=0,
    )
    tp: int = opt(1, "tensor-parallel degree (innermost mesh dim)", min=1)
    cp: int = opt(
        1,
        "context-parallel degree: each sequence split over cp ranks (zigzag chunks, ring attention; the mesh "
        "dim next to tp); FSDP shards over dp x cp; training.seq_len must be divisible by 2*cp",
        min=1,
    )
    ep: int = opt(
        1,
        "expert-parallel degree (MoE): each MoE layer's experts split over ep ranks carved out of dp x cp (ep "
        "divides dp x cp, it adds no ranks); tokens reach their experts by all-to-all; expert weights are "
        "FSDP-sharded over the remaining dp x cp / ep ranks",
        min=1,
    )
    ep_overlap: bool = opt(
        True,
        "with ep > 1, compute each MoE layer's shared experts while its tokens travel to their experts (the "
        "dispatch all-to-all started asynchronously, waited after them; in backward, their backward under the "
        "tokens' gradients' way back): the same results, the transfer hidden behind the shared experts' GEMMs; "
        "no effect without shared experts",
    )
    pp: int = opt(1, "pipeline-parallel degree", min=1)
    pp_engine: str = opt("1f1b", "pipeline schedule", tuple(PP_ENGINES))
    pp_stages_per_rank: int = opt(2, "virtual stages per rank for interleaved_1f1b/zero_bubble", min=1)
    tp_mode: str = opt(
        "reduce_scatter",
        "all_reduce (Megatron TP) or reduce_scatter (sequence parallel)",
        ("all_reduce", "reduce_scatter"),
    )
    tp_linear_async_communication: bool = opt(False, "async TP (CUDA, training.compile, tp_mode=reduce_scatter)")
    sp_regather: str = opt(
        "auto",
        "sequence parallelism (tp_mode=reduce_scatter, eager): keep each layer's gathered norm outputs as the rank's "
        "shard and all-gather them again in backward (on: 2 x hidden x (1 - 1/tp) fewer bytes per token per layer, "
        "2 more all-gathers per layer in backward), or keep them gathered (off: the faster); auto: on only where "
        "the plan of this config on this device does not fit with its 10% margin without it (off on CPU)",
        SP_REGATHER_MODES,
    )
    zero_stage: int = opt(
        0,
        "0 replicate (DDP); 1 shard params + optimizer state, reduce gradients once per step; 2 also "
        "reduce-scatter gradients every microbatch (keep only the shard); 3 also free params after forward",
        (0, 1, 2, 3),
    )
    recompute: str = opt(
        "none",
        "activation checkpointing of decoder layers: none; full (keep each layer's input, rerun its forward in "
        "backward); selective (keep matmul, attention and reduce-scatter outputs, rerun the norms, RoPE, SwiGLU's "
        "element-wise ops and the sequence all-gathers)",
        RECOMPUTE_MODES,
    )
    selective_matmuls: str = opt(
        "all",
        "which matmul outputs recompute='selective' keeps in each layer: all; or every_other (the 1st, 3rd, 5th and "
        "7th of the layer's forward: q, v, gate and down kept, k, o and up rerun in backward; torchtitan's op-level "
        "policy: less memory for 3 more matmuls per layer); the other recompute modes ignore it",
        ("all", "every_other"),
    )
    recompute_every: int = opt(
        1, "apply parallelism.recompute to every k-th decoder layer (layers 0, k, 2k, ...); the others keep all", min=1
    )

    def recompute_of(self, layer: int) -> str:
        """How decoder layer `layer` (global index) is checkpointed: 'none', 'full' or 'selective'."""
        return self.recompute if layer % self.recompute_every == 0 else "none"


@dataclass
class DistributedConfig:
    timeout_minutes: float = opt(
        30.0,
        "a collective waiting longer than this fails the job (NCCL watchdog, gloo), once training runs",
        min=0.1,
        max=1e6,
    )
    startup_timeout_minutes: float = opt(
        120.0,
        "the same limit until the first step is done: checkpoint loading, compilation and the first step's "
        "collectives may keep the other ranks waiting that long",
        min=0.1,
        max=1e6,
    )


def fsdp_wraps(data_parallel_size: int, dtype: str) -> bool:
    """Whether FSDP2 wraps a model whose parameters `data_parallel_size` ranks (dp x cp) hold: not one rank in
    fp32, where there is nothing to shard, reduce or cast, and FSDP's per-layer hooks and parameter copies cost ~6 %
    of a small CPU step (configs/tiny.toml's 0.43 s against 0.405 s, the same losses). bf16 keeps it: its mixed
    precision is FSDP's. (Expert weights' FSDP group, dp x cp / ep, is never larger.)"""
    return data_parallel_size > 1 or dtype != "float32"
