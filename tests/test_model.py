"""The model is Hugging Face's Llama: same names, same logits for the same weights."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nanotron.config import ModelConfig
from nanotron.models.llama import LlamaForCausalLM, RMSNorm, apply_rope, rms_norm, rope_cache
from nanotron.models.shapes import flops_per_token, layer_shapes, num_params, root_shapes
from nanotron.parallel.init import init_weights

transformers = pytest.importorskip("transformers")


def small_config(**overrides) -> ModelConfig:
    from nanotron.config.validate import resolve_model

    fields = dict(
        hidden_size=64,
        intermediate_size=160,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=300,
        max_seq_len=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg = ModelConfig(**{**fields, **overrides})
    resolve_model(cfg)
    return cfg


def qwen3_config(**overrides) -> ModelConfig:
    """small_config as Qwen3 has it: QK-norm, and a head_dim apart from hidden / heads (8 x 12 = 96 != 64)."""
    return small_config(qk_norm=True, head_dim=12, **overrides)


def mla_config(**overrides) -> ModelConfig:
    """small_config with DeepSeek-V3's multi-head latent attention: latents of 24 (queries) and 16 (keys/values),
    heads of 8 + 4 (nope + rope) for queries/keys and 6 for values, every head its own keys and values."""
    fields = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    return small_config(**{"num_kv_heads": None, **fields, **overrides})


def hf_twin(cfg: ModelConfig, family: str = "Llama") -> "transformers.PreTrainedModel":
    """transformers' `family` (Llama, Qwen3, SmolLM3 or DeepseekV3) model of the same shape, eager attention,
    random weights."""
    fields = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False,
    )
    if family == "Qwen3":
        fields |= dict(head_dim=cfg.head_dim, use_sliding_window=False)
    elif family == "SmolLM3":  # a 1 (RoPE) or 0 (NoPE) per layer
        nope = [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]
        fields |= dict(no_rope_layers=nope, mlp_bias=False, pad_token_id=None)  # its default pad id is 128004
    elif family == "DeepseekV3":  # dense MLA: every layer below first_k_dense_replace; RoPE on split halves
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        fields |= {key: getattr(cfg, key) for key in mla}
        fields |= dict(q_lora_rank=cfg.q_lora_rank or None, first_k_dense_replace=cfg.num_layers, rope_interleave=False)
    else:
        fields |= dict(mlp_bias=False)
    hf_cfg = getattr(transformers, f"{family}Config")(**fields)
    hf_cfg._attn_implementation = "eager"
    return getattr(transformers, f"{family}ForCausalLM")(hf_cfg).eval()


def assert_same_logits(model: LlamaForCausalLM, hf) -> None:
    """`hf` loaded with `model`'s weights (names equal; only its RoPE buffers not in ours) gives the same logits."""
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected
    assert all("rotary_emb" in k for k in missing)
    tokens = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_llama_with_gqa(tied):
    cfg = small_config(tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    assert_same_logits(model, hf_twin(cfg))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_qwen3_with_qk_norm_and_decoupled_head_dim(tied):
    """Qwen3 = this model with qk_norm and head_dim 12 (8 heads x 12 = 96 != hidden 64); the norm weights are
    drawn at random, so a q/k mix-up or a norm in the wrong place shows."""
    cfg = qwen3_config(tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    random_norms(model)
    assert_same_logits(model, hf_twin(cfg, "Qwen3"))


def test_logits_match_transformers_smollm3_whose_nope_layers_skip_rope():
    """SmolLM3 = this model with RoPE skipped in `nope_layers` (the first and last of 3, the middle one rotated)."""
    cfg = small_config(nope_layers=[0, 2])
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    assert_same_logits(model, hf_twin(cfg, "SmolLM3"))
    # the Llama twin (RoPE everywhere) differs: the NoPE layers are not a no-op
    missing, _ = (llama := hf_twin(small_config())).load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - llama(tokens).logits).abs().max().item() > 1e-3


def random_norms(model: LlamaForCausalLM) -> None:
    """Every RMSNorm weight drawn around 1, so a norm applied to the wrong tensor (or skipped) shows."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=gen))


@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_logits_match_transformers_deepseek_v3_latent_attention(q_lora_rank):
    """DeepSeek-V3's MLA (queries through a latent, or one q_proj at q_lora_rank 0) with random norm weights: the
    latents' norms, the decoupled RoPE part with its one shared key head and the 1/sqrt(nope + rope) scale."""
    cfg = mla_config(q_lora_rank=q_lora_rank)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=0)
    random_norms(model)
    assert_same_logits(model, hf_twin(cfg, "DeepseekV3"))


def test_parameter_names_are_hf_names():
    names = set(LlamaForCausalLM(small_config()).state_dict())
    hf_names = set(hf_twin(small_config()).state_dict())
    assert names == {n for n in hf_names if "rotary_emb" not in n}


def test_init_depends_only_on_seed_and_meta_init_matches_eager():
    cfg = small_config()
    eager = LlamaForCausalLM(cfg)
    init_weights(eager, seed=3)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(eager.model.rope, meta.model.rope)
    other = LlamaForCausalLM(cfg)
    init_weights(other, seed=4)
    assert not torch.equal(other.lm_head.weight, eager.lm_head.weight)


def moe_config(**overrides) -> ModelConfig:
    """small_config with a mixture of experts after one dense layer (6 experts of width 48, top 2, a shared one)."""
    from nanotron.config.validate import resolve_model

    cfg = small_config(**overrides)
    moe = cfg.moe
    moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.num_shared_experts, moe.first_dense_layers = (
        6,
        2,
        48,
        1,
        1,
    )
    resolve_model(cfg)
    return cfg


def config_of(kind: str) -> ModelConfig:
    if kind == "moe":
        return moe_config()
    if kind == "mtp":  # multi-token prediction, depth 2: the MTP blocks are MoE layers (index >= num_layers)
        return moe_config(mtp_depth=2)
    if kind.startswith("mla"):  # mla: queries through a latent; mla_q: one q_proj
        return mla_config(q_lora_rank=24 if kind == "mla" else 0)
    return (qwen3_config if kind == "qwen3" else small_config)(tie_word_embeddings=kind == "tied")


@pytest.mark.parametrize("kind", ["untied", "tied", "moe", "qwen3", "mla", "mla_q", "mtp"])
def test_shapes_table_is_the_built_models(kind):
    """models/shapes.py (what the planner and MFU read) names every parameter of the model with its shape."""
    cfg = config_of(kind)
    built = {name: tuple(p.shape) for name, p in LlamaForCausalLM(cfg).named_parameters()}
    table = dict(root_shapes(cfg))
    for i in range(cfg.num_layers):
        table |= {f"model.layers.{i}.{name}": shape for name, shape in layer_shapes(cfg, i).items()}
    assert table == built


def test_param_count_follows_the_config():
    cfg = small_config()
    assert num_params(cfg) == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    moe = moe_config()
    assert num_params(moe) == sum(p.numel() for p in LlamaForCausalLM(moe).parameters())
    tied = small_config(tie_word_embeddings=True)
    assert num_params(tied) == sum(p.numel() for p in LlamaForCausalLM(tied).parameters())
    qwen3 = qwen3_config()
    assert num_params(qwen3) == sum(p.numel() for p in LlamaForCausalLM(qwen3).parameters())
    mla = mla_config()
    assert num_params(mla) == sum(p.numel() for p in LlamaForCausalLM(mla).parameters())


@pytest.mark.parametrize("kind", ["untied", "tied", "moe", "qwen3", "mla", "mtp"])
def test_flops_per_token_equals_the_matmul_flops_torch_counts(kind):
    """An independent count: FlopCounterMode over a real forward + backward (SDPA's math backend, whose
    matmuls the counter sees; the fused CPU kernel is invisible to it). A mixture of experts counts its active
    parameters: each routed copy of a token meets one expert, plus the router and the shared expert. Multi-token
    prediction: each depth's projection, MoE block and head pass."""
    cfg = config_of(kind)
    model = LlamaForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    extra = {"mtp_tokens": tokens[..., None].expand(-1, -1, cfg.mtp_depth)} if cfg.mtp_depth else {}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens, **extra)
        F.cross_entropy(logits.flatten(0, 1), tokens.repeat(1, 1 + cfg.mtp_depth).flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq_len=48) * tokens.numel()


@pytest.mark.parametrize("seq_dim", [2, 1])
def test_rope_rotation_is_rotate_half_and_its_gradient_the_inverse_rotation(seq_dim, monkeypatch):
    """The eager rotation (each half written into the output) against HF's x cos + rotate_half(x) sin in float64,
    in both layouts ([b, h, s, d] and [b, s, h, d]), with gradcheck on the hand-written backward; and the formula
    the compiler traces (the plain ops) equals it."""
    rope = rope_cache(8, 12, 1e4).double()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 12, 8, dtype=torch.float64, generator=gen)  # [b, h, s, d]
    cos, sin = rope[0], rope[1]
    expected = x * cos + torch.cat([-x[..., 4:], x[..., :4]], dim=-1) * sin

    def rotated(t):
        t = t if seq_dim == 2 else t.transpose(1, 2)
        out = apply_rope(t, rope, seq_dim=seq_dim)
        return out if seq_dim == 2 else out.transpose(1, 2)

    torch.testing.assert_close(rotated(x), expected, rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(rotated, (x.clone().requires_grad_(),))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(rotated(x), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_rms_norm_is_the_plain_formula_bit_for_bit_and_keeps_only_its_input_and_1_over_rms(dtype, weight_dtype):
    """The eager RMSNorm (an autograd function) against the plain formula (HF's, which the compiler traces): the
    same output bits and the same gradient bits for input and weight as autograd gives the plain formula (so no
    layout, float8 row or HF comparison sees the change), in fp32, bf16, and bf16 under an fp32 weight; and for
    backward it keeps only its input and one fp32 1/rms per row (the plain formula also keeps the fp32 input and
    the normalised value)."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 5, 64), (2, 33, 256)]:
        norm = RMSNorm(shape[-1], 1e-5).to(weight_dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
        x = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_()

        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(saved_into(saved), lambda t: t):
            out = norm(x)
        grad = torch.randn(out.shape, generator=gen).to(out.dtype)
        out.backward(grad)
        kept = sum(t.numel() * t.element_size() for t in saved if not isinstance(t, torch.nn.Parameter))
        assert kept == x.numel() * x.element_size() + x[..., 0].numel() * 4, [(t.shape, t.dtype) for t in saved]

        plain_x, plain_w = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
        expected = rms_norm(plain_x, plain_w, 1e-5)
        expected.backward(grad)
        assert torch.equal(out, expected)
        assert torch.equal(x.grad, plain_x.grad)
        assert torch.equal(norm.weight.grad, plain_w.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mla"])
def test_a_model_with_the_eager_rms_norm_has_the_plain_formulas_loss_and_gradients_bit_for_bit(
    dtype, family, monkeypatch
):
    """In a whole model (norms beside the residual stream, the final norm, Qwen3's QK-norm, MLA's latent norms) the
    eager RMSNorm's loss and every parameter's gradient equal the plain formula's (the compiler's path) bit for
    bit: the order in which the norm's gradient pieces reach the residual stream is autograd's for the plain
    formula too."""
    cfg = {"llama": small_config, "qwen3": qwen3_config, "mla": mla_config}[family]()
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager = loss_and_grads()
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: rms_norm(x, self.weight, self.eps))
    plain_loss, plain = loss_and_grads()
    assert torch.equal(eager_loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(eager, plain, strict=True))


def saved_into(saved: list[torch.Tensor]):
    """A pack hook for saved_tensors_hooks that records each tensor autograd saves."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    return pack
