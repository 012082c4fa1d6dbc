"""Model facts from the config alone (no model, no torch): every parameter's shape and each part's FLOPs.

The one table that the MFU counter (`flops_per_token`), the pipeline's stage balance (`layer_forward_flops`),
the planner (shapes, bytes) and the run line (`num_params`) read. A new model field changes the shapes here
and the module in `llama.py`; `tests/test_model.py` holds both to the built model.
"""

from __future__ import annotations

import math

from nanotron.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a `training.dtype` (the compute dtype of activations and working copies)."""
    return DTYPE_BYTES[dtype]


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    """Whether decoder layer `index` has a mixture of experts in place of its dense MLP."""
    return m.is_moe_layer(index)


def layer_shapes(m: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """The parameters of decoder layer `index`: name inside the layer -> shape, in the model's order."""
    h = m.hidden_size
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    i = m.intermediate_size
    shapes = {"input_layernorm.weight": (h,)}
    if m.mla:
        shapes |= _latent_attention_shapes(m)
    else:
        shapes |= {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
        }
    if m.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (m.head_dim,), "self_attn.k_norm.weight": (m.head_dim,)}
    shapes["post_attention_layernorm.weight"] = (h,)
    if not is_moe_layer(m, index):
        return shapes | {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    e = m.moe.num_experts
    ie = m.moe.moe_intermediate_size
    shared = m.moe.num_shared_experts * m.moe.moe_intermediate_size
    shapes |= {
        "mlp.gate.weight": (e, h),
        "mlp.experts.gate_up_proj": (e, 2 * ie, h),
        "mlp.experts.down_proj": (e, h, ie),
    }
    if shared:
        shapes |= {
            "mlp.shared_experts.gate_proj.weight": (shared, h),
            "mlp.shared_experts.up_proj.weight": (shared, h),
            "mlp.shared_experts.down_proj.weight": (h, shared),
        }
    return shapes


def _latent_attention_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's parameters (`LatentAttention`): the latents' down-projections and norms, the
    per-head up-projections (queries: nope + rope parts; keys and values: nope + value parts), o_proj."""
    h, heads = m.hidden_size, m.num_heads
    if m.q_lora_rank:
        query = {
            "self_attn.q_a_proj.weight": (m.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
            "self_attn.q_b_proj.weight": (heads * m.head_dim, m.q_lora_rank),
        }
    else:
        query = {"self_attn.q_proj.weight": (heads * m.head_dim, h)}
    return query | {
        "self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "self_attn.o_proj.weight": (h, heads * m.v_head_dim),
    }


def kv_bytes_per_token(m: ModelConfig, element: int) -> dict[str, int]:
    """Bytes of one token's keys and values in one layer: what attention reads (`expanded`: every key/value head),
    and under MLA the latent they are expanded from (`compressed`: kv_lora_rank + the shared RoPE key head)."""
    expanded = m.num_kv_heads * (m.head_dim + m.value_dim) * element
    compressed = (m.kv_lora_rank + m.qk_rope_head_dim) * element if m.mla else expanded
    return {"expanded": expanded, "compressed": compressed}


def is_expert_param(name: str) -> bool:
    """A routed expert's stacked weight (expert parallelism splits its first dimension)."""
    return ".experts." in name or name.startswith("experts.")


def root_shapes(m: ModelConfig, first: bool = True, last: bool = True) -> dict[str, tuple[int, ...]]:
    """The parameters outside the layers: the embedding (first pipeline stage), final norm, head and the
    multi-token prediction modules (last)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if first:
        shapes["model.embed_tokens.weight"] = (m.vocab_size, m.hidden_size)
    if last:
        shapes["model.norm.weight"] = (m.hidden_size,)
        if not m.tie_word_embeddings:
            shapes["lm_head.weight"] = (m.vocab_size, m.hidden_size)
        shapes |= mtp_shapes(m)
    return shapes


def mtp_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-token prediction's parameters (`MultiTokenPrediction`, one per depth k): two norms, the 2h -> h
    projection, a decoder layer (global index num_layers + k: a MoE layer where the deep layers are) and the norm
    before the shared head. The embedding and head are the model's."""
    h, shapes = m.hidden_size, {}
    for k in range(m.mtp_depth):
        prefix = f"mtp.{k}."
        shapes |= {prefix + "enorm.weight": (h,), prefix + "hnorm.weight": (h,), prefix + "eh_proj.weight": (h, 2 * h)}
        shapes |= {prefix + "block." + name: shape for name, shape in layer_shapes(m, m.num_layers + k).items()}
        shapes[prefix + "norm.weight"] = (h,)
    return shapes


def all_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model by its FQN (tied embeddings once)."""
    shapes = root_shapes(m)
    for index in range(m.num_layers):
        shapes |= {f"model.layers.{index}.{name}": shape for name, shape in layer_shapes(m, index).items()}
    return shapes


def num_params(m: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count (tied embeddings counted once; every expert; the MTP modules)."""
    shapes = all_shapes(m)
    if not include_embedding:
        shapes.pop("model.embed_tokens.weight")
    return sum(map(math.prod, shapes.values()))


def active_params(m: ModelConfig) -> int:
    """Parameters one token passes through: every expert's share is top_k / num_experts of it (= num_params for
    a dense model)."""
    routed = sum(math.prod(shape) for name, shape in all_shapes(m).items() if is_expert_param(name))
    return num_params(m) - routed + routed * m.moe.top_k // max(m.moe.num_experts, 1)


def _matmul_weights(m: ModelConfig, index: int) -> int:
    """Weights one token multiplies by in layer `index`: routed experts count top_k of num_experts."""
    total = 0
    for shape in layer_shapes(m, index).values():
        if len(shape) == 3:  # stacked experts: the token meets top_k of them
            total += math.prod(shape[1:]) * m.moe.top_k
        elif len(shape) == 2:
            total += math.prod(shape)
    return total


def layer_forward_flops(m: ModelConfig, seq_len: int, index: int | None = None) -> int:
    """Forward FLOPs of decoder layer `index` per token (None: the mean over the layers): 2 per matmul weight a
    token meets (active parameters: a routed token pays for top_k experts and the router), plus attention's QK^T
    and AV (2·seq_len·num_heads·(head_dim + value head dim), = 4·seq_len·num_heads·head_dim outside MLA; no discount
    for the causal mask: the PaLM/Megatron MFU convention)."""
    indices = range(m.num_layers) if index is None else [index]
    matmul = sum(_matmul_weights(m, i) for i in indices) / len(indices)
    return int(2 * matmul) + 2 * m.num_heads * (m.head_dim + m.value_dim) * seq_len


def head_forward_flops(m: ModelConfig) -> int:
    """Forward FLOPs of the lm_head per token (the embedding lookup does no matmul)."""
    return 2 * m.vocab_size * m.hidden_size


def mtp_forward_flops(m: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of the multi-token prediction modules: per depth its 2h -> h projection, its
    decoder layer and one more pass through the shared head (0 when off)."""
    projection = 2 * 2 * m.hidden_size * m.hidden_size
    return sum(
        projection + layer_forward_flops(m, seq_len, m.num_layers + k) + head_forward_flops(m)
        for k in range(m.mtp_depth)
    )


def flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: forward + backward = 3 x forward, over every layer (active parameters), the head
    and the MTP modules (whose positions past the sequence's end are computed, and counted, too)."""
    layers = sum(layer_forward_flops(m, seq_len, index) for index in range(m.num_layers))
    return 3 * (layers + head_forward_flops(m) + mtp_forward_flops(m, seq_len))
