"""Hugging Face SmolLM3 (`SmolLM3ForCausalLM`) <-> nanotron's Llama with `nope_layers`, for `nanotron convert`.

SmolLM3 is Llama whose attention skips RoPE in some layers (NoPE; every 4th in the released models): config.json's
`no_rope_layers` holds a 1 (RoPE) or 0 (none) per layer, and without it the layers follow `no_rope_layer_interval`
as transformers derives them. The weights keep Llama's names. Its optional sliding window (on the NoPE layers) is
refused by name, as Qwen3's is: nanotron's attention is full causal.
"""

from __future__ import annotations

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source, show
from nanotron.errors import CheckpointError
from nanotron.hf.qwen3 import full_attention


def hf_config(model: ModelConfig) -> dict:
    """The SmolLM3-specific keys of config.json (on top of the Llama ones)."""
    return {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "no_rope_layers": [int(i not in model.nope_layers) for i in range(model.num_layers)],
        **full_attention(model.num_layers),
        "pad_token_id": None,  # unset, transformers' SmolLM3 takes 128004, outside a smaller vocabulary
    }


def nope_layers(src: Source, num_layers: int) -> tuple[list[int], str]:
    """`model.nope_layers` from no_rope_layers (one 0/1 flag per layer), or from no_rope_layer_interval (default 4:
    layers i with (i + 1) % interval == 0 skip RoPE) where the file lists none."""
    flags = src.get("no_rope_layers", list)
    if flags is None:
        interval = src.get("no_rope_layer_interval", int, 4)
        if interval < 1:
            raise CheckpointError(f"{src.file}: no_rope_layer_interval={show(interval)}: expected an integer >= 1")
        return ModelConfig.every_nth(num_layers, interval), "no_rope_layer_interval"
    if len(flags) != num_layers or any(flag not in (0, 1) or isinstance(flag, float) for flag in flags):
        raise CheckpointError(
            f"{src.file}: no_rope_layers={show(flags)}: expected one 0 (no RoPE) or 1 (RoPE) per layer, "
            f"{num_layers} in all (num_hidden_layers)"
        )
    return [i for i, flag in enumerate(flags) if not flag], "no_rope_layers"


def check_exportable(model: ModelConfig) -> None:
    """NoPE layers export only as SmolLM3, which is plain Llama otherwise."""
    other = {"model.qk_norm=true": model.qk_norm, "a mixture of experts": model.moe.enabled}
    found = [what for what, present in other.items() if present]
    if model.nope_layers and found:
        raise CheckpointError(
            f"model.nope_layers={model.nope_layers} with {found[0]}: layers without RoPE export only as Hugging "
            "Face's SmolLM3, which has neither QK-norm nor experts"
        )
