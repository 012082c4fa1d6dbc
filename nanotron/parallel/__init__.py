"""Turns the plain model into this rank's parallel pieces, in the order of DESIGN.md contract 3:
pipeline split -> TP/SP plan -> activation checkpointing -> compile -> FSDP/replicate -> init."""

from __future__ import annotations

import torch
from torch import nn

from nanotron.config import Config
from nanotron.distributed import ParallelContext, data_parallel_mesh
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.fsdp import apply_fsdp
from nanotron.parallel.init import init_weights
from nanotron.parallel.pipeline import split_model
from nanotron.parallel.recompute import apply_recompute
from nanotron.parallel.tensor import apply_tensor_parallel


def async_tp_unavailable(cfg: Config, device: torch.device) -> str | None:
    """Why parallelism.tp_linear_async_communication can't take effect here (None: it can).

    Async TP is inductor's micro-pipelining of sequence parallelism: it splits each all-gather before a
    column-parallel matmul and each reduce-scatter after a row-parallel one into chunks that overlap the
    matmul. Plain Megatron TP (all_reduce) has neither pattern, so there it would overlap nothing.
    """
    p = cfg.parallelism
    if p.tp == 1:
        return "async TP needs tp > 1"
    if p.tp_mode == "all_reduce":
        return (
            "with tp_mode='all_reduce' async TP has nothing to overlap (it overlaps the all-gathers and "
            "reduce-scatters of tp_mode='reduce_scatter' with the matmuls); use tp_mode='reduce_scatter'"
        )
    if not cfg.training.compile:
        return "async TP is an inductor pass: it needs training.compile=true"
    if device.type != "cuda":
        return "async TP needs CUDA (symmetric memory)"
    return None


def enable_async_tp(ctx: ParallelContext) -> None:
    """Lets inductor overlap TP collectives with matmuls (micro-pipelined TP over symmetric memory)."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(ctx.mesh["tp"].get_group().group_name)


def parallelize(cfg: Config, ctx: ParallelContext) -> list[tuple[int, nn.Module]]:
    """(global pipeline stage index, module) for every stage this rank runs, sharded but still on the meta
    device: no memory is allocated, so `nanotron plan --check` can build any rank of any world size."""
    p = cfg.parallelism
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    stages = split_model(model, cfg, ctx.pp_rank) if p.pp > 1 else [(0, model)]
    for _, module in stages:
        if p.tp > 1:
            apply_tensor_parallel(module, ctx.mesh["tp"], sequence_parallel=p.tp_mode == "reduce_scatter")
        if p.recompute_layer:
            apply_recompute(module)
        if cfg.training.compile:
            for layer in module.model.layers.values():
                layer.compile()
        apply_fsdp(module, data_parallel_mesh(ctx.mesh), p.zero_stage, cfg.training.dtype)
    return stages


def build_model(cfg: Config, ctx: ParallelContext, initialize: bool = True) -> list[tuple[int, nn.Module]]:
    """This rank's stages, on its device; randomly initialised unless `initialize` is False (a checkpoint
    load is about to overwrite every weight: drawing them would only cost start-up time).

    No rank ever holds more than its own shards plus one full tensor at a time during init.
    """
    stages = parallelize(cfg, ctx)
    for _, module in stages:
        module.to_empty(device=ctx.device)
        if initialize:
            init_weights(module, cfg.job.seed)
        else:
            module.init_buffers(ctx.device)
    return stages
