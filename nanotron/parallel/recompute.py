"""Activation checkpointing of decoder layers (`parallelism.recompute`, on every `recompute_every`-th layer;
a mixture-of-experts layer under selective is recomputed in full: `recompute_mode`).

full:      the layer keeps only its input; backward reruns its whole forward.
selective: torch's selective checkpointing with one policy: keep what is expensive to recompute (matmul and
           attention outputs, reduce-scattered sequence shards, all-reduced outputs), rerun the cheap ops (RMSNorm,
           RoPE, SiLU and products, casts) and the sequence-parallel all-gathers, whose gathered copies are then
           not kept (Megatron's re-gather in backward). With `parallelism.selective_matmuls = "every_other"`
           only the odd-numbered matmuls of each layer's forward keep their outputs (q, v, gate, down); the even
           ones (k, o, up) rerun with the cheap ops: torchtitan's op-level policy. The count starts at 0 in
           each forward of a layer and again in its rerun, so the rerun makes the forward's choices whether
           torch replays them (2.13) or asks the policy again (2.11).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from nanotron.config import Config
from nanotron.models.llama import LlamaForCausalLM, decoder_layers
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


def recompute_mode(cfg: Config, layer: int) -> str:
    """How decoder layer `layer` (global index) is checkpointed: `parallelism.recompute_of`, except that a
    mixture-of-experts layer under 'selective' is recomputed in full: torch 2.13's selective checkpoint sees
    its experts' FSDP hooks run more often in the rerun than in the forward, and fails."""
    mode = cfg.parallelism.recompute_of(layer)
    return "full" if mode == "selective" and cfg.model.is_moe_layer(layer) else mode


# Called with each output the policy keeps in a forward (not a recompute): how benchmarks/probe.py measures it.
# Only a torch whose policy context carries the op's output (2.13's op_output; 2.11's has none) can call them.
on_keep: list[Callable[[object], None]] = []
POLICY_SEES_OUTPUTS = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in KEPT:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for hook in on_keep:
            hook(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


# A linear layer's matmul (a projection); what selective_matmuls='every_other' counts. Attention's own batched
# products (context parallelism's ring on CPU) are not projections and are not counted.
PROJECTIONS = {aten.mm.default, aten.addmm.default}


def every_other_matmul_policy() -> Callable[..., CheckpointPolicy]:
    """The policy of one forward of a layer and its rerun: an even-numbered matmul is rerun in backward instead
    of kept. The forward and the rerun count apart, each from 0, so a torch that asks the policy again in the
    rerun (2.11 does; 2.13 replays the forward's choices) gets the same answers in the same order."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in PROJECTIONS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(ctx, op, *args, **kwargs)

    return policy


def _every_other_matmul_contexts():
    """A fresh pair of selective-checkpoint contexts for one forward of a layer (torch asks for one per forward)."""
    return create_selective_checkpoint_contexts(every_other_matmul_policy())


def selective_contexts(matmuls: str) -> Callable:
    """torch.utils.checkpoint's `context_fn` for selective recompute keeping `matmuls` ('all' or 'every_other')."""
    if matmuls == "every_other":
        return _every_other_matmul_contexts
    return functools.partial(create_selective_checkpoint_contexts, _policy)


def apply_recompute(
    model: LlamaForCausalLM, mode_of: Callable[[int], str] = lambda layer: "full", matmuls: str = "all"
) -> None:
    """Hooks the layers in place (parameter names don't change), the MTP modules' blocks too, each as
    `mode_of(global index)` says (`recompute_mode`): 'none', 'full' or 'selective' (keeping `matmuls`: 'all' or
    'every_other')."""
    for index, layer in decoder_layers(model):
        mode = mode_of(index)
        if mode == "none":
            continue
        checkpoint_in_place(layer, context_fn=selective_contexts(matmuls) if mode == "selective" else None)
        if isinstance(layer.mlp, MoE):  # its recomputed forward must not count the step's tokens again
            layer.mlp.counting = lambda: not in_backward_pass()
