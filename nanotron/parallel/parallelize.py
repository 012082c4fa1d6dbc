"""Turns the plain model into this rank's parallel pieces, in a fixed order: pipeline split -> float8 linears ->
TP/SP plan ->
context parallelism (ring attention, global positions) -> expert parallelism (all-to-all) -> activation
checkpointing -> compile -> FSDP/replicate -> per-shard init. Parameter names (FQNs) never change, so
checkpoints and HF names don't depend on the layout."""

from __future__ import annotations

import functools

import torch
from torch import nn

from nanotron.config import Config
from nanotron.console import say
from nanotron.models.llama import LlamaForCausalLM, decoder_layers
from nanotron.parallel.context import apply_context_parallel
from nanotron.parallel.expert import apply_expert_parallel, use_grouped_gemm
from nanotron.parallel.float8 import check_float8, convert_to_float8, float8_tp_collectives
from nanotron.parallel.fsdp import apply_fsdp
from nanotron.parallel.init import init_weights
from nanotron.parallel.mesh import ParallelContext, data_parallel_mesh, expert_data_mesh
from nanotron.parallel.overlap import async_tp_unavailable
from nanotron.parallel.pipeline import split_model
from nanotron.parallel.recompute import apply_recompute, recompute_mode
from nanotron.parallel.regather import apply_regather, regathers
from nanotron.parallel.tensor import apply_tensor_parallel
from nanotron.parallel.torch_private import enable_inductor_async_tp


def parallelize(cfg: Config, ctx: ParallelContext) -> list[tuple[int, nn.Module]]:
    """(global pipeline stage index, module) for every stage this rank runs, sharded but still on the meta
    device: no memory is allocated, so `nanotron plan --check` can build any rank of any world size."""
    p = cfg.parallelism
    mode_of = functools.partial(recompute_mode, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    stages = split_model(model, cfg, ctx.pp_rank) if p.pp > 1 else [(0, model)]
    float8 = cfg.training.float8 != "off"
    if float8:
        check_float8(cfg, ctx.device)
    for _, module in stages:
        if float8:  # before TP and FSDP, which shard torchao's float8 weights and gather them in float8
            convert_to_float8(module, cfg, ctx.device)
        if p.tp > 1:
            sequence_parallel = p.tp_mode == "reduce_scatter"
            apply_tensor_parallel(module, ctx.mesh["tp"], sequence_parallel, float8_tp_collectives(cfg, ctx.device))
        if p.cp > 1:
            apply_context_parallel(module, ctx.mesh["cp"].get_group(), p.cp, ctx.cp_rank, cfg.training.seq_len)
        if p.ep > 1:
            apply_expert_parallel(module, ctx.expert_mesh["ep"], p.ep_overlap)
        if ctx.device.type == "cuda":
            use_grouped_gemm(module)
        if p.recompute != "none":
            apply_recompute(module, mode_of, cfg.parallelism.selective_matmuls)
        if regathers(cfg):
            apply_regather(module, lambda layer: mode_of(layer) != "none")
        if cfg.training.compile:
            for _, layer in decoder_layers(module):  # the MTP modules' blocks too
                layer.compile()
        experts = expert_data_mesh(ctx.mesh, ctx.expert_mesh) if ctx.expert_mesh is not None else None
        apply_fsdp(module, data_parallel_mesh(ctx.mesh), p.zero_stage, cfg.training.dtype, experts)
    return stages


def build_model(cfg: Config, ctx: ParallelContext, initialize: bool = True) -> list[tuple[int, nn.Module]]:
    """This rank's stages, on its device; randomly initialised unless `initialize` is False (a checkpoint
    load is about to overwrite every weight: drawing them would only cost start-up time).

    No rank ever holds more than its own shards plus one full tensor at a time during init.
    """
    enable_async_tp(cfg, ctx)
    stages = parallelize(cfg, ctx)
    for _, module in stages:
        module.to_empty(device=ctx.device)
        if initialize:
            init_weights(module, cfg.job.seed)
        else:
            module.init_buffers(ctx.device)
    return stages


def enable_async_tp(cfg: Config, ctx: ParallelContext) -> None:
    """parallelism.tp_linear_async_communication: lets inductor overlap the sequence-parallel collectives with
    the matmuls (micro-pipelined TP over symmetric memory), or says on rank 0 why it can't here."""
    if not cfg.parallelism.tp_linear_async_communication:
        return
    reason = async_tp_unavailable(cfg, ctx.device.type)
    if reason is None:
        enable_inductor_async_tp()
    elif ctx.rank == 0:
        say(f"warning: parallelism.tp_linear_async_communication: {reason}; using synchronous TP")
