"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`) <-> nanotron's model with multi-head latent attention
(`model.kv_lora_rank` > 0) and its mixture of experts, for `nanotron convert`.

The attention's names are transformers' (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`). DeepSeek's checkpoints lay each RoPE part out in interleaved pairs
(`rope_interleave`, true by default); nanotron's RoPE rotates split halves, so import reorders those rows (evens,
then odds: the same dot products, bit for bit) and export restores the pairs. The MoE maps onto nanotron's:
sigmoid router with the routing bias (`e_score_correction_bias` = `mlp.gate.expert_bias`), gates normalised over
the chosen experts then times `routed_scaling_factor`, grouped routing (`n_group`, `topk_group` as
`model.moe.num_expert_groups`, `top_expert_groups`), shared experts, the first `first_k_dense_replace` layers dense;
experts are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj`, as Qwen3-MoE). Refused in one line each:
unnormalised gates (norm_topk_prob false), YaRN or any scaled RoPE (with its mscale on the softmax scale;
`llama._rope_theta`). transformers' own num_key_value_heads and head_dim (the RoPE width there) are not read: MLA
derives both.

Multi-token prediction (`model.mtp_depth`, DeepSeek's num_nextn_predict_layers): DeepSeek-V3's checkpoint stores
MTP module k as one more layer, `model.layers.{num_hidden_layers + k}`, holding a decoder layer's weights beside
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (nanotron's `mtp.{k}.norm`) and copies of the embedding
(`embed_tokens`) and head (`shared_head.head`). Export writes them so; import reads them when the folder has them
(the copies are not read: nanotron's modules share the model's) and otherwise imports no MTP module, saying so:
transformers builds no MTP layer (it skips DeepSeek-V3's layer 61 on load), so a folder it saved has none.
"""

from __future__ import annotations

import torch

from nanotron.config import ModelConfig
from nanotron.config.conversion import Source
from nanotron.errors import CheckpointError
from nanotron.hf import mixtral
from nanotron.hf.mixtral import ExpertFiles

EXPERT_FILES = ExpertFiles("DeepSeek-V3", "mlp.", "gate_proj", "up_proj", "down_proj")
BIAS = ("gate.expert_bias", "gate.e_score_correction_bias")  # nanotron's routing bias, transformers' name for it

# [model] key -> (config.json key, type, default: None = required), beside Llama's (`llama.FIELDS`)
FIELDS = {
    "kv_lora_rank": ("kv_lora_rank", int, None),
    "q_lora_rank": ("q_lora_rank", int, 0),  # null: queries through one q_proj
    "qk_nope_head_dim": ("qk_nope_head_dim", int, None),
    "qk_rope_head_dim": ("qk_rope_head_dim", int, None),
    "v_head_dim": ("v_head_dim", int, None),
    "mtp_depth": ("num_nextn_predict_layers", int, 0),  # read only where the folder holds the layers (importer)
}
MOE_FIELDS = {
    "moe.num_experts": ("n_routed_experts", int, None),
    "moe.top_k": ("num_experts_per_tok", int, None),
    "moe.moe_intermediate_size": ("moe_intermediate_size", int, None),
    "moe.num_shared_experts": ("n_shared_experts", int, 0),
    "moe.routed_scaling_factor": ("routed_scaling_factor", float, 1.0),
    "moe.num_expert_groups": ("n_group", int, 1),
    "moe.top_expert_groups": ("topk_group", int, 0),  # null: every group
}


def check_importable(src: Source) -> None:
    """Refuses, by name, the DeepSeek-V3 settings nanotron's model lacks."""
    if not src.get("norm_topk_prob", bool, True):
        raise CheckpointError(
            f"{src.file}: norm_topk_prob is false; nanotron's sigmoid router always normalises the chosen experts' "
            "gates (DeepSeek-V3's setting)"
        )
    src.get("rope_interleave", bool, True)  # type-checked here, used by the weights' import


def read_moe(src: Source, num_layers: int) -> dict[str, tuple]:
    """[model.moe] keys with the config.json keys behind them; a model whose layers are all dense has none."""
    first_dense = src.get("first_k_dense_replace", int, 0)
    if first_dense >= num_layers:
        return {}
    read = {ours: (src.get(key, kind, default), key) for ours, (key, kind, default) in MOE_FIELDS.items()}
    missing = [key for value, key in read.values() if value is None]
    if missing:
        raise CheckpointError(f"{src.file}: {missing[0]}: missing; every deepseek_v3 config.json states it")
    read["moe.first_dense_layers"] = (first_dense, "first_k_dense_replace")
    read["moe.router"] = ("sigmoid", "model_type")
    return read


def hf_config(model: ModelConfig) -> dict:
    """The DeepSeek-V3 keys of config.json (on top of the Llama ones). A dense model states its layers all dense
    (first_k_dense_replace = num_layers) and one placeholder expert, as transformers' config requires numbers."""
    moe = model.moe
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "head_dim": model.qk_rope_head_dim,  # transformers' meaning: the RoPE width
        "num_key_value_heads": model.num_heads,
        "kv_lora_rank": model.kv_lora_rank,
        "q_lora_rank": model.q_lora_rank or None,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "qk_head_dim": model.head_dim,
        "v_head_dim": model.v_head_dim,
        "rope_interleave": True,
        "first_k_dense_replace": moe.first_dense_layers if moe.enabled else model.num_layers,
        "n_routed_experts": moe.num_experts if moe.enabled else 1,
        "num_experts_per_tok": moe.top_k if moe.enabled else 1,
        "n_shared_experts": moe.num_shared_experts,
        "moe_intermediate_size": moe.moe_intermediate_size if moe.enabled else model.intermediate_size,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": True,
        "n_group": moe.num_expert_groups if moe.enabled else 1,
        "topk_group": (moe.top_expert_groups or moe.num_expert_groups) if moe.enabled else 1,
        "num_nextn_predict_layers": model.mtp_depth,
    }


def check_exportable(model: ModelConfig) -> None:
    """One line naming what DeepSeek-V3 cannot express: its MoE routes by sigmoid scores and drops no tokens."""
    moe = model.moe
    problems = {
        f"model.moe.router={moe.router!r}": moe.enabled and moe.router != "sigmoid",
        f"model.moe.capacity_factor={moe.capacity_factor} (drops tokens)": moe.enabled and moe.capacity_factor > 0,
    }
    found = [what for what, bad in problems.items() if bad]
    if found:
        raise CheckpointError(
            f"this latent-attention MoE model has {', '.join(found)}, which Hugging Face's DeepSeek-V3 cannot "
            "express; only the sigmoid router without a capacity limit exports"
        )


def _rope_rows(model: ModelConfig, name: str) -> torch.Tensor | None:
    """For a weight whose rows hold RoPE parts (queries per head, the shared key), the row order that turns
    DeepSeek's interleaved pairs into split halves (evens, then odds); None for other weights."""
    pairs = torch.cat([torch.arange(0, model.qk_rope_head_dim, 2), torch.arange(1, model.qk_rope_head_dim, 2)])
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        rows = torch.arange(model.num_heads * model.head_dim).view(model.num_heads, model.head_dim)
        rows[:, model.qk_nope_head_dim :] = rows[:, model.qk_nope_head_dim :][:, pairs]
        return rows.flatten()
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        rows = torch.arange(model.kv_lora_rank + model.qk_rope_head_dim)
        rows[model.kv_lora_rank :] = rows[model.kv_lora_rank :][pairs]
        return rows
    return None


def mtp_hf_name(model: ModelConfig, name: str) -> str:
    """An MTP parameter's name in DeepSeek-V3's files (`mtp.{k}.block.X` -> `model.layers.{L + k}.X`); other names
    unchanged."""
    if not name.startswith("mtp."):
        return name
    _, depth, rest = name.split(".", 2)
    rest = "shared_head.norm.weight" if rest == "norm.weight" else rest.removeprefix("block.")
    return f"model.layers.{model.num_layers + int(depth)}.{rest}"


def mtp_shared_copies(model: ModelConfig) -> dict[str, str]:
    """DeepSeek-V3's per-MTP-layer copies of the shared embedding and head: file name -> nanotron's name."""
    head = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
    copies = {}
    for depth in range(model.mtp_depth):
        layer = f"model.layers.{model.num_layers + depth}."
        copies |= {layer + "embed_tokens.weight": "model.embed_tokens.weight", layer + "shared_head.head.weight": head}
    return copies


def to_hf(model: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanotron's tensors -> DeepSeek-V3's files: MTP modules as the layers after the last, RoPE rows back in
    interleaved pairs, experts per expert, the routing bias under its name."""
    out = {}
    weights = {mtp_hf_name(model, name): tensor for name, tensor in weights.items()}
    weights |= {copy: weights[name].clone() for copy, name in mtp_shared_copies(model).items()}  # files share none
    for name, tensor in weights.items():
        rows = _rope_rows(model, name)
        out[name] = tensor if rows is None else tensor[rows.argsort()]
    biases = {n.replace(*BIAS): t for n, t in out.items() if n.endswith(BIAS[0])}
    if model.moe.enabled:
        out = mixtral.to_hf(out, model.moe.num_experts, EXPERT_FILES)
    return dict(sorted((out | biases).items()))


def file_names(model: ModelConfig, expected: dict[str, torch.Size], stacked: bool) -> list[str]:
    """The names to read from a DeepSeek-V3 folder (per-expert, or transformers 5's stacked names)."""
    expected = {mtp_hf_name(model, name): shape for name, shape in expected.items()}
    if not model.moe.enabled:
        return list(expected)
    names = mixtral.file_names(expected, model.moe.num_experts, stacked, EXPERT_FILES)
    return names + [n.replace(*BIAS) for n in expected if n.endswith(BIAS[0])]


def from_hf(
    model: ModelConfig, files: dict[str, torch.Tensor], expected: dict[str, torch.Size], interleaved: bool
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's tensors -> nanotron's state dict (RoPE rows as split halves when the file interleaves them)."""
    ours = {mtp_hf_name(model, name): name for name in expected}
    expected = {mtp_hf_name(model, name): shape for name, shape in expected.items()}
    weights = dict(files)
    if model.moe.enabled:
        weights = mixtral.from_hf(files, expected, model.moe.num_experts, EXPERT_FILES)
        weights |= {n: files[n.replace(*BIAS)] for n in expected if n.endswith(BIAS[0])}
    for name, tensor in weights.items():
        rows = _rope_rows(model, name) if interleaved else None
        if rows is not None and tensor.shape[0] == rows.numel():  # a wrong shape is named by the caller
            weights[name] = tensor[rows]
    return {ours.get(name, name): tensor for name, tensor in weights.items()}


def mtp_layers_stored(model: ModelConfig, names: set[str]) -> bool:
    """Whether a folder's tensor names include every MTP layer's projection (DeepSeek's own checkpoints do; one
    transformers saved does not)."""
    return all(f"model.layers.{model.num_layers + k}.eh_proj.weight" in names for k in range(model.mtp_depth))
