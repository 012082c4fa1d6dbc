"""Pipeline parallelism with torch.distributed.pipelining: balanced stages, stable FQNs, schedules.

A stage is a deep copy of the (meta-device) model with the layers of other stages deleted and
embedding / final norm / head set to None where they don't belong, so parameter names never change.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed.pipelining as pipelining
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard

from nanotron.config import PP_ENGINES, Config, ModelConfig
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.shapes import head_forward_flops, layer_forward_flops, mtp_forward_flops
from nanotron.parallel.fsdp import GradientSync, ZeroPipelineStage


def stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(embedding, layer, head) cost in forward FLOPs per token, used to balance stages.

    The embedding does no matmul, but its backward scatter-add and optimizer update touch vocab x hidden
    values, so it is counted as half the head.
    """
    head = head_forward_flops(cfg)
    # the last stage also runs the multi-token prediction modules (a layer and the head again per depth)
    return head / 2, layer_forward_flops(cfg, seq_len), head + mtp_forward_flops(cfg, seq_len)


def split_layers(num_layers: int, n_stages: int, costs: tuple[float, float, float]) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the costliest stage (every stage >= 1 layer).

    Stage 0 also pays for the embedding and the last stage for the head (and MTP), so they get fewer layers.
    """
    embed, layer, head = costs

    def cost(stage: int, n: int) -> float:
        return n * layer + (embed if stage == 0 else 0) + (head if stage == n_stages - 1 else 0)

    # best[s][i]: the smallest max-cost splitting layers [0, i) into stages [0, s).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, num_layers - (n_stages - s) + 1):
            for j in range(s - 1, i):
                candidate = max(best[s - 1][j], cost(s - 1, i - j))
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds, i = [], num_layers
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def stage_indices(cfg: Config, pp_rank: int) -> list[int]:
    """Which global stages this rank runs: loop order for interleaved schedules, a V for zbv."""
    p = cfg.parallelism
    if PP_ENGINES[p.pp_engine].stage_order == "v":
        return [pp_rank, 2 * p.pp - 1 - pp_rank]
    return list(range(pp_rank, cfg.num_stages, p.pp))


def build_stage(model: LlamaForCausalLM, layers: range, first: bool, last: bool) -> LlamaForCausalLM:
    """A copy of `model` keeping only `layers` (and the embedding/head when first/last)."""
    stage = copy.deepcopy(model)
    for name in list(stage.model.layers):
        if int(name) not in layers:
            del stage.model.layers[name]
    if not first:
        stage.model.embed_tokens = None
    if not last:
        stage.model.norm = None
        stage.lm_head = None
        stage.mtp = None
    return stage


def split_model(model: LlamaForCausalLM, cfg: Config, pp_rank: int) -> list[tuple[int, LlamaForCausalLM]]:
    """(global stage index, stage module) pairs for this rank."""
    n = cfg.num_stages
    ranges = split_layers(model.config.num_layers, n, stage_costs(model.config, cfg.training.seq_len))
    return [(s, build_stage(model, ranges[s], s == 0, s == n - 1)) for s in stage_indices(cfg, pp_rank)]


def build_schedule(
    stages: list[tuple[int, torch.nn.Module]],
    cfg: Config,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable,
    sync: GradientSync,
):
    """The `parallelism.pp_engine` schedule over this rank's stages (one microbatch per gradient-accumulation
    step); gradients are averaged over the microbatches and reduced as `sync` (the ZeRO stage's rule) says.
    `mesh` is the whole device mesh (its "pp" and "tp" dimensions are used)."""
    n = cfg.num_stages
    pipeline_stages = [
        ZeroPipelineStage(
            module, index, n, device, group=mesh["pp"].get_group(), sync=sync, **stage_shapes(cfg, index, mesh)
        )
        for index, module in stages
    ]
    engine = PP_ENGINES[cfg.parallelism.pp_engine]
    schedule_cls = getattr(pipelining, engine.schedule)
    n_microbatches = cfg.training.grad_accum_steps
    staged = pipeline_stages if engine.stage_order != "one" else pipeline_stages[0]
    return schedule_cls(staged, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def stage_shapes(cfg: Config, index: int, mesh: DeviceMesh) -> dict[str, tuple[torch.Tensor, ...]]:
    """Meta-device examples of what stage `index` receives and sends, for PipelineStage's static mode.

    Without them the first step runs an extra forward and backward on placeholder tensors to infer the
    shapes (and exchanges them between stages). A stage passes this rank's part of the hidden states
    (sequence-sharded under sequence parallelism) in the compute dtype; the last stage returns logits,
    vocab-sharded DTensors under TP, whose gradient metadata static mode then needs as well.
    """
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    dtype = getattr(torch, t.dtype)
    tokens = t.seq_len // p.cp  # this cp rank's part of every sequence
    seq = tokens // p.tp if p.tp > 1 and p.tp_mode == "reduce_scatter" else tokens

    def hidden(requires_grad: bool) -> torch.Tensor:
        # with multi-token prediction, the MTP tokens' embeddings travel beside the hidden states (llama.py)
        width = (1 + m.mtp_depth) * m.hidden_size
        return torch.empty(t.micro_batch_size, seq, width, dtype=dtype, device="meta").requires_grad_(requires_grad)

    if index == 0:
        inputs = torch.empty(t.micro_batch_size, tokens, dtype=torch.long, device="meta")
    else:
        inputs = hidden(True)
    if index < cfg.num_stages - 1:
        return {"input_args": (inputs,), "output_args": (hidden(True),)}
    positions = (1 + m.mtp_depth) * tokens  # in training the MTP depths' logits follow the main ones (llama.py)
    if p.tp == 1:
        logits = torch.empty(t.micro_batch_size, positions, m.vocab_size, dtype=dtype, device="meta")
        return {"input_args": (inputs,), "output_args": (logits.requires_grad_(),)}

    def logits(requires_grad: bool) -> DTensor:
        local = torch.empty(t.micro_batch_size, positions, m.vocab_size // p.tp, dtype=dtype, device="meta")
        sharded = DTensor.from_local(local, mesh["tp"], [Shard(-1)], run_check=False)
        return sharded.requires_grad_(requires_grad)

    shapes = {"input_args": (inputs,), "output_args": (logits(True),)}
    if "input_grads" not in inspect.signature(PipelineStage).parameters:
        return shapes  # torch 2.11: the gradients' metadata is taken from the outputs'
    input_grad = None if index == 0 else hidden(False)
    return shapes | {"input_grads": (input_grad,), "output_grads": (logits(False),)}


_FORWARD_ACTIONS = {"F", "SEND_F", "WAIT_SEND_F", "RECV_F", "UNSHARD", "RESHARD"}  # WAIT_SEND_F: torch 2.15


@contextmanager
def forward_only(schedule) -> Iterator[None]:
    """Runs a multi-stage schedule's forward actions alone, for evaluation.

    torch 2.13's `eval()` still walks a multi-stage schedule's backward actions (as no-ops), and where two
    adjacent stages share a rank (the V of zbv) handing the missing input gradient over fails. Dropping the
    backward and gradient-communication actions from the order keeps every forward send/recv pairing.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        yield
        return
    forward = {rank: [a for action in actions for a in _forward_parts(action)] for rank, actions in order.items()}
    schedule.pipeline_order_with_comms = forward
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _forward_parts(action) -> list:
    if action is None:
        return []
    if action.sub_actions:  # an overlapped forward + backward pair
        return [a for sub in action.sub_actions for a in _forward_parts(sub)]
    return [action] if action.computation_type.value in _FORWARD_ACTIONS else []
