"""The [model] section: the model's shape, its mixture of experts ([model.moe]), µP's base shape
([model.mup_base]) and the size presets."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nanotron.config.option import opt


@dataclass
class MoEConfig:
    """[model.moe]: mixture-of-experts MLPs (token choice, dropless by default); num_experts = 0 is a dense model."""

    num_experts: int = opt(0, "routed experts per MoE layer; 0 = dense model (no MoE)", min=0)
    top_k: int = opt(2, "experts each token is routed to", min=1)
    moe_intermediate_size: int = opt(0, "SwiGLU width of each expert; 0 = model.intermediate_size", min=0)
    num_shared_experts: int = opt(
        0, "experts every token passes through (one MLP of num_shared_experts x moe_intermediate_size)", min=0
    )
    first_dense_layers: int = opt(0, "the first k layers keep a dense MLP", min=0)
    router: str = opt(
        "softmax_topk",
        "softmax_topk (Mixtral/Qwen: softmax over experts, top k) or sigmoid (DeepSeek-V3: sigmoid scores, "
        "top k, gates normalised over the chosen experts)",
        ("softmax_topk", "sigmoid"),
    )
    renormalize: bool = opt(True, "softmax_topk: gates of the chosen experts renormalised to sum to 1")
    num_expert_groups: int = opt(
        1,
        "grouped routing (DeepSeek-V3's n_group): the experts in this many equal groups, each scored by the sum of "
        "its two best experts' scores (+ routing bias); 1 = no groups",
        min=1,
    )
    top_expert_groups: int = opt(
        0,
        "grouped routing (DeepSeek-V3's topk_group): each token chooses its experts from this many best groups; "
        "0 = all groups",
        min=0,
    )
    routed_scaling_factor: float = opt(
        1.0, "the routed experts' gates multiplied by this (DeepSeek-V3's routed_scaling_factor, 2.5 there)", min=0.0
    )
    bias_update_rate: float = opt(
        0.0,
        "auxiliary-loss-free load balancing (DeepSeek-V3): after each step every expert's routing bias moves "
        "by this much towards the mean load (global count over the step); 0 = off. The bias only chooses "
        "experts, it never scales their outputs",
        min=0.0,
    )
    aux_loss_coef: float = opt(
        0.0, "sequence-wise auxiliary balance loss coefficient (DeepSeek-V3's alpha); 0 = off", min=0.0
    )
    capacity_factor: float = opt(
        0.0,
        "0 = dropless; otherwise each expert takes at most ceil(capacity_factor x seq_len x top_k / "
        "num_experts) tokens of each sequence (the earliest), the rest are dropped (counted in the metrics)",
        min=0.0,
    )

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass
class MupBase:
    """[model.mup_base]: the shape of the base model µP's hyperparameters were tuned on (as microsoft/mup's base
    shapes). Each parameter's fan-in and fan-out are compared with the base's, so every matrix gets its own
    width multiplier. 0 = this model's own value where that is unambiguous; once the base width differs, the
    MLP width and the attention shape must be stated (model.validate says which)."""

    hidden: int = opt(0, "hidden_size of the base model; 0 = this model's", min=0)
    intermediate: int = opt(0, "intermediate_size of the base model; 0 = this model's (only at its width)", min=0)
    heads: int = opt(0, "num_heads of the base model; 0 = hidden / head_dim, or this model's", min=0)
    kv_heads: int = opt(0, "num_kv_heads of the base model; 0 = this model's (only at its head count)", min=0)
    head_dim: int = opt(0, "head dim of the base model; 0 = hidden / heads", min=0)
    layers: int = opt(0, "num_layers of the base model; 0 = this model's", min=0)

    @property
    def set(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


@dataclass
class ModelConfig:
    size: str = opt("tiny", "preset filling the fields left unset", ("tiny", "small", "base", "large"))
    hidden_size: int | None = opt(None, "model width", min=1)
    intermediate_size: int | None = opt(None, "SwiGLU hidden width", min=1)
    num_layers: int | None = opt(None, "decoder layers", min=1)
    num_heads: int | None = opt(None, "attention (query) heads", min=1)
    num_kv_heads: int | None = opt(None, "key/value heads (GQA); divides num_heads", min=1)
    head_dim: int | None = opt(
        None,
        "width of each query/key/value head; unset = hidden_size / num_heads. Qwen3 decouples it: q/k/v/o "
        "project hidden_size <-> heads x head_dim",
        min=2,
    )
    qk_norm: bool = opt(False, "RMSNorm over head_dim on every query and key head before RoPE (Qwen3's QK-norm)")
    nope_layers: list[int] = opt(
        [],
        "decoder layers (0-based) whose attention applies no RoPE (NoPE; SmolLM3 skips it in every 4th layer: "
        "3,7,11,...); [] = RoPE in every layer",
    )
    kv_lora_rank: int = opt(
        0,
        "multi-head latent attention (DeepSeek-V2/V3's MLA) when > 0: keys and values are expanded per head from a "
        "latent of this width (kv_a_proj_with_mqa, its RMSNorm, kv_b_proj); 0 = standard attention",
        min=0,
    )
    q_lora_rank: int = opt(
        0, "MLA: queries through a latent of this width (q_a_proj, its RMSNorm, q_b_proj); 0 = one q_proj", min=0
    )
    qk_nope_head_dim: int = opt(0, "MLA: the part of each query/key head without RoPE (from the latents)", min=0)
    qk_rope_head_dim: int = opt(
        0, "MLA: the RoPE part of each query/key head; the key's is one head shared by all heads (even)", min=0
    )
    v_head_dim: int = opt(0, "MLA: width of each value head (o_proj reads num_heads x v_head_dim)", min=0)
    vocab_size: int | None = opt(None, "embedding rows; at least the tokenizer's vocab", min=1)
    max_seq_len: int | None = opt(
        None,
        "longest sequence RoPE is precomputed for; at most 2**24 = 16,777,216, where the table's float32 positions "
        "stop being exact (16x the ~1M tokens long-context models train at)",
        min=1,
        max=2**24,
    )
    rope_theta: float | None = opt(None, "RoPE base", min=1.0)
    rms_norm_eps: float | None = opt(None, "RMSNorm epsilon", min=0.0)
    tie_word_embeddings: bool | None = opt(None, "share embedding and lm_head weights")
    mtp_depth: int = opt(
        0,
        "multi-token prediction (DeepSeek-V3's MTP, arXiv:2412.19437 section 2.2): this many extra modules after "
        "the model, module k predicting token t+k+1 from module k-1's hidden state and the embedding of token t+k "
        "(embedding and head shared with the model; weighted by training.mtp_loss_weight); 0 = off (nothing built)",
        min=0,
    )
    attention: str = opt(
        "causal",
        "causal, or document: packed sequences attend only within their own document (documents end at the "
        "tokenizer's EOS) and the token after an EOS carries no loss",
        ("causal", "document"),
    )
    moe: MoEConfig = field(
        default_factory=MoEConfig, metadata={"help": "mixture of experts: a [model.moe] table", "choices": None}
    )
    init_std: float = opt(0.02, "std of the normal init of linear and embedding weights", min=0.0)
    parametrization: str = opt(
        "standard",
        "standard, or mup (µP: init, LR and multipliers scaled so hyperparameters tuned at the [model.mup_base] "
        "shape transfer to this width and depth)",
        ("standard", "mup"),
    )
    mup_base: MupBase = field(
        default_factory=MupBase,
        metadata={"help": "µP: the base model's shape, a [model.mup_base] table", "choices": None},
    )
    mup_depth_exponent: float = opt(
        1.0,
        "µP: alpha of the depth scaling, with r = num_layers / mup_base.layers: residual branches x r^-alpha, "
        "the LR of each layer's parameters x r^(alpha-1); 1 = CompleteP, 0.5 = depth-µP",
        min=0.5,
    )

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) in place of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates in each query/key head: MLA's decoupled part, else the whole head."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_dim(self) -> int:
        """The width of each value head (and of each head's attention output)."""
        return self.v_head_dim if self.mla else self.head_dim

    @staticmethod
    def every_nth(num_layers: int, interval: int) -> list[int]:
        """The layers i with (i + 1) % interval == 0: SmolLM3's NoPE layers from an interval (transformers' and the
        original nanotron's rule)."""
        return [i for i in range(num_layers) if (i + 1) % interval == 0]

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has a mixture of experts in place of its dense MLP."""
        return self.moe.num_experts > 0 and index >= self.moe.first_dense_layers


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=8192,
        max_seq_len=256,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        vocab_size=32000,
        max_seq_len=2048,
    ),
    "base": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        vocab_size=32000,
        max_seq_len=2048,
    ),
    "large": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        vocab_size=32000,
        max_seq_len=2048,
    ),
}
PRESET_COMMON = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
