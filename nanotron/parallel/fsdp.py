"""Data parallelism over the dp mesh: `replicate` (DDP semantics) or FSDP2 `fully_shard` (ZeRO-1/2/3), HSDP
when the mesh has a replicate and a shard dimension.

It is applied at every dp size, dp=1 included (its collectives are then no-ops), so that mixed precision is
one mechanism everywhere: FSDP's MixedPrecisionPolicy casts parameters to bf16 for compute and reduces
gradients in fp32 against fp32 master weights, and a dp=1 run computes exactly as a dp=8 run does.

What each ZeRO stage keeps between the microbatches of a step (its memory promise):
  0  full parameters, gradients and optimizer state; gradients all-reduced once per step.
  1  sharded optimizer state and parameters; gradients accumulate unsharded and are reduce-scattered once
     per step, and gathered parameters stay gathered until the step's last backward (fewest collectives).
  2  gradients reduce-scattered after every microbatch's backward: only the gradient shard is kept.
  3  as 2, and parameters are also freed after forward and after backward (re-gathered when needed).
The same holds under pipeline parallelism, where `ZeroPipelineStage` replaces the schedule's default of
deferring every reduction to the step's end.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from nanotron.config.parallelism import fsdp_wraps
from nanotron.models.llama import LlamaForCausalLM, decoder_layers
from nanotron.parallel.expert import expert_shard_dim
from nanotron.parallel.torch_private import (
    PortablePipelineStage,
    fsdp_ends_backward,
    reduce_accumulated_gradients,
    replicate,
    stage_backward,
)


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 master weights and fp32 gradient reduction."""
    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: LlamaForCausalLM, dp_mesh: DeviceMesh, zero_stage: int, dtype: str, expert_dp_mesh: DeviceMesh | None = None
) -> None:
    """Wraps each decoder layer, then the root (a ModuleDict itself can't be wrapped).

    `dp_mesh` is 1-D (FSDP over all of dp) or 2-D ("dp_replicate", "dp_shard"): HSDP, sharded within a
    dp_shard group and replicated across groups. zero_stage 0 keeps full replicas; 1/2 keep the gathered
    params between forward and backward; 3 frees them after forward (re-gathers in backward).
    """
    policy = mixed_precision(dtype)
    if not fsdp_wraps(dp_mesh.size(), dtype):  # one fp32 data-parallel rank: nothing to shard, reduce or cast
        return
    if expert_dp_mesh is not None:
        _shard_experts(model, expert_dp_mesh, zero_stage, policy)
    if zero_stage == 0:
        for _, layer in decoder_layers(model):
            replicate(layer, mesh=dp_mesh, mp_policy=policy)
        replicate(model, mesh=dp_mesh, mp_policy=policy)
        return
    reshard = zero_stage == 3
    for _, layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def _shard_experts(model, mesh: DeviceMesh, zero_stage: int, policy) -> None:
    """Expert weights (already split over "ep") get their own FSDP unit over `mesh`: "edp", the data-parallel ranks
    that hold the same experts (HSDP: replicated over "dp_replicate", sharded over "edp"); inside each layer's
    unit, which then leaves them alone. FSDP averages their gradients over it; the dispatcher has already divided
    them by ep (see `AllToAllDispatch`)."""
    for _, layer in decoder_layers(model):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        if zero_stage == 0:
            replicate(experts, mesh=mesh, mp_policy=policy)
        else:
            fully_shard(
                experts,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=zero_stage == 3,
                shard_placement_fn=expert_shard_dim,
            )


@dataclass(frozen=True)
class GradientSync:
    """The ZeRO stage's rule for each microbatch's backward, one object for the plain loop and the pipeline:
    whether the gradients are reduced now or once at the step's end, and whether the gathered parameters are
    freed after it. Stages 0/1 defer both to the step's last microbatch; 2/3 reduce-scatter every time."""

    zero_stage: int
    # Each model's FSDP modules, found once: walking the module tree (and FSDP's setters walk it again with
    # `recurse=True`) twice per microbatch cost ~0.5 ms at 8 layers, growing with depth.
    # Keyed weakly by the model: a model built later never finds a dead one's list.
    _fsdp_modules: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, compare=False, repr=False
    )

    @property
    def every_microbatch(self) -> bool:
        return self.zero_stage >= 2

    @property
    def reshard_after_backward(self) -> bool:
        return self.zero_stage == 3

    def before_backward(self, module: FSDPModule, last_microbatch: bool) -> None:
        sync, reshard = self.every_microbatch or last_microbatch, self.reshard_after_backward or last_microbatch
        for each in self._fsdp_in(module):
            each.set_requires_gradient_sync(sync, recurse=False)
            each.set_reshard_after_backward(reshard, recurse=False)

    def _fsdp_in(self, module: FSDPModule) -> list[FSDPModule]:
        if module not in self._fsdp_modules:  # [] for a model FSDP left alone
            self._fsdp_modules[module] = [m for m in module.modules() if isinstance(m, FSDPModule)]
        return self._fsdp_modules[module]


class ZeroPipelineStage(PortablePipelineStage):
    """A pipeline stage whose gradient reduction follows the ZeRO stage's `GradientSync`.

    torch's stage turns FSDP's gradient sync off for every microbatch and reduces once at the step's end,
    so FSDP accumulates full unsharded gradients (and keeps every gathered parameter) across the step. For
    stages 2/3 a full backward here runs with sync on, so FSDP reduce-scatters layer by layer as usual; a
    zero-bubble schedule's split backward (input, then weight gradients) reduces right after the weight
    part, when the microbatch's gradients are complete. The step-end reduction then finds nothing left.
    """

    def __init__(self, *args, sync: GradientSync, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync = sync

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not self.sync.every_microbatch or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "full":
            self.submod.set_is_last_backward(True)
            self.sync.before_backward(self.submod, last_microbatch=False)
            with fsdp_ends_backward(self.submod):
                grads = stage_backward(
                    bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
                )
            return grads, None
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "weight":
            # The schedule finds pending weight passes' parameters by the module's registered (gathered) ones:
            # free them only when no microbatch still waits for its weight gradients.
            reduce_accumulated_gradients(self.submod, self.sync.reshard_after_backward and not self.backward_state)
        return result
