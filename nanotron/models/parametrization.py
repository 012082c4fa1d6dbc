"""How each parameter is initialised, multiplied and updated: standard parametrization or µP.

µP for Adam (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter
Transfer", arXiv:2203.03466, Table 3 in the equivalent form of its Table 8 / the `mup` package's MuReadout:
the output layer gets a 1/m multiplier instead of a 1/m^2 init variance and a 1/m Adam LR) makes the best
hyperparameters of a narrow base model the best ones of a wide model. Across depth, residual branches get a
multiplier r^-alpha and the Adam LR of every parameter in a block r^(alpha-1) (Dey et al. 2025, "Don't be lazy:
CompleteP enables compute-efficient deep transformers", arXiv:2505.01618): alpha = 1 (CompleteP, the default)
or alpha = 1/2, depth-µP's Adam rule (Yang et al. 2023, "Tensor Programs VI: Feature Learning in Infinite-Depth
Neural Networks", arXiv:2310.02244; Bordelon et al. 2023, arXiv:2309.16620). With two-layer blocks, as in a
transformer, alpha = 1/2 leaves the blocks' own updates shrinking with depth (what CompleteP calls lazy; the
coordinate check in benchmarks/RESULTS.md measures it), which alpha = 1 avoids. CompleteP's further
adjustments of Adam's epsilon and of weight decay are not applied.

With m = hidden_size / mup_base_width, r = num_layers / mup_base_depth and alpha = mup_depth_exponent:

  parameter                          init std                       Adam LR
  embed_tokens (input weights)       init_std                       lr
  q/k/v/gate/up_proj (hidden)        init_std / sqrt(m)             lr r^(alpha-1) / m
  o_proj, down_proj (hidden)         init_std / sqrt(2 L_base m)    lr r^(alpha-1) / m
  layer norms                        1                              lr r^(alpha-1)
  final norm                         1                              lr
  lm_head (output weights)           init_std                       lr

and three multipliers in the forward: attention logits scaled by sqrt(mup_base_head_dim) / head_dim (µP's
1/d_head, equal to the usual 1/sqrt(d_head) at the base head dim), each attention and MLP branch by r^-alpha
before it joins the residual stream, and the logits by 1/m. Every hidden matrix's fan-in (hidden_size,
num_heads * head_dim or intermediate_size) grows by m when a model family keeps intermediate_size /
hidden_size fixed, which is what the 1/m factors assume. AdamW's decoupled decay is lr * weight_decay, so it
follows the LR scale (its equilibrium weight size then scales like the µP init, 1/sqrt(m)).

At the base shape (m = r = 1, head_dim = mup_base_head_dim) every factor is exactly 1: µP is the standard
parametrization there, so hyperparameters tuned on the base model are the same in both.
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
    """m: how many times wider than the µP base model (1 under standard parametrization)."""
    return cfg.hidden_size / cfg.mup_base_width if is_mup(cfg) else 1.0


def depth_ratio(cfg: ModelConfig) -> float:
    """r: how many times deeper than the µP base model (1 under standard parametrization)."""
    return cfg.num_layers / cfg.mup_base_depth if is_mup(cfg) else 1.0


def multipliers(cfg: ModelConfig) -> Multipliers:
    if not is_mup(cfg):
        return Multipliers(None, 1.0, 1.0)
    attention = None if cfg.head_dim == cfg.mup_base_head_dim else cfg.mup_base_head_dim**0.5 / cfg.head_dim
    return Multipliers(attention, depth_ratio(cfg) ** -cfg.mup_depth_exponent, 1.0 / width_ratio(cfg))


def _in_layer(name: str) -> bool:
    return name.startswith("model.layers.")


def param_init_std(cfg: ModelConfig, name: str) -> float | None:
    """The std of parameter `name`'s normal init; None for norm weights, which start at one.

    Residual output projections (o_proj, down_proj) are scaled by 1/sqrt(2 * num_layers), as in GPT-2, so the
    residual stream's variance does not grow with depth; under µP by 1/sqrt(2 * mup_base_depth), the branch
    multiplier taking over the depth scaling, and hidden matrices by 1/sqrt(m).
    """
    if name.endswith("norm.weight"):
        return None
    depth = cfg.mup_base_depth if is_mup(cfg) else cfg.num_layers
    std = cfg.init_std * (2 * depth) ** -0.5 if name.endswith(RESIDUAL_OUTPUTS) else cfg.init_std
    if is_mup(cfg) and _in_layer(name):
        std *= width_ratio(cfg) ** -0.5
    return std


def param_lr_scale(cfg: ModelConfig, name: str) -> float:
    """The factor on the scheduled LR for parameter `name` (an optimizer param group's `lr_scale`)."""
    if not is_mup(cfg) or not _in_layer(name):
        return 1.0
    scale = depth_ratio(cfg) ** (cfg.mup_depth_exponent - 1.0)
    return scale if name.endswith("norm.weight") else scale / width_ratio(cfg)


def fold_multipliers(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Standard-parametrization weights computing the same function, and whether embedding and head stay tied.

    The attention scale goes into q_proj (RoPE is linear, so scaling q before it is the same), the branch
    multiplier into o_proj and down_proj (each branch ends in one), the logit multiplier into lm_head; a tied
    head can't take it without changing the embedding, so it becomes a separate (scaled) lm_head.
    """
    mult = multipliers(cfg)
    q_factor = 1.0 if mult.attention_scale is None else mult.attention_scale * cfg.head_dim**0.5
    folded = {}
    for name, tensor in weights.items():
        factor = 1.0
        if name.endswith("q_proj.weight"):
            factor = q_factor
        elif name.endswith(RESIDUAL_OUTPUTS):
            factor = mult.residual
        elif name == "lm_head.weight":
            factor = mult.logits
        folded[name] = tensor if factor == 1.0 else tensor * factor
    return folded, cfg.tie_word_embeddings and mult.logits == 1.0
