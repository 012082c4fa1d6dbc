"""Hugging Face Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`) <-> nanotron's Llama with
`qk_norm` (and its own `head_dim`), for `nanotron convert`.

Qwen3 is Llama plus an RMSNorm over head_dim on every query and key head before RoPE (`self_attn.q_norm`,
`self_attn.k_norm`, the names nanotron's model uses), with a head_dim apart from hidden_size / heads: the weights
keep their names, only config.json differs. Qwen3-MoE adds the mixture of experts: softmax top-k, gates
renormalised when `norm_topk_prob`, no shared experts; its dense layers (`mlp_only_layers`, `decoder_sparse_step`)
import when they are the first k layers (`model.moe.first_dense_layers`); its files name each expert
`mlp.experts.{e}.{gate,up,down}_proj.weight` (transformers 5's stacked names import too). Qwen3's optional
sliding-window layers are refused by name (nanotron's attention is full causal).
"""

from __future__ import annotations

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source, show
from nanotron.errors import CheckpointError
from nanotron.hf.mixtral import ExpertFiles

EXPERT_FILES = ExpertFiles("Qwen3-MoE", "mlp.", "gate_proj", "up_proj", "down_proj")

# [model] key -> (config.json key, type, default: None = required), beside Llama's (`llama.FIELDS`)
MOE_FIELDS = {
    "moe.top_k": ("num_experts_per_tok", int, None),
    "moe.moe_intermediate_size": ("moe_intermediate_size", int, None),
    "moe.renormalize": ("norm_topk_prob", bool, False),
}


def hf_config(model: ModelConfig) -> dict:
    """The Qwen3-specific keys of config.json (on top of the Llama ones); Qwen3-MoE's for a mixture of experts."""
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **full_attention(model.num_layers)}
    moe = model.moe
    if not moe.enabled:
        return config
    return config | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_dense_layers)),
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
    }


def full_attention(num_layers: int) -> dict:
    """config.json's keys saying every layer attends to the whole sequence (Qwen3's and SmolLM3's: no window)."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
    }


def num_experts(src: Source) -> tuple[int, str]:
    """The routed experts and the key stating them: Qwen3-MoE's own configs write num_experts, transformers 5 writes
    num_local_experts; where both are present they must agree."""
    found = {key: value for key in ("num_experts", "num_local_experts") if (value := src.get(key, int)) is not None}
    if len(set(found.values())) > 1:
        raise CheckpointError(
            f"{src.file}: num_experts={found['num_experts']} and num_local_experts="
            f"{found['num_local_experts']} disagree: the file states two expert counts"
        )
    if not found:
        raise CheckpointError(f"{src.file}: num_experts: missing; every qwen3_moe config.json states it")
    key = next(iter(found))
    return found[key], key


def first_dense_layers(src: Source, num_layers: int) -> tuple[int, str]:
    """Qwen3-MoE's dense layers (those in mlp_only_layers, and those decoder_sparse_step skips) as
    `model.moe.first_dense_layers`; any other pattern is refused in one line."""
    step = src.get("decoder_sparse_step", int, 1)
    only = src.get("mlp_only_layers", list) or []
    if step < 1 or any(not isinstance(i, int) or isinstance(i, bool) for i in only):
        raise CheckpointError(
            f"{src.file}: decoder_sparse_step={show(step)}, mlp_only_layers={show(only)}: expected a step >= 1 and "
            "a list of layer indices"
        )
    moe = [i not in only and (i + 1) % step == 0 for i in range(num_layers)]
    first = moe.index(True) if any(moe) else num_layers
    if not all(moe[first:]):
        raise CheckpointError(
            f"{src.file}: decoder_sparse_step={step}, mlp_only_layers={show(only)} make layers "
            f"{[i for i in range(first, num_layers) if not moe[i]][0]} dense after MoE layer {first}; nanotron's "
            "MoE models keep dense layers first only (model.moe.first_dense_layers)"
        )
    return first, "mlp_only_layers"


def check_importable(src: Source) -> None:
    """Refuses, by name, the Qwen3 settings nanotron's model lacks (sliding-window attention)."""
    if src.get("use_sliding_window", bool, False):
        raise CheckpointError(
            f"{src.file}: use_sliding_window is true; nanotron's attention is full causal (set it to false only if "
            "the model never attends beyond its sliding_window)"
        )
    layer_types = src.get("layer_types", list) or []
    other = sorted({kind for kind in layer_types if kind != "full_attention"}, key=str)
    if other:
        raise CheckpointError(
            f"{src.file}: layer_types holds {show(other[0])}; nanotron's attention is full causal in every layer "
            "(only 'full_attention' imports)"
        )
