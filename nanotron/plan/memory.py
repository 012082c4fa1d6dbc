"""Per-rank memory of a layout, by part, from the config alone (no model, no GPU, no process group).

Parameter shards are exact: every parameter's shape, the dimension tensor parallelism splits, and FSDP's split
of dim 0 follow `torch.chunk` as DTensor and FSDP2 do, so `nanotron plan --check` can compare them byte for
byte with a model really built on a fake process group. Activations count what autograd saves for backward
in nanotron's Llama layer (derived from the code, validated against measured runs: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanotron.config import PP_ENGINES, Config, ModelConfig
from nanotron.models.attention import document_kernel
from nanotron.models.shapes import (
    element_bytes,
    is_expert_param,
    is_moe_layer,
    kv_bytes_per_token,
    layer_shapes,
    root_shapes,
)
from nanotron.optim.muon import is_muon_matrix
from nanotron.parallel.pipeline import split_layers, stage_costs, stage_indices
from nanotron.parallel.recompute import recompute_mode
from nanotron.parallel.regather import regathers
from nanotron.parallel.tensor import tp_shard_dim
from nanotron.parallel.torch_private import pipeline_keeps_receive_buffers

GIB = 2**30
FP32 = 4
INT32 = 4
# Memory parts in report order: (key, label).
PARTS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer state"),
    ("working", "working copies"),
    ("activations", "activations"),
    ("logits", "logits/loss"),
    ("buffers", "communication buffers"),
    ("rope", "RoPE tables"),
)


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tensor parallelism splits; None = replicated on every tp rank
    expert: bool = False  # a stacked expert weight: ep splits dim 0, FSDP then dim 1 over dp x cp / ep


def sequence_shards(cfg: Config) -> int:
    """How many ranks split the sequence between tensor-parallel regions: tp under sequence parallelism
    (tp_mode = "reduce_scatter"), else 1."""
    p = cfg.parallelism
    return p.tp if p.tp_mode == "reduce_scatter" else 1


def micro_tokens(cfg: Config) -> int:
    """The tokens of one microbatch on one rank: this cp rank's part of each sequence."""
    t = cfg.training
    return t.micro_batch_size * t.seq_len // cfg.parallelism.cp


def layer_params(m: ModelConfig, index: int) -> list[Param]:
    prefix = f"model.layers.{index}."
    return [
        Param(prefix + name, shape, tp_shard_dim(name), is_expert_param(name))
        for name, shape in layer_shapes(m, index).items()
    ]


def stage_params(m: ModelConfig, layers: range, first: bool, last: bool) -> tuple[list[Param], list[Param]]:
    """(root params, per-layer params) of one pipeline stage; FQNs as in the model (layout-independent)."""
    root = [  # the MTP modules' blocks (last stage) may hold experts
        Param(name, shape, tp_shard_dim(name), is_expert_param(name))
        for name, shape in root_shapes(m, first, last).items()
    ]
    return root, [p for index in layers for p in layer_params(m, index)]


def chunk(n: int, parts: int, index: int) -> int:
    """Length of `torch.chunk(range(n), parts)[index]` (empty past the end), as DTensor and FSDP2 split."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def local_numel(param: Param, tp: int, tp_rank: int, shard: int, shard_rank: int, ep: int = 1) -> tuple[int, int]:
    """(elements on this tp rank before FSDP, elements of this rank's FSDP shard). `shard_rank` is the rank's
    index in dp x cp's FSDP group; with expert parallelism an expert weight keeps num_experts / ep experts (the
    rank's ep coordinate is the innermost part of it) and FSDP splits dim 1 over the rest (edp)."""
    dims = list(param.shape)
    if param.expert and ep > 1:
        dims[0] = chunk(dims[0], ep, shard_rank % ep)
        edp = max(1, shard // ep)
        gathered = math.prod(dims)
        dims[1] = chunk(dims[1], edp, (shard_rank // ep) % edp)
        return gathered, math.prod(dims)
    if tp > 1 and param.tp_dim is not None:
        dims[param.tp_dim] = chunk(dims[param.tp_dim], tp, tp_rank)
    tp_local = math.prod(dims)
    dims[0] = chunk(dims[0], shard, shard_rank)
    return tp_local, math.prod(dims)


def coordinate_zero_split(tp: int, shard: int, ep: int) -> Callable[[Param], tuple[int, int]]:
    """`local_numel` at tp and FSDP coordinate 0 (the largest chunks), computed once per distinct tensor shape:
    every layer of a model repeats the same few shapes (a search plans thousands of layouts of hundreds of layers)."""
    numel: dict[tuple, tuple[int, int]] = {}

    def split(param: Param) -> tuple[int, int]:
        key = (param.shape, param.tp_dim, param.expert)
        if key not in numel:
            numel[key] = local_numel(param, tp, 0, shard, 0, ep)
        return numel[key]

    return split


@dataclass
class StageShape:
    """The parameter tensors of one of a rank's pipeline stages."""

    index: int
    root: list[Param]
    layers: list[Param]
    num_layers: int
    first: bool
    last: bool
    layer_indices: range = range(0)


@functools.lru_cache(maxsize=4096)
def _layer_ranges(num_layers: int, n_stages: int, costs: tuple[float, float, float]) -> list[range]:
    """The pipeline's own split (cached: `--search` asks for the same splits thousands of times)."""
    return split_layers(num_layers, n_stages, costs) if n_stages > 1 else [range(num_layers)]


# While `shared_model()` is active (a `--search` planning thousands of layouts of one unchanged model), each
# rank's stages are built once per (model, sequence, pipeline split, rank) and reused; None: nothing kept.
_STAGES: dict | None = None


@contextlib.contextmanager
def shared_model():
    """Plan many layouts of one model that nothing changes meanwhile: rank_stages' results are reused."""
    global _STAGES
    _STAGES = {}
    try:
        yield
    finally:
        _STAGES = None


def rank_stages(cfg: Config, pp_rank: int) -> list[StageShape]:
    if _STAGES is None:
        return _rank_stages(cfg, pp_rank)
    p = cfg.parallelism
    key = (id(cfg.model), cfg.training.seq_len, cfg.num_stages, p.pp, p.pp_engine, pp_rank)
    if key not in _STAGES:
        _STAGES[key] = (cfg.model, _rank_stages(cfg, pp_rank))  # the model kept alive: its id stays its own
    return _STAGES[key][1]


def _rank_stages(cfg: Config, pp_rank: int) -> list[StageShape]:
    m, n = cfg.model, cfg.num_stages
    ranges = _layer_ranges(m.num_layers, n, stage_costs(m, cfg.training.seq_len))
    out = []
    for s in stage_indices(cfg, pp_rank) if cfg.parallelism.pp > 1 else [0]:
        root, layers = stage_params(m, ranges[s], s == 0, s == n - 1)
        out.append(StageShape(s, root, layers, len(ranges[s]), s == 0, s == n - 1, ranges[s]))
    return out


def param_bytes(cfg: Config, pp_rank: int, tp_rank: int = 0, shard_rank: int = 0) -> int:
    """fp32 bytes of this rank's parameter shards (what `to_local()` holds): the number `--check` confirms.
    `shard_rank`: the rank's index in its FSDP group (dp_shard x cp)."""
    p, shard = cfg.parallelism, cfg.fsdp_shard_size
    total = 0
    for stage in rank_stages(cfg, pp_rank):
        for param in stage.root + stage.layers:
            total += local_numel(param, p.tp, tp_rank, shard, shard_rank % shard, p.ep)[1]
    return FP32 * total


def in_flight(cfg: Config, pp_rank: int) -> float:
    """Microbatches whose activations one stage of this rank holds at the schedule's peak.

    1F1B: stage r holds pp - r (its warm-up); GPipe (afab): all of them; interleaved 1F1B: torch's warm-up of
    (v-1)*pp + 2*(pp-1-r) + 1 chunk forwards spread over the rank's v stages. The zero-bubble schedules defer
    weight gradients and keep what those need: measured (pp=2, 8 microbatches), the first rank holds about its
    interleaved warm-up and the last rank about every microbatch; ranks between are interpolated (approximate).
    """
    p, n = cfg.parallelism, cfg.training.grad_accum_steps
    engine = PP_ENGINES[p.pp_engine]
    if p.pp == 1:
        return 1
    if engine.forward_all_first:
        return n
    if engine.stage_order == "one":
        return min(p.pp - pp_rank, n)
    v = p.pp_stages_per_rank
    interleaved = min(n * v, (v - 1) * p.pp + 2 * (p.pp - 1 - pp_rank) + 1) / v
    if not engine.split_backward:
        return interleaved
    return interleaved + (n - interleaved) * pp_rank / (p.pp - 1)


def layer_activation_bytes(cfg: Config, tokens: int, index: int = 0) -> dict[str, float]:
    """What one decoder layer keeps for backward for `tokens` tokens, by `parallelism.recompute` mode.

    none: each RMSNorm saves its input and each row's 1/rms (fp32); the q/k/v and gate/up projections save the norm
    output (with parallelism.sp_regather on, its sequence shard, gathered again in backward); attention saves roped
    q, k, v, its output and the fp32 log-sum-exp (multi-head latent attention: keys and values expanded per head,
    values v_head_dim wide, plus its latents' norms on every tp rank); the MLP saves gate, up, silu(gate) and their
    product. A mixture of experts (layer `index`) runs on every tp rank's whole sequence: it saves the gathered
    input (sequence parallel), the fp32 router scores, and per routed copy (top_k per token) the permuted input, the
    expert's gate/up, silu and product, and its output; plus its shared experts' MLP.
    full: only the layer's input (this rank's sequence shard).
    selective: the input, plus what the policy keeps (`nanotron.parallel.recompute.KEPT`): the q/k/v, o, gate,
    up and down matmul outputs (o and down before their reduction: the full sequence), attention's output and
    log-sum-exp, and the reduce-scattered (or all-reduced) outputs of o and down; a mixture of experts keeps
    its router's scores and each routed copy's and shared expert's matmul outputs. With
    `selective_matmuls = "every_other"` the k, o and up outputs are not kept (rerun in backward).
    """
    m, p = cfg.model, cfg.parallelism
    e = element_bytes(cfg.training.dtype)
    tp = p.tp
    sp = sequence_shards(cfg)
    h = m.hidden_size
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    heads = q + kv + m.num_kv_heads * m.value_dim + m.num_heads * m.value_dim  # roped q, k, v and the output
    # MLA: the latents' norms (input and 1/rms) and outputs (kept by the up-projections), replicated on every tp rank
    latents = 2 * e * (m.q_lora_rank + m.kv_lora_rank) + FP32 * ((m.q_lora_rank > 0) + (m.kv_lora_rank > 0))
    i = m.intermediate_size
    # With parallelism.sp_regather on, a layer that is not recomputed keeps the shard of each gathered norm output
    # and gathers it again in backward (`nanotron.parallel.regather`); a mixture of experts keeps its own gather.
    regather = regathers(cfg)
    gathered = e * h / sp if regather else e * h
    norms = 2 * ((e * h + FP32) / sp + gathered)
    if regather and m.mla:  # MLA's replicated down-projections take the gathered input as a plain tensor: kept whole
        norms += e * h - gathered
    if regather and is_moe_layer(m, index):
        norms += e * h - gathered
    # each head's norm keeps its input and 1/rms (fp32); RoPE keeps nothing of its output
    qk_norm = (e * (q + kv) + FP32 * (m.num_heads + m.num_kv_heads)) / tp if m.qk_norm else 0.0
    attention = e * heads / tp + FP32 * m.num_heads / tp + qk_norm + latents
    mlp = 4 * e * i / tp
    reduced = (e * h / tp if sp > 1 else e * h) if tp > 1 else 0.0  # a row-parallel linear's reduced output
    kept_attention = e * heads / tp + FP32 * m.num_heads / tp + qk_norm + latents + e * h + reduced
    kept_mlp = 2 * e * i / tp + e * h + reduced
    if p.selective_matmuls == "every_other":  # k, o (its pre-reduction output) and up are rerun
        kept_attention -= e * kv / tp + e * h
        kept_mlp -= e * i / tp
    layer_input = tokens * e * h / sp
    if is_moe_layer(m, index):
        moe = m.moe
        full = tokens  # every tp rank routes the whole sequence (gathered under SP)
        routed = moe.top_k * (2 * e * h + 4 * e * moe.moe_intermediate_size)
        per_token = (e * h if sp > 1 else 0) + 2 * FP32 * moe.num_experts + routed
        per_token += 4 * e * moe.num_shared_experts * moe.moe_intermediate_size
        matmuls = (moe.top_k + moe.num_shared_experts) * e * (2 * moe.moe_intermediate_size + h)
        kept_moe = FP32 * moe.num_experts + matmuls
        none = tokens * (norms + attention) + full * per_token
        return {"none": none, "full": layer_input, "selective": layer_input + tokens * kept_attention + full * kept_moe}
    return {
        "none": tokens * (norms + attention + mlp),
        "full": layer_input,
        "selective": layer_input + tokens * (kept_attention + kept_mlp),
    }


def attention_transient_bytes(cfg: Config, tokens: int) -> float:
    """What one layer's attention holds beyond its saved tensors while it runs, for `tokens` tokens per rank.

    Ring attention (cp > 1) keeps two K/V blocks (this step's and the one arriving), an fp32 accumulator of
    the output (forward) or of dq and of two travelling dK/dV (backward), and the GQA-expanded K/V and
    block gradients of one block; the backward is the larger. Document masking adds each block's mask
    (boolean and additive, per sample, in the compute dtype): quadratic in the rank's sequence; on one cp rank on
    CUDA (FlexAttention, `document_kernel`) a block mask instead: four int32 tables of 128 x 128 tiles.
    """
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    e = element_bytes(t.dtype)
    q_width, out_width = m.num_heads * m.head_dim / p.tp, m.num_heads * m.value_dim / p.tp
    kv_width = kv_bytes_per_token(m, 1)["expanded"] / p.tp  # K and V elements (MLA: expanded, as the ring carries)
    total = 0.0
    if p.cp > 1:
        blocks = 2 * tokens * kv_width * e  # K and V, current and arriving
        travelling = 2 * tokens * kv_width * FP32  # dK and dV, held and arriving
        expanded = tokens * (q_width + out_width) * e  # K and V expanded to every query head (GQA)
        expanded += tokens * (2 * q_width + out_width) * e  # the block's dq, dk, dv
        total += blocks + travelling + tokens * out_width * FP32 + expanded
    if m.attention == "document":
        seq = t.seq_len // p.cp
        device = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if p.cp == 1 and document_kernel(device) == "flex":
            total += t.micro_batch_size * 4 * INT32 * math.ceil(seq / 128) ** 2
        else:
            total += t.micro_batch_size * seq * seq * (1 + (e if p.cp > 1 else 0))
    return total


@dataclass(frozen=True)
class RankWeights:
    """Parameter elements of a rank's stages at tp and FSDP coordinate 0 (the largest chunks)."""

    sharded: int  # this rank's FSDP shards: what it keeps between steps
    tp_local: int  # this tp rank's parameters before FSDP shards them
    tensors: int  # parameter tensors
    root_tp: int  # the stage roots' (embedding, final norm, head) tp-local elements
    largest_layer: int  # the largest decoder layer's tp-local elements: FSDP gathers one layer at a time
    muon_sharded: int = 0  # of `sharded`, the Muon matrices' (optimizer.name = "muon": one buffer, no step count)
    muon_tensors: int = 0


def rank_weights(cfg: Config, stages: list[StageShape]) -> RankWeights:
    p = cfg.parallelism
    split = coordinate_zero_split(p.tp, cfg.fsdp_shard_size, p.ep)
    sharded = tp_local = tensors = root_tp = muon_sharded = muon_tensors = 0
    largest_layer = 0
    muon = cfg.optimizer.name == "muon"
    for stage in stages:
        for param in stage.root + stage.layers:
            full, local = split(param)
            sharded += local
            tp_local += full
            tensors += 1
            if muon and is_muon_matrix(param.name, len(param.shape), cfg.optimizer.muon_adamw_names):
                muon_sharded += local
                muon_tensors += 1
        root_tp += sum(split(param)[0] for param in stage.root)
        gathered: dict[str, int] = {}  # per layer ("model.layers.<i>.…")
        for param in stage.layers:
            layer = param.name.split(".")[2]
            gathered[layer] = gathered.get(layer, 0) + split(param)[0]
        largest_layer = max([largest_layer, *gathered.values()])
    return RankWeights(sharded, tp_local, tensors, root_tp, largest_layer, muon_sharded, muon_tensors)


def optimizer_state_bytes(weights: RankWeights) -> float:
    """AdamW: two fp32 moments and a step count per tensor; Muon's matrices one fp32 momentum buffer and no step."""
    adamw = weights.sharded - weights.muon_sharded
    return 2 * FP32 * adamw + FP32 * (weights.tensors - weights.muon_tensors) + FP32 * weights.muon_sharded


def keeps_full_gradients(cfg: Config) -> bool:
    """Whether gradients stay unsharded between microbatches: ZeRO-0, or ZeRO-1 while they accumulate."""
    p = cfg.parallelism
    accumulates = cfg.training.grad_accum_steps > 1 or p.pp > 1
    return p.zero_stage == 0 or (p.zero_stage == 1 and accumulates)


def embedding_gradient_extra(cfg: Config, stages: list[StageShape]) -> float:
    """Measured: the vocab-parallel embedding's unsharded gradient covers the whole vocabulary (a partial sum over
    tp ranks), not the rank's rows; it lives while gradients accumulate unsharded, or during its reduction."""
    m, p = cfg.model, cfg.parallelism
    has_embedding = any(s.first for s in stages) and p.tp > 1
    return FP32 * m.vocab_size * m.hidden_size * (1 - 1 / p.tp) if has_embedding else 0.0


def working_copy_bytes(cfg: Config, stages: list[StageShape], weights: RankWeights) -> float:
    """Parameters in the compute dtype as forward and backward use them: all of the rank's, or under ZeRO-3 the
    stage roots (they stay gathered) and one layer at a time plus one prefetched."""
    e = element_bytes(cfg.training.dtype)
    if cfg.parallelism.zero_stage == 3:
        layers_here = sum(s.num_layers for s in stages)
        return e * (weights.root_tp + min(2, layers_here) * weights.largest_layer)
    return e * weights.tp_local


def activation_bytes(cfg: Config, stages: list[StageShape], tokens: int, flights: float) -> tuple[float, float]:
    """(what autograd holds for backward at the schedule's peak, what rebuilding a recomputed layer adds)."""
    m, p = cfg.model, cfg.parallelism
    e = element_bytes(cfg.training.dtype)
    sp = sequence_shards(cfg)
    saved = {i: layer_activation_bytes(cfg, tokens, i) for s in stages for i in s.layer_indices}
    if any(s.last for s in stages):  # the MTP modules' blocks, on the last stage, recomputed as the model's layers
        saved |= {i: layer_activation_bytes(cfg, tokens, i) for i in range(m.num_layers, m.num_layers + m.mtp_depth)}
    # Backward of a recomputed layer rebuilds what it did not keep: one layer's worth at a time.
    rebuilt = [
        v["none"] - (v["selective"] if recompute_mode(cfg, i) == "selective" else 0.0)
        for i, v in saved.items()
        if recompute_mode(cfg, i) != "none"
    ]
    activations_saved = 0.0
    for stage in stages:
        held = sum(saved[i][recompute_mode(cfg, i)] for i in stage.layer_indices)
        # The hidden states crossing a stage boundary are this tp rank's sequence shard under sequence parallelism;
        # with multi-token prediction the MTP tokens' embeddings travel beside them.
        crossing = tokens / sp * e * m.hidden_size * (1 + m.mtp_depth)
        held += 0 if stage.first else crossing  # received input, kept for backward
        held += 0 if stage.last else crossing  # output, kept for backward
        held += tokens * 8 * (1 + m.mtp_depth) if stage.first else 0  # token ids
        if stage.last:
            held += tokens * ((e * m.hidden_size + FP32) / sp + e * m.hidden_size)  # final norm, its output
            held += mtp_activation_bytes(cfg, tokens)
        # Measured with torch 2.13: after a pipelined step the first stage still holds most of one microbatch's
        # saved activations (not freed by gc) until the next step replaces them; count one more microbatch.
        activations_saved += held * (flights + (1 if stage.first and p.pp > 1 else 0))
    return activations_saved, max(rebuilt, default=0.0)


def mtp_activation_bytes(cfg: Config, tokens: int) -> float:
    """What the multi-token prediction modules keep for backward per microbatch on the last stage: per depth its
    decoder layer's activations (recomputed as `recompute_mode` says for index num_layers + k), the two norms' and
    the concatenation's inputs and outputs and its final norm's, as for the model's final norm (its logits are in
    `logits_bytes`)."""
    m = cfg.model
    e, sp = element_bytes(cfg.training.dtype), sequence_shards(cfg)
    per_depth = tokens * (3 * (e * m.hidden_size + FP32) / sp + 2 * e * m.hidden_size * 2)  # 3 norms, cat, eh_proj
    return sum(
        layer_activation_bytes(cfg, tokens, index)[recompute_mode(cfg, index)] + per_depth
        for index in range(m.num_layers, m.num_layers + m.mtp_depth)
    )


def logits_bytes(cfg: Config, stages: list[StageShape], tokens: int, flights: float) -> tuple[float, float]:
    """(the log-softmax outputs kept for backward, the logits while the loss runs) on the rank of the last stage;
    with multi-token prediction each depth's logits too (computed and kept together with the main ones), with the
    z-loss the main positions' float logits its log-normaliser keeps for backward."""
    m, p = cfg.model, cfg.parallelism
    e = element_bytes(cfg.training.dtype)
    if not any(s.last for s in stages):
        return 0.0, 0.0
    positions = tokens * (1 + m.mtp_depth)
    kept = positions + (tokens if cfg.training.z_loss > 0 else 0)
    saved = kept * FP32 * m.vocab_size / p.tp * flights
    return saved, positions * (e + (FP32 if e == 2 else 0)) * m.vocab_size / p.tp


def communication_buffer_bytes(cfg: Config, tokens: int, largest_layer: int, embedding_extra: float) -> float:
    """Collectives' buffers and transients besides the pipeline's: one layer's gradient reduction (under FSDP),
    the sequence all-gather / reduce-scatter, attention's transients, the expert all-to-all."""
    m, p = cfg.model, cfg.parallelism
    e = element_bytes(cfg.training.dtype)
    # one layer's unsharded gradient and its fp32 reduce-scatter input (none where FSDP does not wrap the model)
    buffers = largest_layer * (FP32 + e) if cfg.wraps_fsdp else 0.0
    buffers += embedding_extra
    buffers += 2 * tokens * m.hidden_size * e if p.tp > 1 else 0  # sequence all-gather / reduce-scatter
    buffers += attention_transient_bytes(cfg, tokens)
    if p.ep > 1 and m.moe.enabled:  # the all-to-all's received tokens and the outputs sent back
        buffers += 2 * m.moe.top_k * tokens * m.hidden_size * e
    return buffers


def pipeline_buffer_bytes(cfg: Config, stages: list[StageShape], tokens: int) -> float:
    """torch's pipeline stage allocates receive buffers for every microbatch up front (before torch 2.15; from
    2.15 on a received tensor is the microbatch's input, counted with its activations)."""
    m, p = cfg.model, cfg.parallelism
    if p.pp == 1 or not pipeline_keeps_receive_buffers():
        return 0.0
    e = element_bytes(cfg.training.dtype)
    sp = sequence_shards(cfg)
    receives = sum((not s.first) + (not s.last) for s in stages)
    return receives * cfg.training.grad_accum_steps * tokens / sp * m.hidden_size * (1 + m.mtp_depth) * e


def rope_bytes(cfg: Config, stages: list[StageShape]) -> int:
    """The RoPE cos and sin tables, fp32 [2, rows, rope_dim], one per stage module: max_seq_len rows, or under cp
    only this rank's positions (seq_len / cp: `apply_context_parallel`)."""
    m, p = cfg.model, cfg.parallelism
    rows = cfg.training.seq_len // p.cp if p.cp > 1 else m.max_seq_len
    return len(stages) * 2 * rows * m.rope_dim * FP32


def stage_memory(cfg: Config, pp_rank: int) -> dict[str, float]:
    """Bytes per part for the worst rank of pipeline rank `pp_rank` (tp and dp coordinate 0: the largest
    chunks), plus "activations_saved" (what autograd holds: the measured quantity) and "total"."""
    tokens = micro_tokens(cfg)
    stages = rank_stages(cfg, pp_rank)
    weights = rank_weights(cfg, stages)
    full_grads = keeps_full_gradients(cfg)
    embedding_extra = embedding_gradient_extra(cfg, stages)
    flights = in_flight(cfg, pp_rank)
    activations_saved, recompute_transient = activation_bytes(cfg, stages, tokens, flights)
    logits_saved, logits_transient = logits_bytes(cfg, stages, tokens, flights)
    pipeline_buffers = pipeline_buffer_bytes(cfg, stages, tokens)
    # The embedding's whole-vocabulary gradient: a gradient while they stay unsharded, else its reduction's buffer.
    buffers = communication_buffer_bytes(cfg, tokens, weights.largest_layer, 0 if full_grads else embedding_extra)
    parts = {
        "params": FP32 * weights.sharded,
        "grads": FP32 * weights.tp_local + embedding_extra if full_grads else FP32 * weights.sharded,
        "optimizer": optimizer_state_bytes(weights),
        "working": working_copy_bytes(cfg, stages, weights),
        "activations": activations_saved + recompute_transient,
        "logits": logits_saved + logits_transient,
        "buffers": buffers + pipeline_buffers,
        "rope": rope_bytes(cfg, stages),
    }
    return {
        **parts,
        "total": sum(parts.values()),
        "activations_saved": activations_saved,
        "logits_saved": logits_saved,
        "pipeline_buffers": pipeline_buffers,
        "flights": flights,
    }


def worst_stage(cfg: Config) -> tuple[int, dict[str, float]]:
    """(pp rank, memory) of the pipeline rank that needs the most memory."""
    stages = [(r, stage_memory(cfg, r)) for r in range(cfg.parallelism.pp)]
    return max(stages, key=lambda item: item[1]["total"])
