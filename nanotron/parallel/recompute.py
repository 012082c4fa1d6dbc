"""Activation checkpointing of decoder layers (`parallelism.recompute`, on every `recompute_every`-th layer;
a mixture-of-experts layer under selective is recomputed in full: `Config.recompute_of`).

full:      the layer keeps only its input; backward reruns its whole forward.
selective: torch's selective checkpointing with one policy: keep what is expensive to recompute (matmul and
           attention outputs, reduce-scattered sequence shards, all-reduced outputs), rerun the cheap ops (RMSNorm,
           RoPE, SiLU and products, casts) and the sequence-parallel all-gathers, whose gathered copies are then
           not kept (Megatron's re-gather in backward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.moe import MoE
from nanotron.parallel.torch_private import checkpoint_in_place, in_backward_pass, reduced_output_ops

aten = torch.ops.aten
# Outputs selective recompute keeps: what costs FLOPs or communication to produce again. All others are rerun.
KEPT = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    *reduced_output_ops(),  # sequence-parallel reduce-scatter, all_reduce's all-reduce: no collective reruns
}
if hasattr(aten, "_grouped_mm"):  # CUDA's grouped expert GEMM
    KEPT.add(aten._grouped_mm.default)


# Called with each output the policy keeps in a forward (not a recompute): how benchmarks/probe.py measures it.
on_keep: list[Callable[[object], None]] = []


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in KEPT:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for hook in on_keep:
            hook(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


def apply_recompute(model: LlamaForCausalLM, mode_of: Callable[[int], str] = lambda layer: "full") -> None:
    """Hooks the layers in place (parameter names don't change), each as `mode_of(global index)` says
    (`Config.recompute_of`): 'none', 'full' or 'selective'."""
    for name, layer in model.model.layers.items():
        mode = mode_of(int(name))
        if mode == "none":
            continue
        if mode == "selective":
            checkpoint_in_place(layer, context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
        else:
            checkpoint_in_place(layer)
        if isinstance(layer.mlp, MoE):  # its recomputed forward must not count the step's tokens again
            layer.mlp.counting = lambda: not in_backward_pass()
