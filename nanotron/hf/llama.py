"""Hugging Face Llama's config.json <-> nanotron's [model]: the export's config and the import's reading of one
(Mixtral's mixture-of-experts fields in `mixtral.py`, Qwen3's QK-norm in `qwen3.py`, SmolLM3's NoPE layers in
`smollm3.py`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source, show
from nanotron.config.validate import resolve_model
from nanotron.errors import CheckpointError, ConfigError
from nanotron.hf import deepseek_v3, mixtral, qwen3, smollm3


def hf_config(model: ModelConfig, dtype: torch.dtype, eos_id: int | None, tied: bool) -> dict:
    """config.json of transformers' LlamaConfig (keys of 4.x and 5.x, so either version loads it)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


# [model] key -> (the config.json key it is read from, its type, the default when absent or null: None = required)
FIELDS = {
    "hidden_size": ("hidden_size", int, None),
    "intermediate_size": ("intermediate_size", int, None),
    "num_layers": ("num_hidden_layers", int, None),
    "num_heads": ("num_attention_heads", int, None),
    "vocab_size": ("vocab_size", int, None),
    "max_seq_len": ("max_position_embeddings", int, 2048),
    "rms_norm_eps": ("rms_norm_eps", float, 1e-6),
    "tie_word_embeddings": ("tie_word_embeddings", bool, False),
    "init_std": ("initializer_range", float, 0.02),
}
FIX = "correct config.json, or save the model again with transformers' save_pretrained"
_ROPE_KEYS = {"rope_type", "type", "rope_theta"}  # all a table of default (unscaled) RoPE holds


def model_config_from_hf(config: dict, where: Path) -> ModelConfig:
    """The nanotron [model] of an HF Llama, Mixtral, Qwen3, Qwen3-MoE, SmolLM3 or DeepSeek-V3 config.json. The file is
    untrusted input: every field read is type-checked (a bool is no layer count, NaN no epsilon) and range-checked,
    each refusal one line in the file's own keys; anything our model can't express (biases, scaled RoPE, sliding
    windows, grouped routing) is refused by name."""
    src = Source(config, f"'{where}'")
    try:
        read = _read_fields(src)
    except ConfigError as error:
        raise ConfigError(f"{error}; {FIX}") from None
    model = ModelConfig(**{key: value for key, (value, _) in read.items() if "." not in key})
    for key, (value, _) in read.items():
        if key.startswith("moe."):
            setattr(model.moe, key.removeprefix("moe."), value)
    try:
        resolve_model(model)
    except ConfigError as error:
        message = str(error)
        for key, (_, original) in read.items():  # model.num_kv_heads -> num_key_value_heads
            message = re.sub(rf"(?<![\w.])model\.{re.escape(key)}(?!\w)", original, message)
        raise ConfigError(f"{src.file}: {message}; {FIX}") from None
    return model


def _unsupported(src: Source, what: str) -> CheckpointError:
    return CheckpointError(
        f"{src.file}: {what}; only plain Llama, Mixtral, Qwen3, Qwen3-MoE, SmolLM3 or DeepSeek-V3 (no biases, SiLU, "
        "unscaled RoPE, full attention) imports"
    )


def _read_fields(src: Source) -> dict[str, tuple[Any, str]]:
    """{[model] key: (value, the config.json key behind it)} for every field the import reads, each type-checked."""
    model_type = src.get("model_type", str)
    if model_type not in ("llama", "mixtral", "qwen3", "qwen3_moe", "smollm3", "deepseek_v3"):
        raise _unsupported(
            src,
            f"model_type is {show(model_type)}, not 'llama', 'mixtral', 'qwen3', 'qwen3_moe', 'smollm3' or "
            "'deepseek_v3'",
        )
    for key in ("attention_bias", "mlp_bias"):
        if src.get(key, bool, False):
            raise _unsupported(src, f"{key} is true")
    if (act := src.get("hidden_act", str, "silu")) != "silu":
        raise _unsupported(src, f"hidden_act is {show(act)}")
    family = {"mixtral": mixtral.FIELDS, "qwen3_moe": qwen3.MOE_FIELDS, "deepseek_v3": deepseek_v3.FIELDS}
    fields = FIELDS | family.get(model_type, {})
    if model_type == "mixtral":
        mixtral.check_importable(src)
    if model_type.startswith("qwen3") or model_type == "smollm3":  # both may declare sliding-window layers
        qwen3.check_importable(src)
    if model_type == "deepseek_v3":
        deepseek_v3.check_importable(src)
    read = {}
    for ours, (key, kind, default) in fields.items():
        read[ours] = (src.get(key, kind, default), key)
        if read[ours][0] is None:
            raise ConfigError(f"{src.file}: {key}: missing; every {model_type} config.json states it")
    if model_type == "deepseek_v3":  # MLA: head_dim (transformers': the RoPE width) and kv heads follow from it
        read |= deepseek_v3.read_moe(src, read["num_layers"][0])
    else:
        read["num_kv_heads"] = (src.get("num_key_value_heads", int, read["num_heads"][0]), "num_key_value_heads")
        read["head_dim"] = (src.get("head_dim", int), "head_dim")  # absent: hidden_size / num_attention_heads
    read["qk_norm"] = (model_type.startswith("qwen3"), "model_type")
    if model_type == "qwen3_moe":
        read["moe.num_experts"] = qwen3.num_experts(src)
        read["moe.first_dense_layers"] = qwen3.first_dense_layers(src, read["num_layers"][0])
    if model_type == "smollm3":
        read["nope_layers"] = smollm3.nope_layers(src, read["num_layers"][0])
    read["rope_theta"] = _rope_theta(src)
    return read


def _rope_theta(src: Source) -> tuple[float, str]:
    """RoPE's base and the key it was read from. transformers 4 writes rope_theta (and rope_scaling), 5 writes
    rope_parameters, to-hf writes all three: where two state a base they must agree, and scaling in either table
    is refused (nanotron's RoPE is unscaled: the model would see positions other than it was trained with)."""
    found = {}
    if (theta := src.get("rope_theta", float)) is not None:
        found["rope_theta"] = theta
    for table in ("rope_parameters", "rope_scaling"):
        rope = src.get(table, dict)
        if rope is None:
            continue
        kind = src.get(f"{table}.rope_type", str) or src.get(f"{table}.type", str, "default")
        if kind != "default":
            raise _unsupported(src, f"{table}: RoPE scaling {show(kind)} is set")
        extra = sorted(key for key, value in rope.items() if key not in _ROPE_KEYS and value is not None)
        if extra:
            raise _unsupported(src, f"{table}.{extra[0]} is set (default RoPE takes only rope_theta)")
        if (theta := src.get(f"{table}.rope_theta", float)) is not None:
            found[f"{table}.rope_theta"] = theta
    if len(set(found.values())) > 1:
        stated = " and ".join(f"{key}={value}" for key, value in found.items())
        raise ConfigError(f"{src.file}: {stated} disagree: the file states two RoPE bases")
    key = next(iter(found), "rope_theta")
    return found.get(key, 10000.0), key
