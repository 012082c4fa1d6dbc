"""Hugging Face Llama's config.json <-> nanotron's [model]: the export's config and the import's reading of one
(Mixtral's mixture-of-experts fields in `mixtral.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from nanotron.config import ModelConfig
from nanotron.config.validate import resolve_model
from nanotron.errors import CheckpointError, ConfigError
from nanotron.hf import mixtral


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


def model_config_from_hf(config: dict, where: Path) -> ModelConfig:
    """The nanotron [model] of an HF Llama config.json; anything our Llama can't express is an error."""

    def unsupported(what: str) -> CheckpointError:
        return CheckpointError(
            f"'{where}': {what}; only plain Llama or Mixtral (no biases, SiLU, default RoPE) imports"
        )

    if config.get("model_type") not in ("llama", "mixtral"):
        raise unsupported(f"model_type is {config.get('model_type')!r}, not 'llama' or 'mixtral'")
    moe = mixtral.model_fields(config) if config["model_type"] == "mixtral" else {}
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise unsupported("attention_bias/mlp_bias are set")
    if config.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act is {config.get('hidden_act')!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise unsupported(f"rope settings {rope!r} are not a table")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise unsupported(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is set")
    try:
        heads = int(config["num_attention_heads"])
        model = ModelConfig(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)),
        )
        for key, value in moe.items():
            setattr(model.moe, key, value)
        resolve_model(model)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"'{where}' lacks a usable Llama field ({type(error).__name__}: {error})") from None
    except ConfigError as error:
        raise CheckpointError(f"'{where}' describes no valid Llama: {error}") from None
    if config.get("head_dim") not in (None, model.head_dim):
        raise unsupported(f"head_dim={config['head_dim']} differs from hidden_size/num_attention_heads")
    return model
