"""Llama decoder in plain PyTorch: RMSNorm, RoPE (split halves), GQA through SDPA, SwiGLU or mixture-of-experts
MLPs (`nanotron.models.moe`, Mixtral's layout); Qwen3 is this model with options (`qk_norm`, a `head_dim` apart
from hidden_size / num_heads), SmolLM3 with layers that skip RoPE (`nope_layers`).

Parameter names equal Hugging Face `LlamaForCausalLM`'s (and `Qwen3ForCausalLM`'s, `SmolLM3ForCausalLM`'s), so
checkpoints export without a rename table. Nothing here knows about parallelism: reshapes use -1 for head counts so
tensor-parallel shards (fewer local heads) run the same code, and pipeline stages are this module with parts set to
None.
`nanotron.models.parametrization` says how each parameter is initialised (`nanotron.parallel.init` draws the
values) and which multipliers µP applies here: plain scalars from the config, 1 under standard parametrization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import ModelConfig
from nanotron.models.attention import DotProductAttention
from nanotron.models.moe import MoE
from nanotron.models.parametrization import multipliers
from nanotron.models.shapes import is_moe_layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the plain formula, which the compiler fuses
            return rms_norm(x, self.weight, self.eps)
        return _Normalization.apply(x, x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain formula (HF's): normalise in fp32, then cast back, so bf16 runs keep their precision here."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _Normalization(torch.autograd.Function):
    """RMSNorm in eager mode, bit for bit the plain formula (`rms_norm`, HF's) forward and backward, keeping less:
    only the input and each row's 1/rms are saved (the plain formula's autograd keeps an fp32 copy of the input
    and the normalised value too: per norm, 4 of 8 bytes per element in fp32 and 4 of 6 in bf16), the normalised
    value is recomputed in backward, and the forward writes two full-size buffers instead of three. The backward
    is autograd's own sequence of roundings for the plain formula, with rewrites that change no bit (the mean's
    and the square's factors, 1/n and 2, applied to the per-row scalar before it meets x; products in place).
    In fp32 the plain formula uses x itself twice (x.float() is x), so autograd adds the two paths' gradients into
    x's one after the other, after the residual stream's: x is passed twice to get the same two additions in the
    same order (one summed gradient would round differently). About half the plain formula's time on CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, _again: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        normed = torch.mul(h, rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        if normed.dtype == torch.promote_types(normed.dtype, weight.dtype):
            return normed.mul_(weight)  # weight * normed: the same products
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.float()
        normed = torch.mul(h, rstd).to(x.dtype)
        leading = tuple(range(grad.dim() - 1))
        grad_weight = (grad * normed).sum(dim=leading, keepdim=True).view(weight.shape).to(weight.dtype)
        g = (grad * weight).to(x.dtype).float()  # through the cast back to x's dtype, as autograd goes
        grad_rstd = (g * h).sum(-1, keepdim=True)
        # d/dh of rsqrt(mean(h^2) + eps): -1/2 rstd^3, then 1/n (the mean) and 2 h (the square)
        per_row = (-0.5 * grad_rstd * rstd.pow(3)) / h.shape[-1] * 2
        along, through_rms = g.mul_(rstd), h * per_row  # the gradient through h * rstd, and through rstd's mean(h^2)
        if x.dtype == torch.float32:  # h is x itself: autograd adds the two into x's gradient one at a time
            return along, through_rms, grad_weight, None
        return along.add_(through_rms).to(x.dtype), None, grad_weight, None


def rope_cache(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """cos and sin tables, stacked as [2, max_seq_len, head_dim]; with `positions`, only their rows (the same
    values: each row depends on its position alone)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if positions is None:
        positions = torch.arange(max_seq_len, device=device)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor, seq_dim: int = 2) -> torch.Tensor:
    """Rotates split halves (HF's rotate_half) by the angles of `rope`'s rows: x is [batch, heads, seq, head_dim]
    (`seq_dim` 2) or [batch, seq, heads, head_dim] (`seq_dim` 1: before the heads are transposed, where the rows
    are contiguous and the rotation streams through memory)."""
    half = x.shape[-1] // 2
    cos, sin = rope[0, : x.shape[seq_dim], :half].to(x.dtype), rope[1, : x.shape[seq_dim], :half].to(x.dtype)
    if seq_dim == 1:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if torch.compiler.is_compiling():  # traced: the plain formula, which the compiler fuses into one kernel
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return _Rotation.apply(x, cos, sin)


class _Rotation(torch.autograd.Function):
    """RoPE's rotation in eager mode: each half written straight into the output (no rotated copy of x, no
    negation, no concatenation: 2 passes over x instead of 5, and fewer fresh buffers); its gradient is the
    rotation by the opposite angles. Nothing of x is saved: only the (small) cos and sin rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """[x1 cos - sign x2 sin, x2 cos + sign x1 sin] for x's halves x1, x2, in a new tensor laid out like x."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first)
    first.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=second)
    second.addcmul_(x1, sin, value=sign)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        # NoPE (SmolLM3, Llama 4): the layers of `model.nope_layers` apply no position encoding at all
        self.rotary = index not in cfg.nope_layers
        # softmax(q k^T scale) v over the sequence; context parallelism swaps in ring attention (no parameters)
        self.core = DotProductAttention(multipliers(cfg).attention_scale)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3's QK-norm: one RMSNorm weight over head_dim, shared by every head (so replicated under TP)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = apply_rope(q, rope, seq_dim=1), apply_rope(k, rope, seq_dim=1)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v, doc)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1; V3): keys and values expanded per
    head from one compressed latent per token (kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj), queries likewise
    when q_lora_rank > 0; RoPE only on a decoupled part of each head, the key's one head shared by every head.
    Names are transformers' DeepseekV3Attention's. The softmax scale is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
    (SDPA's default at that width); YaRN's mscale is not carried (a scaled RoPE is refused at import)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope, self.rope_dim, self.value_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        heads, qk_head_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.core = DotProductAttention(None)
        # Where the one RoPE key head meets the heads (parameterless): tensor parallelism sums its gradient over
        # the tp ranks, each of which sees only its own heads' share.
        self.shared_key = nn.Identity()
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = (
            q.view(bsz, seq, -1, self.nope + self.rope_dim).transpose(1, 2).split([self.nope, self.rope_dim], dim=-1)
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, seq, -1, self.nope + self.value_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.value_dim], dim=-1)
        k_rope = apply_rope(self.shared_key(k_rope).view(bsz, 1, seq, self.rope_dim), rope)  # one for all heads
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = self.core(q, k, v.contiguous(), doc)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def feed_forward(cfg: ModelConfig, index: int) -> nn.Module:
    """Layer `index`'s MLP: dense, or a mixture of experts (with its shared experts, if any)."""
    if not is_moe_layer(cfg, index):
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    moe = cfg.moe
    shared = (
        MLP(cfg.hidden_size, moe.num_shared_experts * moe.moe_intermediate_size) if moe.num_shared_experts else None
    )
    return MoE(cfg, shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg) if cfg.mla else Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, index)
        self.residual_multiplier = multipliers(cfg).residual

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        x = x + _scaled(self.self_attn(self.input_layernorm(x), rope, doc), self.residual_multiplier)
        return x + _scaled(self.mlp(self.post_attention_layernorm(x)), self.residual_multiplier)


class MultiTokenPrediction(nn.Module):
    """One depth k of DeepSeek-V3's multi-token prediction (arXiv:2412.19437 section 2.2): the previous depth's
    hidden state (the model's final-normed output at k = 1) and the embedding of token t+k, each RMS-normed,
    concatenated (embedding first, as DeepSeek-V3's checkpoint's eh_proj reads them), projected 2h -> h, through
    one decoder layer of the model's kind (index num_layers + k - 1: a MoE layer where the model's deep layers
    are); `norm` before the shared head. Names are the checkpoint's (enorm, hnorm, eh_proj, shared_head.norm)."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_layers + depth)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, doc: torch.Tensor | None):
        """The block's output (the next depth's input; `norm` then the head give this depth's logits)."""
        return self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)), rope, doc)


class LlamaModel(nn.Module):
    """Embedding, decoder layers keyed by global index, final norm. A pipeline stage keeps a subset."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("rope", rope_cache(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        # The sequence positions of this module's tokens when they are not 0..seq-1 (a context-parallel rank's
        # chunks): the RoPE table keeps only their rows, in order.
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """`doc`: a document id per token of the whole sequence, for attention within documents only."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope, doc)
        return self.norm(h) if self.norm is not None else h


class LlamaForCausalLM(nn.Module):
    """Token ids -> logits (or hidden states on a pipeline stage without the head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.logit_multiplier = multipliers(cfg).logits
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Multi-token prediction: on the last pipeline stage only (with the head), None when off.
        self.mtp: nn.ModuleDict | None = None
        if cfg.mtp_depth:
            self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(cfg, k) for k in range(cfg.mtp_depth)})

    def forward(
        self,
        x: torch.Tensor,
        doc: torch.Tensor | None = None,
        window: tuple[int, int] | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`window` (lo, hi): logits of positions lo..hi-1 only (scoring needs a few positions per row; the head
        is most of a small model's forward). `mtp_tokens` [batch, seq, mtp_depth]: at each position t, tokens
        t+1..t+mtp_depth (what the MTP modules embed). The first stage embeds them and every stage but the last
        hands them on beside its hidden states ([..., (1 + mtp_depth) x hidden]), so the embedding's gradient
        flows back through the pipeline to the one embedding. In training the logits are then the main ones and
        each depth's, concatenated on the sequence dimension; in eval mode the main ones only."""
        x, embedded = self._mtp_inputs(x, mtp_tokens)
        h = self.model(x, doc)
        if self.lm_head is None:
            return h if embedded is None else torch.cat([h, embedded], dim=-1)
        if window is not None:  # a sequence-sharded DTensor (sequence parallelism) is gathered by the slice
            h = h[:, window[0] : window[1]]
        logits = _scaled(self.lm_head(h), self.logit_multiplier)
        if embedded is None or not self.training:
            return logits
        depths = [logits]
        width = self.config.hidden_size
        for k, module in enumerate(self.mtp.values()):
            h = module(h, embedded[..., k * width : (k + 1) * width], self.model.rope, doc)
            depths.append(_scaled(self.lm_head(module.norm(h)), self.logit_multiplier))
        return torch.cat(depths, dim=1)

    def _mtp_inputs(self, x: torch.Tensor, mtp_tokens: torch.Tensor | None):
        """(this stage's input, the MTP tokens' embeddings [batch, seq, mtp_depth x hidden] or None)."""
        if not self.config.mtp_depth or mtp_tokens is None:
            return x, None
        if self.model.embed_tokens is not None:
            return x, self.model.embed_tokens(mtp_tokens).flatten(2)
        hidden = self.config.hidden_size
        return x[..., :hidden], x[..., hidden:]

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recomputes the RoPE table and zeroes the MoE buffers (a model built on the meta device has none)."""
        cfg = self.config
        # under cp only this rank's rows: the whole table first would be a start-up peak (16 GiB at 2**24 positions)
        self.model.rope = rope_cache(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, device, self.model.positions)
        for module in self.modules():
            if isinstance(module, MoE):  # a routing bias starts at zero (a checkpoint load then overwrites it)
                for buffer in (
                    module.gate.expert_bias,
                    module.tokens_per_expert,
                    module.dropped_tokens,
                    module.aux_loss,
                ):
                    buffer.data = torch.zeros_like(buffer, device=device)


def decoder_layers(model: LlamaForCausalLM) -> list[tuple[int, DecoderLayer]]:
    """(global index, layer) of every decoder layer `model` (or its pipeline stage) holds: the model's, then the
    MTP modules' blocks (index num_layers + k), which the parallel plans treat as the model's layers."""
    layers = [(int(name), layer) for name, layer in model.model.layers.items()]
    if model.mtp is not None:
        layers += [(model.config.num_layers + int(k), module.block) for k, module in model.mtp.items()]
    return layers


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x times a µP multiplier; no extra op where it is 1 (standard parametrization stays bit-identical)."""
    return x if multiplier == 1.0 else x * multiplier
