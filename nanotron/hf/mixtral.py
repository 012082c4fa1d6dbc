"""Hugging Face Mixtral (`MixtralForCausalLM`) <-> nanotron's mixture-of-experts Llama, for `nanotron convert`.

The module names are transformers 5's (`mlp.gate`, `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]); the files use Mixtral's original per-expert layout, which transformers 4 and 5 (and other readers)
load: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down). Import
accepts both layouts. Mixtral is softmax top-k with renormalised gates, every layer MoE, no shared experts, no
routing bias: a model outside that is refused in one line naming the setting. The per-expert renaming serves
Qwen3-MoE too (`ExpertFiles`: its files name the experts `mlp.experts.{e}.{gate,up,down}_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source
from nanotron.errors import CheckpointError

_MOE = "mlp."


@dataclass(frozen=True)
class ExpertFiles:
    """How a family's files name its routed experts: the router `{prefix}gate.weight`, each expert's projections
    `{prefix}experts.{e}.{gate|up|down}.weight`."""

    family: str
    prefix: str
    gate: str
    up: str
    down: str


MIXTRAL = ExpertFiles("Mixtral", "block_sparse_moe.", "w1", "w3", "w2")


def check_exportable(model: ModelConfig, weights: dict[str, torch.Tensor], files: ExpertFiles = MIXTRAL) -> None:
    """One line naming what the family cannot express: Mixtral renormalises its gates and routes in every layer;
    Qwen3-MoE expresses either (norm_topk_prob, mlp_only_layers)."""
    moe = model.moe
    problems = {
        "model.moe.router='sigmoid'": moe.router != "softmax_topk",
        f"model.moe.num_shared_experts={moe.num_shared_experts}": moe.num_shared_experts > 0,
        f"model.moe.capacity_factor={moe.capacity_factor} (drops tokens)": moe.capacity_factor > 0,
    }
    if files == MIXTRAL:
        problems["model.moe.renormalize=false"] = not moe.renormalize
        problems[f"model.moe.first_dense_layers={moe.first_dense_layers}"] = moe.first_dense_layers > 0
    bias = [n for n, t in weights.items() if n.endswith("expert_bias") and bool(t.ne(0).any())]
    problems["a non-zero routing bias (model.moe.bias_update_rate)"] = bool(bias)
    found = [what for what, bad in problems.items() if bad]
    if found:
        rule = (
            "with renormalised gates and routed experts in every layer"
            if files == MIXTRAL
            else "(gates renormalised or not, after any dense first layers)"
        )
        raise CheckpointError(
            f"this MoE model has {', '.join(found)}, which Hugging Face's {files.family} cannot express; only "
            f"softmax top-k routing {rule} and no routing bias exports"
        )


def hf_config(model: ModelConfig) -> dict:
    """The Mixtral-specific keys of config.json (on top of the Llama ones)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": model.moe.moe_intermediate_size,
        "num_local_experts": model.moe.num_experts,
        "num_experts_per_tok": model.moe.top_k,
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def to_hf(weights: dict[str, torch.Tensor], num_experts: int, files: ExpertFiles = MIXTRAL) -> dict[str, torch.Tensor]:
    """nanotron names (stacked experts) -> the family's file names (one tensor per expert and projection)."""
    f = files
    out = {}
    for name, tensor in weights.items():
        if name.endswith("expert_bias"):
            continue
        prefix, moe, rest = name.partition(_MOE)
        if not moe or not rest.startswith(("gate.", "experts.")):
            out[name] = tensor
        elif rest == "gate.weight":
            out[f"{prefix}{f.prefix}gate.weight"] = tensor
        elif rest == "experts.gate_up_proj":
            for e in range(num_experts):
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}{f.prefix}experts.{e}.{f.gate}.weight"] = gate
                out[f"{prefix}{f.prefix}experts.{e}.{f.up}.weight"] = up
        elif rest == "experts.down_proj":
            for e in range(num_experts):
                out[f"{prefix}{f.prefix}experts.{e}.{f.down}.weight"] = tensor[e]
    return dict(sorted(out.items()))


def file_names(
    expected: dict[str, torch.Size], num_experts: int, stacked: bool, files: ExpertFiles = MIXTRAL
) -> list[str]:
    """The names to read from the family's folder (per-expert, or transformers 5's stacked names) for the model
    `expected` describes."""
    if stacked:
        return [n for n in expected if not n.endswith("expert_bias")]
    return list(to_hf({n: torch.empty(shape, device="meta") for n, shape in expected.items()}, num_experts, files))


def from_hf(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Size], num_experts: int, files: ExpertFiles = MIXTRAL
) -> dict[str, torch.Tensor]:
    """The family's tensors (either layout) -> nanotron's state dict, routing biases at zero."""
    f = files
    out = {}
    for name, shape in expected.items():
        prefix, _, rest = name.partition(_MOE)
        if name.endswith("expert_bias"):
            out[name] = torch.zeros(shape)
        elif name in tensors:
            out[name] = tensors[name]
        elif rest == "gate.weight":
            out[name] = tensors[f"{prefix}{f.prefix}gate.weight"]
        elif rest == "experts.gate_up_proj":
            out[name] = torch.stack(
                [
                    torch.cat([tensors[f"{prefix}{f.prefix}experts.{e}.{w}.weight"] for w in (f.gate, f.up)])
                    for e in range(num_experts)
                ]
            )
        elif rest == "experts.down_proj":
            out[name] = torch.stack(
                [tensors[f"{prefix}{f.prefix}experts.{e}.{f.down}.weight"] for e in range(num_experts)]
            )
        else:
            raise CheckpointError(f"no {f.family} tensor maps to {name}")
        if out[name].shape != shape:
            raise CheckpointError(
                f"{name}: the {f.family} weights give shape {list(out[name].shape)}, config.json implies {list(shape)}"
            )
    return out


# [model] key -> (config.json key, type, default: None = required), beside Llama's (`llama.FIELDS`); Mixtral's
# routing (softmax top-k, renormalised gates, no shared experts) is [model.moe]'s default
FIELDS = {
    "moe.num_experts": ("num_local_experts", int, None),
    "moe.top_k": ("num_experts_per_tok", int, None),
    "moe.moe_intermediate_size": ("intermediate_size", int, None),  # Mixtral's intermediate_size is the experts'
}


def check_importable(src: Source) -> None:
    """Refuses, by name, the Mixtral settings nanotron's model lacks."""
    window = src.get("sliding_window", int)
    if window is not None:
        raise CheckpointError(
            f"{src.file}: sliding_window={window} is set; nanotron's attention is full causal (set it to null only "
            "if the model never attends beyond that window)"
        )
