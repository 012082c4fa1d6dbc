"""Hugging Face Qwen3 (`Qwen3ForCausalLM`) <-> nanotron's Llama with `qk_norm` (and its own `head_dim`), for
`nanotron convert`.

Qwen3 is Llama plus an RMSNorm over head_dim on every query and key head before RoPE (`self_attn.q_norm`,
`self_attn.k_norm`, the names nanotron's model uses), with a head_dim apart from hidden_size / heads: the weights
keep their names, only config.json differs. Qwen3's optional sliding-window layers are refused by name (nanotron's
attention is full causal).
"""

from __future__ import annotations

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source, show
from nanotron.errors import CheckpointError


def hf_config(model: ModelConfig) -> dict:
    """The Qwen3-specific keys of config.json (on top of the Llama ones)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.num_layers,
        "layer_types": ["full_attention"] * model.num_layers,
    }


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
