"""Cross-field checks of a resolved config: run before any process group exists, so an error is one line."""

from __future__ import annotations

import re
from dataclasses import fields

from nanotron.config.engines import PP_ENGINES
from nanotron.config.model import PRESET_COMMON, PRESETS, ModelConfig
from nanotron.config.mup import resolve_mup
from nanotron.config.schema import Config
from nanotron.config.training import FLOAT8_KERNEL_MULTIPLE
from nanotron.errors import ConfigError
from nanotron.records import LARGEST

# A run name is one path component (the run dir under job.out_dir) and the Slurm job name: no separators, no "..",
# nothing a shell or a file system treats specially.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
RUN_NAME_RULE = "up to 100 letters, digits, '.', '_' and '-', starting with a letter or digit"


def check_ranges(section_name: str, section: object) -> None:
    """Every field's choices and bounds, as the schema declares them."""
    for f in fields(section):
        value, meta = getattr(section, f.name), f.metadata
        key = f"{section_name}.{f.name}"
        if value is None:
            continue
        if meta.get("choices") and value not in meta["choices"]:
            opts = ", ".join(repr(c) for c in meta["choices"])
            raise ConfigError(f"{key}: expected one of {opts}, got {value!r}")
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"{key}: expected a value >= {meta['min']}, got {value!r}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"{key}: expected a value <= {meta['max']}, got {value!r}")
        if meta.get("below") is not None and value >= meta["below"]:
            raise ConfigError(f"{key}: expected a value < {meta['below']}, got {value!r}")


def resolve_model(model: ModelConfig) -> None:
    """Fills the fields left unset from the `model.size` preset, then checks the shape is a valid Llama."""
    check_ranges("model", model)
    kv_heads_unset = model.num_kv_heads is None
    for key, value in {**PRESET_COMMON, **PRESETS[model.size]}.items():
        if getattr(model, key) is None:
            setattr(model, key, value)
    check_ranges("model", model)
    m = model
    stray = [key for key in MLA_KEYS if getattr(m, key) and not m.mla]
    if stray:
        raise ConfigError(
            f"model.{stray[0]}={getattr(m, stray[0])} is a multi-head latent attention width, but model.kv_lora_rank"
            "=0 (standard attention); set kv_lora_rank > 0 for MLA, or leave it unset"
        )
    if m.mla:
        _resolve_mla(m, kv_heads_unset)
    elif m.head_dim is None:
        if m.hidden_size % m.num_heads:
            raise ConfigError(
                f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; change "
                "either, or set model.head_dim"
            )
        m.head_dim = m.hidden_size // m.num_heads
        if m.head_dim % 2:
            raise ConfigError(f"model.hidden_size / model.num_heads = {m.head_dim} must be even for RoPE")
    elif m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: expected an even number (RoPE rotates pairs)")
    if m.parametrization == "mup" and m.num_heads * m.head_dim != m.hidden_size:
        raise ConfigError(
            f"model.head_dim={m.head_dim} x model.num_heads={m.num_heads} differs from model.hidden_size="
            f"{m.hidden_size}, which model.parametrization='mup' does not support; unset model.head_dim"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}; "
            "pick num_kv_heads among its divisors"
        )
    check_ranges("model.mup_base", m.mup_base)
    resolve_mup(m)
    _resolve_moe(m)
    _check_nope_layers(m)


def _check_nope_layers(m: ModelConfig) -> None:
    """NoPE layers: distinct indices of decoder layers, and standard attention (MLA's RoPE is its own part)."""
    outside = [i for i in m.nope_layers if not 0 <= i < m.num_layers]
    if outside:
        raise ConfigError(
            f"model.nope_layers holds {outside[0]}: expected decoder layer indices 0..{m.num_layers - 1} "
            f"(model.num_layers={m.num_layers})"
        )
    if len(set(m.nope_layers)) < len(m.nope_layers):
        raise ConfigError(f"model.nope_layers={m.nope_layers} names a layer twice; list each layer once")
    if m.nope_layers and m.mla:
        raise ConfigError(
            "model.nope_layers is set with multi-head latent attention (model.kv_lora_rank > 0), whose RoPE is a "
            "separate part of each head; leave nope_layers empty"
        )


MLA_KEYS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _resolve_mla(m: ModelConfig, kv_heads_unset: bool) -> None:
    """Multi-head latent attention: its head widths all stated, every head its own keys and values (num_kv_heads
    = num_heads), head_dim the query/key head (nope + rope parts: SDPA's default 1/sqrt scale is DeepSeek's)."""
    missing = [key for key in MLA_KEYS[1:] if not getattr(m, key)]
    if missing:
        raise ConfigError(
            f"model.{missing[0]}: expected a value >= 1 with model.kv_lora_rank={m.kv_lora_rank} (multi-head latent "
            "attention needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim), got 0; set it, or kv_lora_rank=0"
        )
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim}: expected an even number (RoPE rotates pairs)")
    qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    conflicts = {
        f"model.head_dim={m.head_dim} (MLA's is qk_nope_head_dim + qk_rope_head_dim = {qk_head_dim}; unset it)": (
            m.head_dim not in (None, qk_head_dim)
        ),
        "model.qk_norm=true (MLA normalises its latents, not its heads; set it false)": m.qk_norm,
        f"model.num_kv_heads={m.num_kv_heads} (MLA expands keys and values for every head; unset it or set it to "
        f"num_heads={m.num_heads})": not kv_heads_unset and m.num_kv_heads != m.num_heads,
        "model.parametrization='mup' (µP's rules for the latent projections are not implemented; use 'standard')": (
            m.parametrization == "mup"
        ),
    }
    for what, bad in conflicts.items():
        if bad:
            raise ConfigError(f"{what} does not go with multi-head latent attention (model.kv_lora_rank > 0)")
    m.head_dim, m.num_kv_heads = qk_head_dim, m.num_heads


def _resolve_moe(m: ModelConfig) -> None:
    """[model.moe]: moe_intermediate_size filled from the model; the routing settings checked together."""
    moe = m.moe
    check_ranges("model.moe", moe)
    if not moe.enabled:
        return
    moe.moe_intermediate_size = moe.moe_intermediate_size or m.intermediate_size
    if moe.top_k > moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}; each token is routed "
            "to top_k distinct experts"
        )
    groups, top_groups = moe.num_expert_groups, moe.top_expert_groups or moe.num_expert_groups
    if groups > 1 and (moe.num_experts % groups or moe.num_experts // groups < 2):
        raise ConfigError(
            f"model.moe.num_expert_groups={groups} must divide model.moe.num_experts={moe.num_experts} into groups of "
            "at least 2 experts (a group scores its two best); pick a divisor, or 1 for no groups"
        )
    if top_groups > groups or moe.top_k > top_groups * (moe.num_experts // groups):
        raise ConfigError(
            f"model.moe.top_expert_groups={moe.top_expert_groups} with num_expert_groups={groups}: expected at most "
            f"{groups} groups holding at least top_k={moe.top_k} experts ({moe.num_experts // groups} per group)"
        )
    if moe.first_dense_layers >= m.num_layers:
        raise ConfigError(
            f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE layer in model.num_layers="
            f"{m.num_layers}; lower it, or set model.moe.num_experts=0 for a dense model"
        )
    if m.parametrization == "mup":
        raise ConfigError(
            "model.parametrization='mup' with model.moe.num_experts > 0 is not supported (µP's rules for routers "
            "and experts are not implemented); use parametrization='standard' for MoE models"
        )


def check_async_mode(mode: str, device_type: str) -> None:
    """async_pinned stages in pinned host memory, which torch allocates only with an accelerator (on a CPU-only
    build `pin_memory()` raises): refused on CPU here, and by the checkpoint manager once "auto" is resolved."""
    if mode == "async_pinned" and device_type == "cpu":
        raise ConfigError(
            "checkpoint.async_mode=async_pinned needs pinned host memory, which a cpu device has not; use "
            "checkpoint.async_mode=async"
        )


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Resolves presets and derived values, then checks every constraint between keys."""
    for section in fields(cfg):
        if section.name != "model":
            check_ranges(section.name, getattr(cfg, section.name))
    if cfg.job.seed >= 2**64:
        raise ConfigError(f"job.seed: expected a value below 2**64 (seeds are 64-bit), got {cfg.job.seed}")
    if not RUN_NAME.fullmatch(cfg.job.name):
        raise ConfigError(f"job.name {cfg.job.name!r}: expected {RUN_NAME_RULE} (it names the run dir in job.out_dir)")
    resolve_model(cfg.model)
    m, p, t, o = cfg.model, cfg.parallelism, cfg.training, cfg.optimizer
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas: expected two numbers in [0, 1), got {o.betas}")
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}")
    if 0 < o.decay_start < o.warmup_steps:
        raise ConfigError(
            f"optimizer.decay_start={o.decay_start} falls inside warmup (optimizer.warmup_steps={o.warmup_steps}): "
            f"expected 0 (decay when warmup ends) or a step >= {o.warmup_steps}"
        )
    for index, dataset in enumerate(cfg.data.datasets):
        if not dataset.path:
            raise ConfigError(
                f'data.datasets[{index}]: missing path; each [[data.datasets]] table needs path = "<a tokenized dir>" '
                "and weight = <a share>"
            )
        if not dataset.weight > 0:
            raise ConfigError(
                f"data.datasets[{index}].weight: expected a number > 0 (a share relative to the other datasets' "
                f"weights), got {dataset.weight}"
            )
    names = set()
    for index, task in enumerate(cfg.evaluation.tasks):
        if not task.path:
            raise ConfigError(
                f"evaluation.tasks[{index}]: missing path; each [[evaluation.tasks]] table needs "
                'path = "<items.jsonl>" (and optionally name = "<task>")'
            )
        if (name := task.task_name) in names:
            raise ConfigError(
                f"evaluation.tasks[{index}]: a second task named '{name}'; give each [[evaluation.tasks]] its own name"
            )
        names.add(name)
    if cfg.logging.activation_stats_interval and t.compile:
        raise ConfigError(
            "logging.activation_stats_interval needs training.compile=false: a compiled layer ignores forward "
            "hooks added after it was compiled; measure activations in an eager run, or set "
            "logging.activation_stats_interval=0"
        )
    check_async_mode(cfg.checkpoint.async_mode, t.device)
    _validate_stability(cfg)
    _validate_parallelism(cfg)
    _validate_float8(cfg)
    _validate_mtp(cfg)
    if world_size is not None and world_size != cfg.world_size:
        raise ConfigError(
            f"parallelism dp*cp*tp*pp = {p.dp}*{p.cp}*{p.tp}*{p.pp} = {cfg.world_size} but {world_size} "
            f"processes were launched; set dp, cp, tp, pp so their product is {world_size}"
        )
    _resolve_batch(cfg)
    if p.pp > 1 and t.grad_accum_steps < PP_ENGINES[p.pp_engine].min_microbatches(p.pp):
        raise ConfigError(
            f"parallelism.pp_engine='{p.pp_engine}' with pp={p.pp} needs at least {p.pp} microbatches "
            f"per step, got grad_accum_steps={t.grad_accum_steps}; raise grad_accum_steps "
            "(or global_batch_size)"
        )


def _validate_parallelism(cfg: Config) -> None:
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    if m.num_kv_heads % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} must divide model.num_kv_heads={m.num_kv_heads} "
            "(each tp rank holds whole key/value heads)"
        )
    if m.vocab_size % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} must divide model.vocab_size={m.vocab_size} (vocab-parallel head)")
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"training.seq_len={t.seq_len} must be divisible by 2*parallelism.cp = {2 * p.cp} (each cp rank holds "
            "two equal chunks of every sequence); pick a seq_len that is a multiple of it, or a smaller cp"
        )
    if p.cp > 1 and p.tp_linear_async_communication:
        raise ConfigError(
            "parallelism.tp_linear_async_communication with parallelism.cp > 1 is not supported (async TP is "
            "compiled around the attention, which context parallelism runs eagerly); set one of them off"
        )
    if p.tp_mode == "reduce_scatter" and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"training.seq_len/cp = {t.seq_len}/{p.cp} must be divisible by parallelism.tp={p.tp} "
            "with tp_mode='reduce_scatter' (sequence parallel shards each cp rank's tokens); or use "
            "tp_mode='all_reduce'"
        )
    if p.tp_mode == "reduce_scatter" and t.seq_len % p.tp:
        raise ConfigError(
            f"training.seq_len={t.seq_len} must be divisible by parallelism.tp={p.tp} "
            "with tp_mode='reduce_scatter' (sequence parallel); or use tp_mode='all_reduce'"
        )
    _validate_experts(cfg)
    if p.dp_shard and p.dp % p.dp_shard:
        raise ConfigError(
            f"parallelism.dp_shard={p.dp_shard} must divide parallelism.dp={p.dp} "
            "(dp = replicas x FSDP group size); pick a divisor of dp, or 0 for plain FSDP"
        )
    if p.dp_shard not in (0, p.dp) and p.zero_stage == 0:
        raise ConfigError(
            f"parallelism.dp_shard={p.dp_shard} shards within groups, but zero_stage=0 replicates everything; "
            "set parallelism.zero_stage >= 1 for HSDP, or dp_shard=0"
        )
    if p.pp > 1 and p.zero_stage == 3 and PP_ENGINES[p.pp_engine].split_backward:
        raise ConfigError(
            f"parallelism.zero_stage=3 with pp_engine='{p.pp_engine}' computes wrong gradients in torch's split "
            "backward (parameters freed after forward); use zero_stage=2 (gradients stay sharded) or "
            "pp_engine '1f1b' or 'interleaved_1f1b'"
        )
    if p.pp > 1 and p.recompute != "none" and PP_ENGINES[p.pp_engine].split_backward:
        raise ConfigError(
            f"parallelism.recompute='{p.recompute}' with pp_engine='{p.pp_engine}' is not supported (torch 2.13's "
            "split backward recomputes each layer twice and its checkpoint fails); use pp_engine '1f1b' or "
            "'interleaved_1f1b' with recompute, or recompute='none'"
        )
    if PP_ENGINES[p.pp_engine].stage_order == "v" and p.pp_stages_per_rank != 2:
        raise ConfigError("parallelism.pp_engine='zbv' needs parallelism.pp_stages_per_rank=2 (a V of two stages)")
    stages = cfg.num_stages
    if p.pp > 1 and m.num_layers < stages:
        raise ConfigError(
            f"model.num_layers={m.num_layers} is too few for {stages} pipeline stages "
            f"(parallelism.pp={p.pp}"
            + (f" x pp_stages_per_rank={p.pp_stages_per_rank}" if stages > p.pp else "")
            + "); every stage needs at least one layer: lower pp or add layers"
        )
    if p.pp > 1 and m.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings=true needs parallelism.pp=1 "
            "(embedding and lm_head live on different pipeline stages)"
        )


def _validate_mtp(cfg: Config) -> None:
    m, t = cfg.model, cfg.training
    if m.mtp_depth and m.attention == "document":
        raise ConfigError(
            "model.mtp_depth > 0 needs model.attention='causal' (multi-token prediction's targets across a document "
            "end are not masked yet); set model.attention='causal' or model.mtp_depth=0"
        )
    if m.mtp_depth >= t.seq_len:
        raise ConfigError(
            f"model.mtp_depth={m.mtp_depth}: expected fewer than training.seq_len={t.seq_len} (module k predicts "
            "token t+k+1 of the sequence); lower model.mtp_depth"
        )


def _validate_float8(cfg: Config) -> None:
    """What float8 needs of the rest of the config (the linears' shapes under tp are checked where the model is
    built: parallel/float8.py)."""
    p, t = cfg.parallelism, cfg.training
    if t.float8 == "mxfp8":
        raise ConfigError(
            "training.float8='mxfp8' is not supported yet (torchao's MX training needs CUDA compute capability 10.0, "
            "which no check here has run on); use 'tensorwise' or 'rowwise'"
        )
    if t.float8 != "off" and p.cp > 1:
        raise ConfigError(
            f"training.float8='{t.float8}' with parallelism.cp={p.cp} is not supported yet: each cp rank would scale "
            "its own chunk of the sequence (the amax of its tokens, not the sequence's), so the numbers would change "
            "with cp; set parallelism.cp=1 or training.float8='off'"
        )
    tokens = t.micro_batch_size * t.seq_len // p.cp
    if t.float8 != "off" and tokens % FLOAT8_KERNEL_MULTIPLE:
        raise ConfigError(
            f"training.float8='{t.float8}' needs micro_batch_size * seq_len / cp = {tokens} tokens per microbatch to "
            f"be a multiple of {FLOAT8_KERNEL_MULTIPLE} (the inner dimension of float8 weight-gradient matmuls); "
            "change training.micro_batch_size or training.seq_len"
        )


def _resolve_batch(cfg: Config) -> None:
    t, dp = cfg.training, cfg.parallelism.dp
    per_accum = t.micro_batch_size * dp
    if t.global_batch_size == 0:
        if t.grad_accum_steps == 0:
            raise ConfigError("training.grad_accum_steps=0 needs training.global_batch_size > 0 to derive it from")
        t.global_batch_size = per_accum * t.grad_accum_steps
    elif t.global_batch_size % per_accum:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {per_accum}; "
            "change one of them"
        )
    elif t.grad_accum_steps == 0:
        t.grad_accum_steps = t.global_batch_size // per_accum
    elif t.grad_accum_steps * per_accum != t.global_batch_size:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} disagrees with micro_batch_size*"
            f"grad_accum_steps*dp = {per_accum * t.grad_accum_steps}; set grad_accum_steps=0 "
            "to derive it, or global_batch_size=0"
        )


def _validate_experts(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallelism
    moe = m.moe
    if p.ep == 1:
        if moe.enabled and moe.aux_loss_coef and p.cp > 1:
            raise ConfigError(_AUX_CP)
        return
    if not moe.enabled:
        raise ConfigError(
            f"parallelism.ep={p.ep} needs a mixture-of-experts model; set model.moe.num_experts (a multiple of ep), "
            "or ep=1"
        )
    if (p.dp * p.cp) % p.ep:
        raise ConfigError(
            f"parallelism.ep={p.ep} must divide dp x cp = {p.dp} x {p.cp} = {p.dp * p.cp} (expert parallelism "
            "borrows data-parallel ranks, it adds none); pick ep among its divisors, or raise dp"
        )
    if moe.num_experts % p.ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallelism.ep={p.ep} (each ep rank "
            "holds the same number of experts); pick ep among its divisors"
        )
    shard = cfg.dp_shard_size * p.cp
    if cfg.dp_shard_size != p.dp and p.zero_stage >= 1 and shard % p.ep:
        raise ConfigError(
            f"parallelism.ep={p.ep} must divide dp_shard x cp = {cfg.dp_shard_size} x {p.cp} = {shard} under HSDP "
            "(experts are split within an FSDP group and replicated across groups); pick ep among its divisors"
        )
    if moe.aux_loss_coef and p.cp > 1:
        raise ConfigError(_AUX_CP)


_AUX_CP = (
    "model.moe.aux_loss_coef > 0 with parallelism.cp > 1 is not supported (the sequence-wise balance loss needs "
    "each whole sequence on one rank); balance with model.moe.bias_update_rate instead, or set cp=1"
)


def sample_windows(entries: list[str]) -> list[tuple[int, int]]:
    """`data.skip_samples`: START:END each (END excluded), one line naming the entry otherwise."""
    windows = []
    for i, entry in enumerate(entries):
        start, colon, end = entry.partition(":")
        try:
            window = (int(start), int(end)) if colon else None
        except ValueError:
            window = None
        if window is None or not 0 <= window[0] < window[1] <= LARGEST:
            raise ConfigError(
                f"data.skip_samples[{i}]={entry!r}: expected START:END, two sample indices with 0 <= START < END "
                "< 2**63 (END excluded), e.g. 4096:8192"
            )
        windows.append(window)
    return windows


def _validate_stability(cfg: Config) -> None:
    sample_windows(cfg.data.skip_samples)
    s = cfg.stability
    if not 0.0 < s.ema_decay < 1.0:
        raise ConfigError(
            f"stability.ema_decay: expected a number in (0, 1), got {s.ema_decay}; 0.98 remembers ~50 steps"
        )
    for key in ("loss_ratio", "grad_norm_ratio"):
        if 0.0 < getattr(s, key) <= 1.0:
            raise ConfigError(
                f"stability.{key}: expected 0 (off) or a number > 1, got {getattr(s, key)}; a ratio <= 1 would call "
                "every step at or above its running mean a spike (1.25 flags a value 25% above it)"
            )
    if s.enabled and s.loss_z == s.grad_norm_z == s.loss_ratio == s.grad_norm_ratio == 0:
        raise ConfigError(
            "stability.loss_z, grad_norm_z, loss_ratio and grad_norm_ratio are all 0: nothing would be detected; "
            "set one above 0, or stability.enabled=false"
        )
