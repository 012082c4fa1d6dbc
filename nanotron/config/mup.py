"""µP's base shape ([model.mup_base]): unset fields filled from the model where unambiguous, and every base that
cannot define each parameter's scaling refused in one line. Part of config validation (validate.py calls
resolve_mup)."""

from __future__ import annotations

from dataclasses import fields

from nanotron.config.model import ModelConfig
from nanotron.errors import ConfigError


def resolve_mup(m: ModelConfig) -> None:
    """µP's base shape in model.mup_base, unset fields filled from this model where unambiguous (µP at its own
    shape is standard); recorded in the resolved config, so a wider or deeper copy of it keeps the base the
    hyperparameters were tuned on."""
    b = m.mup_base
    if m.parametrization == "standard":
        extra = [f"model.mup_base.{f.name}={getattr(b, f.name)}" for f in fields(b) if getattr(b, f.name)]
        if m.mup_depth_exponent != 1.0:
            extra.append(f"model.mup_depth_exponent={m.mup_depth_exponent}")
        if extra:
            raise ConfigError(
                f"{extra[0]} only applies with model.parametrization='mup'; set model.parametrization='mup', "
                f"or drop {extra[0].split('=')[0]}"
            )
        return
    if m.mup_depth_exponent > 1.0:
        raise ConfigError(
            f"model.mup_depth_exponent={m.mup_depth_exponent}: expected a value in [0.5, 1] (1 = CompleteP, "
            "0.5 = depth-µP); above 1 deep models would learn less the deeper they are"
        )
    _fill_mup_base(m)


def _fill_mup_base(m: ModelConfig) -> None:
    b = m.mup_base
    b.hidden = b.hidden or m.hidden_size
    b.layers = b.layers or m.num_layers
    if b.heads and b.head_dim:
        pass
    elif b.heads or b.head_dim:
        given, value = ("heads", b.heads) if b.heads else ("head_dim", b.head_dim)
        if b.hidden % value:
            raise ConfigError(
                f"model.mup_base.hidden={b.hidden} is not divisible by model.mup_base.{given}={value}; the base's "
                "hidden size is heads x head_dim, as in this model"
            )
        b.heads, b.head_dim = (value, b.hidden // value) if b.heads else (b.hidden // value, value)
    elif b.hidden == m.hidden_size:
        b.heads, b.head_dim = m.num_heads, m.head_dim
    else:
        raise ConfigError(
            f"model.mup_base.hidden={b.hidden} differs from model.hidden_size={m.hidden_size} and the base's "
            "attention shape is unset: set model.mup_base.heads (or head_dim); µP's attention scale depends on it"
        )
    if b.heads * b.head_dim != b.hidden:
        raise ConfigError(
            f"model.mup_base: heads x head_dim = {b.heads} x {b.head_dim} is not hidden={b.hidden}; this model "
            "family's hidden size is num_heads x head_dim"
        )
    if not b.intermediate:
        if b.hidden != m.hidden_size:
            same_ratio = m.intermediate_size * b.hidden // m.hidden_size
            raise ConfigError(
                f"model.mup_base.intermediate is unset while model.mup_base.hidden={b.hidden} differs from "
                f"model.hidden_size={m.hidden_size}: set the base's MLP width (e.g. {same_ratio} for this model's "
                "ratio)"
            )
        b.intermediate = m.intermediate_size
    if not b.kv_heads:
        if b.heads != m.num_heads:
            raise ConfigError(
                f"model.mup_base.kv_heads is unset while model.mup_base.heads={b.heads} differs from "
                f"model.num_heads={m.num_heads}: set it (K/V heads of the base; the same count at a fixed K/V "
                "width, or heads / group size for a fixed group size)"
            )
        b.kv_heads = m.num_kv_heads
    if b.heads % b.kv_heads:
        raise ConfigError(
            f"model.mup_base.heads={b.heads} is not divisible by model.mup_base.kv_heads={b.kv_heads}; pick "
            "kv_heads among its divisors"
        )
