"""Sequence parallelism's gathered inputs, kept as shards: all-gathered again when backward needs them.

Under `tp_mode = "reduce_scatter"` the norm output is all-gathered to the whole sequence before q/k/v and before
gate/up, and autograd keeps that gathered tensor for the weight gradients: tp times the shard it came from. Here
each attention and dense MLP block of a layer that is not recomputed keeps the rank's shard instead and gathers
it again the first time its backward unpacks it, once for all the projections that share it (Megatron's
re-gather in backward): per layer 2 x hidden x (1 - 1/tp) fewer bytes per token, and 2 more all-gathers of the
sequence in backward. Recomputed layers need none of this (full recompute keeps only the layer's input;
selective reruns the all-gathers), nor does a mixture of experts (it keeps its own copies); a compiled layer
decides what it saves itself. Multi-head latent attention keeps its gathered input whole (it reaches the replicated
down-projections as a plain tensor, which these hooks leave alone): only its MLP block re-gathers. Implemented with
saved-tensor hooks around the block's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nanotron.config import Config
from nanotron.console import say
from nanotron.models.llama import decoder_layers
from nanotron.models.moe import MoE

# Called with each tensor the hooks keep for backward (the shard in place of a gathered input, or any other saved
# tensor as it is): how benchmarks/probe.py measures what a block holds (these hooks hide its own).
on_save: list[Callable[[torch.Tensor], None]] = []


def can_regather(cfg: Config) -> bool:
    """Whether parallelism.sp_regather has anything to act on: sequence parallelism in eager mode (a compiled layer
    decides what it saves itself) and a decoder layer that is not recomputed."""
    p = cfg.parallelism
    sequence_parallel = p.tp > 1 and p.tp_mode == "reduce_scatter" and not cfg.training.compile
    return sequence_parallel and (p.recompute == "none" or (p.recompute_every > 1 and cfg.model.num_layers > 1))


def regathers(cfg: Config) -> bool:
    """Whether this config's layers keep their gathered inputs as shards: parallelism.sp_regather = 'on' where it
    can act (the train command resolves 'auto' before the model is built; unresolved, it counts as off)."""
    return cfg.parallelism.sp_regather == "on" and can_regather(cfg)


def agree_on_regather(cfg: Config, device: torch.device) -> Config:
    """cfg with the same parallelism.sp_regather on every rank. The train command resolves 'auto' on each rank from
    its own device's memory, so a job mixing device models could split a TP group between ranks that keep shards
    and ranks that keep gathered inputs: their backward all-gathers would not match (a hang). On everywhere if any
    rank resolved it on, the setting that saves memory; said once by rank 0 when that overrides its own decision.
    Cost: one all-reduce of one integer over the world at start-up (at 512 ranks, one latency-bound collective)."""
    if not can_regather(cfg) or not dist.is_initialized():
        return cfg
    mine = regathers(cfg)
    vote = torch.tensor([int(mine)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    if bool(vote.item()) == mine:
        return cfg
    if dist.get_rank() == 0:
        say(
            "parallelism.sp_regather: on for every rank, not off: another rank's plan needs it (its device has less "
            "memory); set parallelism.sp_regather explicitly to choose"
        )
    return replace(cfg, parallelism=replace(cfg.parallelism, sp_regather="on"))


def apply_regather(model: nn.Module, recomputed: Callable[[int], bool]) -> None:
    """Hooks the attention and dense MLP blocks of every layer of `model` (a whole model or a pipeline stage, after
    the TP plan; the MTP modules' blocks too) that `recomputed(global index)` says is not checkpointed."""
    for index, layer in decoder_layers(model):
        if recomputed(index):
            continue
        blocks = [layer.self_attn] + ([] if isinstance(layer.mlp, MoE) else [layer.mlp])
        for block in blocks:
            _Regather().attach(block)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (any other tensor itself) without running an op: hooks that pack saved tensors, or
    run inside a selectively checkpointed layer (whose reruns must see the same ops), must not add any."""
    return getattr(tensor, tensor.__tensor_flatten__()[0][0]) if isinstance(tensor, DTensor) else tensor


class _Gathered:
    """One gathered input: the shard it came from, and the gathered copy rebuilt in backward until every saved
    view of it has been unpacked."""

    def __init__(self, shard: DTensor):
        self.shard = shard
        self.full = None
        self.pending = 0

    def unpack(self) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                self.full = self.shard.full_tensor()
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None
        return full


class _Saved:
    """What a saved view of the gathered input is packed into: its layout and the shared `_Gathered`."""

    def __init__(self, gathered: _Gathered, view: DTensor):
        local = local_tensor(view)
        self.gathered = gathered
        self.local_layout = (local.size(), local.stride(), local.storage_offset())
        self.mesh = view.device_mesh
        self.placements = view.placements
        self.shape = view.shape
        self.stride = view.stride()
        gathered.pending += 1

    def unpack(self) -> DTensor:
        local = self.gathered.unpack().as_strided(*self.local_layout)
        return DTensor.from_local(local, self.mesh, self.placements, shape=self.shape, stride=self.stride)


class _Regather:
    def __init__(self):
        self.shard: DTensor | None = None
        self.gathered: _Gathered | None = None
        self.storage = None
        self.context = None

    def attach(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(self._keep_shard, prepend=True)  # before the TP plan gathers the input
        block.register_forward_pre_hook(self._enter)  # after it
        block.register_forward_hook(self._exit, always_call=True)

    def _keep_shard(self, block: nn.Module, args: tuple) -> None:
        self.shard = args[0] if isinstance(args[0], DTensor) else None

    def _enter(self, block: nn.Module, args: tuple) -> None:
        x = args[0]
        if not torch.is_grad_enabled() or self.shard is None or not isinstance(x, DTensor):
            return
        local = local_tensor(x)
        storage = _storage(local)  # None: a float8 copy gathered (torchao's PrepareFloat8ModuleInput), kept as is
        if storage is None or not local.is_contiguous() or local.storage_offset() != 0 or x.shape != self.shard.shape:
            return  # not a plain gathered copy of the shard: keep what autograd keeps
        self.gathered = _Gathered(self.shard)
        self.storage = storage
        self.context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.context.__enter__()

    def _exit(self, *_: object) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
        self.context = self.gathered = self.shard = None

    def _pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, DTensor) and _storage(local_tensor(tensor)) == self.storage:
            for hook in on_save:
                hook(self.gathered.shard)
            return _Saved(self.gathered, tensor)
        for hook in on_save:
            hook(tensor)
        return tensor

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, _Saved) else packed


def _storage(tensor: torch.Tensor) -> int | None:
    """Where a tensor's data lives; None for a wrapper without storage of its own (torchao's float8 copy, what a
    float8 linear keeps under torchao's float8 TP plans)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None
