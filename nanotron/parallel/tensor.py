"""Tensor and sequence parallelism as a DTensor plan applied to an unmodified model.

all_reduce:     Megatron TP. q/k/v and gate/up column-sharded, o/down row-sharded (all-reduce out).
reduce_scatter: sequence parallel on top. Norms and the residual stream are sharded on the sequence
                dim; inputs of column linears are all-gathered, outputs of row linears reduce-scattered.
QK-norm (Qwen3) in both: a replicated weight over each rank's heads, its gradient summed over tp.
Multi-head latent attention (DeepSeek-V3) in both: q_b_proj/kv_b_proj split by heads, o_proj row-parallel; the
latents' down-projections and norms replicated (each tp rank computes them on the whole sequence, as torchtitan
does: kv_a is (kv_lora_rank + rope) x hidden, small beside the per-head matrices); the shared RoPE key head's
gradient summed over tp (one all-reduce of [tokens, qk_rope_head_dim] per layer in backward: at 70B-like widths
64 of the 8192 elements per token that a row-parallel output moves). Under sequence parallelism its input arrives
as the gathered local tensor, the replicated down-projections being plain modules.
In both modes the embedding and lm_head are vocab-parallel and logits stay sharded for loss_parallel.
Multi-token prediction's blocks take a decoder layer's plan; its norms and eh_proj are replicated (under sequence
parallelism they act on the sequence shard, gradients summed over tp).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nanotron.models.llama import LlamaForCausalLM, decoder_layers
from nanotron.models.moe import MoE
from nanotron.parallel.torch_private import AsyncCollectiveTensor

# The linears of a decoder layer: column-parallel ones shard their output features (weight dim 0), row-parallel
# ones their input features (weight dim 1). The vocab-parallel embedding and head shard vocab rows (dim 0).
COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.q_b_proj",  # MLA's per-head up-projections: heads split; the latents' down-projections replicated
    "self_attn.kv_b_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
VOCAB_PARALLEL = ("model.embed_tokens", "lm_head")


def tp_shard_dim(name: str) -> int | None:
    """The weight dimension TP splits for parameter `name` (a layer-relative or full name); None: replicated."""
    module = name.removesuffix(".weight")
    if module.endswith(COLWISE) or module in VOCAB_PARALLEL:
        return 0
    return 1 if module.endswith(ROWWISE) else None


def apply_tensor_parallel(
    model: LlamaForCausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool, float8_collectives: bool = False
) -> None:
    """Shards `model` (a whole model or one pipeline stage of it) over `tp_mesh` in place. With
    `float8_collectives` the linears get torchao's float8 plans (tensorwise scales): inputs and gradients are cast to
    float8 before their collectives, with the amax reduced over the tp shards (the 1-process scale); under sequence
    parallelism so are the norm outputs before their all-gather (`_float8_gathers`)."""
    colwise, rowwise = ColwiseParallel, RowwiseParallel
    if float8_collectives:  # torchao is imported by float8 runs only
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        colwise, rowwise = Float8ColwiseParallel, Float8RowwiseParallel
    residual = Shard(1) if sequence_parallel else Replicate()
    norm_plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    gather_plan = {
        # (hidden states, RoPE table, document ids): only the hidden states are gathered
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    # QK-norm sees this rank's heads ([batch, seq, heads, head_dim], sharded on heads): its one weight is replicated
    # and its gradient, partial per rank, summed over tp, as a sequence-parallel norm's is over the sequence.
    qk_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
    layer_plan = {
        **{name: colwise() for name in COLWISE},
        **{name: rowwise(output_layouts=residual) for name in ROWWISE},
        **(norm_plan | gather_plan if sequence_parallel else {}),
        **({"self_attn.q_norm": qk_norm, "self_attn.k_norm": qk_norm} if model.config.qk_norm else {}),
    }
    # A mixture of experts is not split over tp: every tp rank routes the whole sequence (gathered under sequence
    # parallelism, then its own slice of the output kept), so routing, all-to-all and expert weights are the
    # same as without tp; attention and dense layers stay tensor-parallel.
    moe_plan = {name: style for name, style in layer_plan.items() if not name.startswith("mlp")}
    if sequence_parallel:
        moe_plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    for _, layer in decoder_layers(model):  # the MTP modules' blocks too
        plan = moe_plan if isinstance(layer.mlp, MoE) else layer_plan
        if float8_collectives and sequence_parallel:
            plan = _float8_gathers(plan, layer)
        if model.config.mla:
            plan = _latent_attention_plan(plan, layer, tp_mesh, sequence_parallel)
        parallelize_module(layer, tp_mesh, _present(plan, layer))

    top_plan: dict[str, nn.Module] = {}
    if model.model.embed_tokens is not None:
        top_plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.model.norm is not None and sequence_parallel:
        top_plan["model.norm"] = SequenceParallel()
    if model.mtp is not None and sequence_parallel:
        # Multi-token prediction: its norms and 2h -> h projection act per token, on this rank's sequence shard
        # (the projection's weight replicated, its gradient summed over tp like a norm's).
        # The projection's input is declared sharded on the batch dim, the rows a linear flattens [batch, seq] into
        # staying whole per rank: each rank's rows are its own tokens either way, and torch 2.11's DTensor cannot
        # flatten a tensor sharded on its second dim (2.13 can).
        local = SequenceParallel(use_local_output=True)
        for k in model.mtp:
            top_plan |= {f"mtp.{k}.{name}": local for name in ("enorm", "hnorm")}
            top_plan[f"mtp.{k}.eh_proj"] = SequenceParallel(sequence_dim=0, use_local_output=True)
            top_plan[f"mtp.{k}.norm"] = SequenceParallel()
    if model.lm_head is not None:
        # Logits stay vocab-sharded (Shard(-1)) as a DTensor: loss_parallel never gathers them.
        top_plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top_plan)
    if model.model.embed_tokens is not None:
        model.model.embed_tokens.register_forward_hook(_materialise_output)
    if model.config.tie_word_embeddings and model.lm_head is not None:
        # Both plans shard the shared [vocab, hidden] weight on dim 0: re-tie the two DTensors.
        model.lm_head.weight = model.model.embed_tokens.weight


def _present(plan: dict, layer: nn.Module) -> dict:
    """The entries of `plan` naming a module `layer` has: the plans list every attention's linears (standard and
    latent), and torch warns on every rank of each entry it cannot resolve."""
    present = {name for name, _ in layer.named_modules()}
    return {name: style for name, style in plan.items() if name in present}


def _float8_gathers(plan: dict, layer: nn.Module) -> dict:
    """`plan` with the sequence-parallel all-gathers of the attention's and the MLP's input in float8 (torchao's
    PrepareFloat8ModuleInput, as torchtitan's float8 TP plan): each norm output is cast once, before the gather,
    with its amax reduced over tp (the 1-process scale), and q/k/v (gate/up) take the gathered float8 copy as it
    is. Only where every linear reading that input is a float8 one: a plain linear cannot take a float8 input.
    Cost per layer and microbatch: half of the two gathers' bf16 bytes saved (at 70B, seq 8192, tp 8: 2 x 128 MiB
    -> 2 x 64 MiB per rank), for two scalar all-reduces of the amax over tp (latency only, ~2 x 20 us on NVLink)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    out = dict(plan)
    for name in ("self_attn", "mlp"):
        style = plan.get(name)
        linears = [m for m in layer.get_submodule(name).modules() if isinstance(m, nn.Linear)]
        if type(style) is PrepareModuleInput and linears and all(isinstance(m, Float8Linear) for m in linears):
            out[name] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts
            )
    return out


def _latent_attention_plan(plan: dict, layer: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> dict:
    """`plan` for a layer with multi-head latent attention: the linears it has (q_proj or q_a/q_b), the gathered
    input handed on as a plain tensor, and the shared RoPE key head's gradient summed over tp."""
    names = {name for name, _ in layer.named_modules()}
    plan = {name: style for name, style in plan.items() if not name.startswith("self_attn.") or name in names}
    if sequence_parallel:
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )
    layer.self_attn.shared_key.register_forward_hook(lambda module, args, out: _gradient_summed(out, tp_mesh))
    return plan


def _gradient_summed(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """x unchanged; in backward its gradient, each tp rank's partial sum (its own heads' share), all-reduced."""
    return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _materialise_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel embedding's output as a plain tensor, waited for with autograd intact.

    RowwiseParallel hands it on as an AsyncCollectiveTensor. A compiled first layer must not receive one:
    torch 2.13's AOTAutograd unwraps it outside autograd, so the embedding silently gets no gradient. The
    first layer needs the value at once anyway, so waiting here (one copy of the activation) costs no overlap.
    """
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
