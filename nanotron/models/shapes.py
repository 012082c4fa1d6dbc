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


def layer_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameters of one decoder layer: name inside the layer -> shape, in the model's order."""
    h, q, kv, i = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }


def root_shapes(m: ModelConfig, first: bool = True, last: bool = True) -> dict[str, tuple[int, ...]]:
    """The parameters outside the layers: the embedding (first pipeline stage), final norm and head (last)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if first:
        shapes["model.embed_tokens.weight"] = (m.vocab_size, m.hidden_size)
    if last:
        shapes["model.norm.weight"] = (m.hidden_size,)
        if not m.tie_word_embeddings:
            shapes["lm_head.weight"] = (m.vocab_size, m.hidden_size)
    return shapes


def num_params(m: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count (tied embeddings counted once)."""
    root = root_shapes(m)
    if not include_embedding:
        root.pop("model.embed_tokens.weight")
    return m.num_layers * sum(map(math.prod, layer_shapes(m).values())) + sum(map(math.prod, root.values()))


def layer_forward_flops(m: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of one decoder layer per token: 2 per matmul weight, plus attention's QK^T and AV
    (4·seq_len·hidden, no discount for the causal mask: the PaLM/Megatron MFU convention)."""
    matmul_weights = sum(math.prod(shape) for shape in layer_shapes(m).values() if len(shape) == 2)
    return 2 * matmul_weights + 4 * m.hidden_size * seq_len


def head_forward_flops(m: ModelConfig) -> int:
    """Forward FLOPs of the lm_head per token (the embedding lookup does no matmul)."""
    return 2 * m.vocab_size * m.hidden_size


def flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: forward + backward = 3 x forward, over every layer and the head."""
    return 3 * (m.num_layers * layer_forward_flops(m, seq_len) + head_forward_flops(m))
