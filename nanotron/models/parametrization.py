"""How each parameter is initialised, multiplied and updated: standard parametrization or µP.

µP for Adam (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter
Transfer", arXiv:2203.03466, Table 3, with the output layer in the equivalent form of its Table 8 / the `mup`
package's MuReadout: a 1/m multiplier instead of a 1/m^2 init variance and a 1/m Adam LR) makes the best
hyperparameters of a narrow base model the best ones of a wide model. Across depth, residual branches get a
multiplier r^-alpha and the Adam LR of every parameter in a block r^(alpha-1) (Dey et al. 2025, "Don't be lazy:
CompleteP enables compute-efficient deep transformers", arXiv:2505.01618): alpha = 1 (CompleteP, the default)
or alpha = 1/2, depth-µP's Adam rule (Yang et al. 2023, "Tensor Programs VI: Feature Learning in Infinite-Depth
Neural Networks", arXiv:2310.02244; Bordelon et al. 2023, arXiv:2309.16620). With two-layer blocks, as in a
transformer, alpha = 1/2 leaves the blocks' own updates shrinking with depth (what CompleteP calls lazy; the
coordinate check in benchmarks/RESULTS.md measures it), which alpha = 1 avoids.

Widths are per parameter, as microsoft/mup's base shapes: each matrix's fan-in and fan-out are compared with
the base model's (`model.mup_base`), giving m_in and m_out (m_in = 1 when the fan-in did not grow). With
r = num_layers / mup_base.layers, alpha = mup_depth_exponent and m = hidden_size / mup_base.hidden:

  parameter                         fans (in, out)             init std                         Adam LR
  embed_tokens                      vocab, hidden              init_std                          lr
  q_proj, o_proj                    hidden, hidden             init_std / sqrt(m_in)             lr r^(a-1) / m_in
  k_proj, v_proj                    hidden, kv_heads*head_dim  as q (m_out = 1: init_std / m_in) lr r^(a-1) / m_in
  gate_proj, up_proj                hidden, intermediate       as q (m_out = 1: init_std / m_in) lr r^(a-1) / m_in
  down_proj                         intermediate, hidden       as q (m_out = 1: init_std / m_in) lr r^(a-1) / m_in
  eh_proj (multi-token prediction)  2 hidden, hidden           as q                              as q
  layer norms                                                  1                                 lr r^(a-1)
  final norm, lm_head                                          1, init_std                       lr

A matrix whose fan-out stays at the base's while its fan-in grows (k/v at a fixed K/V width under grouped-query
attention, gate/up at a fixed MLP width) is an output weight in Table 3's sense: init variance 1/fan_in^2. o_proj
and down_proj are further scaled by 1/sqrt(2 mup_base.layers) (GPT-2's residual init at the base depth; the
branch multiplier takes over the depth scaling). Three multipliers act in the forward: attention logits scaled
by sqrt(mup_base.head_dim) / head_dim (µP's 1/d_head, equal to the usual 1/sqrt(d_head) at the base head dim, so
a model that grows by adding heads of the base's size keeps the standard scale), each attention and MLP branch
by r^-alpha before it joins the residual stream, and the logits by 1/m.

Adam's epsilon follows the gradients' scale (CompleteP, Eq. 40, and its reference implementation): eps / m for
the embedding, final norm and head, eps / (m r^alpha) for every parameter of a layer (`optimizer.eps_mode =
"scaled"`). AdamW's decoupled decay is lr x weight_decay: `optimizer.weight_decay_mode = "coupled"` leaves it
so, following each matrix's µP LR (1/m_in slower decay per step for wider matrices); "independent" multiplies
weight_decay by m_in so lr x weight_decay does not shrink with width, as microsoft/mup's MuAdam (its default,
decoupled_wd=False) and CompleteP's reference implementation do.

Muon (`optimizer.name = "muon"`, `optim/muon.py`) steps the layer matrices with an orthogonalised update whose
size it sets itself: every singular value ~ lr x 0.2 sqrt(max(fan_in, fan_out)) (Moonlight's AdamW-matched RMS).
Adam's 1/m_in LR assumes an update of entries of size ~lr, whose spectral norm grows like the width; Muon's does
not, so 1/m_in would shrink its updates sqrt(m) too far. Muon's matrices instead get the LR factor that brings
the update's spectral norm to sqrt(fan_out / fan_in) x its base-model value (the spectral condition for feature
learning, Yang, Simon & Bernstein 2023, arXiv:2310.17813, which µP's Adam rule also meets): 1/sqrt(m) for a
matrix whose fans both grow, 1/m when only the fan-in grows; times the same depth factor r^(alpha-1). AdamW's
parameters keep the table above.

At the base shape (every m_in = m = r = 1) every factor is exactly 1: µP is the standard parametrization
there, so hyperparameters tuned on the base model are the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanotron.config import ModelConfig

RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")  # last: MoE experts' stacked


@dataclass(frozen=True)
class Multipliers:
    """Plain scalars the model applies in its forward (all neutral under standard parametrization)."""

    attention_scale: float | None  # SDPA's softmax scale; None = its default 1/sqrt(head_dim)
    residual: float  # on each attention and MLP output before it is added to the residual stream
    logits: float  # on lm_head's output


def is_mup(cfg: ModelConfig) -> bool:
    return cfg.parametrization == "mup"


def width_ratio(cfg: ModelConfig) -> float:
    """m: how many times wider the residual stream is than the µP base model's (1 under standard)."""
    return cfg.hidden_size / cfg.mup_base.hidden if is_mup(cfg) else 1.0


def depth_ratio(cfg: ModelConfig) -> float:
    """r: how many times deeper than the µP base model (1 under standard parametrization)."""
    return cfg.num_layers / cfg.mup_base.layers if is_mup(cfg) else 1.0


def multipliers(cfg: ModelConfig) -> Multipliers:
    if not is_mup(cfg):
        return Multipliers(None, 1.0, 1.0)
    base_head_dim = cfg.mup_base.head_dim
    attention = None if cfg.head_dim == base_head_dim else base_head_dim**0.5 / cfg.head_dim
    return Multipliers(attention, depth_ratio(cfg) ** -cfg.mup_depth_exponent, 1.0 / width_ratio(cfg))


def _in_layer(name: str) -> bool:
    """A decoder layer's parameter; multi-token prediction's modules count as layers (a block and its inputs)."""
    return name.startswith(("model.layers.", "mtp."))


def _fans(name: str, hidden: float, kv: float, mlp: float) -> tuple[float, float]:
    """(fan-in, fan-out) of layer matrix `name` in a model of these widths (hidden = num_heads x head_dim)."""
    for suffix, fans in (
        (("q_proj.weight", "o_proj.weight"), (hidden, hidden)),
        (("k_proj.weight", "v_proj.weight"), (hidden, kv)),
        (("gate_proj.weight", "up_proj.weight"), (hidden, mlp)),
        (("down_proj.weight",), (mlp, hidden)),
        (("eh_proj.weight",), (hidden, hidden)),  # multi-token prediction's 2h -> h: both fans grow with width
    ):
        if name.endswith(suffix):
            return fans
    raise ValueError(f"{name}: no µP fan-in/fan-out rule for this parameter")  # a new parameter needs one


def _model_and_base_fans(cfg: ModelConfig, name: str) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """(fan-in, fan-out) of layer matrix `name` in this model and in the µP base model; None for what is not a
    layer matrix (norms, embedding, head) or under standard parametrization."""
    if not (is_mup(cfg) and _in_layer(name)) or name.endswith("norm.weight"):
        return None
    b = cfg.mup_base
    model = _fans(name, cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return model, _fans(name, b.hidden, b.kv_heads * b.head_dim, b.intermediate)


def fan_ratios(cfg: ModelConfig, name: str) -> tuple[float, float] | None:
    """(m_in, m_out): how many times the fan-in and fan-out of layer matrix `name` exceed the base model's;
    None for what is not a layer matrix (norms, embedding, head). (1, 1) under standard parametrization."""
    fans = _model_and_base_fans(cfg, name)
    if fans is None:
        return None
    (fan_in, fan_out), (base_in, base_out) = fans
    return fan_in / base_in, fan_out / base_out


def _width_factor(cfg: ModelConfig, name: str) -> tuple[float, float]:
    """(init std factor, LR divisor) of a layer matrix from its fans: 1/sqrt(m_in) and m_in for a hidden weight
    (fan-in and fan-out grow), 1/m_in and m_in for an output-like one (only the fan-in grows), 1 and 1 when
    the fan-in stays (an input-like weight)."""
    fans = fan_ratios(cfg, name)
    if fans is None:
        return 1.0, 1.0
    m_in, m_out = fans
    return (m_in**-1.0 if m_out == 1.0 else m_in**-0.5), m_in


def param_init_std(cfg: ModelConfig, name: str) -> float | None:
    """The std of parameter `name`'s normal init; None for norm weights, which start at one.

    Residual output projections (o_proj, down_proj) are scaled by 1/sqrt(2 * num_layers), as in GPT-2, so the
    residual stream's variance does not grow with depth; under µP by 1/sqrt(2 * mup_base.layers), the branch
    multiplier taking over the depth scaling, and layer matrices by their fans' factor (module docstring).
    """
    if name.endswith("norm.weight"):
        return None
    depth = cfg.mup_base.layers if is_mup(cfg) else cfg.num_layers
    std = cfg.init_std * (2 * depth) ** -0.5 if name.endswith(RESIDUAL_OUTPUTS) else cfg.init_std
    return std * _width_factor(cfg, name)[0]


def param_lr_scale(cfg: ModelConfig, name: str) -> float:
    """The factor on the scheduled LR for parameter `name` (an optimizer param group's `lr_scale`)."""
    if not is_mup(cfg) or not _in_layer(name):
        return 1.0
    return depth_ratio(cfg) ** (cfg.mup_depth_exponent - 1.0) / _width_factor(cfg, name)[1]


def _muon_width_factor(cfg: ModelConfig, name: str) -> float:
    """The spectral condition's update norm sqrt(fan_out / fan_in) over Muon's own scale sqrt(max(fan_in,
    fan_out)), relative to the base model's: 1 at the base width, 1/sqrt(m) when both fans grow m-fold, 1/m when
    only the fan-in grows (k/v at a fixed K/V width); 1 for what is not a layer matrix or under standard."""
    fans = _model_and_base_fans(cfg, name)
    if fans is None:
        return 1.0
    (fan_in, fan_out), (base_in, base_out) = fans
    spectral = (fan_out / fan_in) ** 0.5 / max(fan_in, fan_out) ** 0.5
    return spectral / ((base_out / base_in) ** 0.5 / max(base_in, base_out) ** 0.5)


def param_muon_lr_scale(cfg: ModelConfig, name: str) -> float:
    """The factor on the scheduled LR for a matrix Muon steps (module docstring, "Muon"): µP's depth factor
    times the width factor that makes Muon's update meet the spectral condition (not Adam's 1/m_in)."""
    if not is_mup(cfg) or not _in_layer(name):
        return 1.0
    return depth_ratio(cfg) ** (cfg.mup_depth_exponent - 1.0) * _muon_width_factor(cfg, name)


def param_muon_weight_decay_scale(cfg: ModelConfig, name: str, mode: str = "coupled") -> float:
    """Muon's counterpart of `param_weight_decay_scale`: under `independent`, the inverse of its width factor,
    so lr x weight_decay does not shrink with width; 1 under `coupled` or standard parametrization."""
    if not is_mup(cfg) or mode == "coupled":
        return 1.0
    return 1.0 / _muon_width_factor(cfg, name)


def param_eps_scale(cfg: ModelConfig, name: str, mode: str = "scaled") -> float:
    """The factor on Adam's epsilon for parameter `name` (CompleteP's rule; 1 under standard or eps_mode fixed)."""
    if not is_mup(cfg) or mode == "fixed":
        return 1.0
    depth = depth_ratio(cfg) ** -cfg.mup_depth_exponent if _in_layer(name) else 1.0
    return depth / width_ratio(cfg)


def param_weight_decay_scale(cfg: ModelConfig, name: str, mode: str = "coupled") -> float:
    """The factor on weight_decay for parameter `name`: m_in under `independent` (lr x weight_decay then does
    not shrink with the matrix's width), 1 under `coupled` or standard parametrization."""
    if not is_mup(cfg) or mode == "coupled":
        return 1.0
    return _width_factor(cfg, name)[1]


def fold_multipliers(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Standard-parametrization weights computing the same function, and whether embedding and head stay tied.

    The attention scale goes into q_proj (RoPE is linear, so scaling q before it is the same; with QK-norm into
    q_norm, whose output RoPE takes, as a scale before the norm would be normalised away), the branch
    multiplier into o_proj and down_proj (each branch ends in one), the logit multiplier into lm_head; a tied
    head can't take it without changing the embedding, so it becomes a separate (scaled) lm_head.
    """
    mult = multipliers(cfg)
    q_factor = 1.0 if mult.attention_scale is None else mult.attention_scale * cfg.head_dim**0.5
    scaled_by_attention = "q_norm.weight" if cfg.qk_norm else "q_proj.weight"
    folded = {}
    for name, tensor in weights.items():
        factor = 1.0
        if name.endswith(scaled_by_attention):
            factor = q_factor
        elif name.endswith(RESIDUAL_OUTPUTS):
            factor = mult.residual
        elif name == "lm_head.weight":
            factor = mult.logits
        folded[name] = tensor if factor == 1.0 else tensor * factor
    return folded, cfg.tie_word_embeddings and mult.logits == 1.0
