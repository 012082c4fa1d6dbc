"""Data parallelism over the dp mesh: `replicate` (DDP semantics) or FSDP2 `fully_shard` (ZeRO-1/2/3).

It is applied at every dp size, dp=1 included (its collectives are then no-ops), so that mixed precision is
one mechanism everywhere: FSDP's MixedPrecisionPolicy casts parameters to bf16 for compute and reduces
gradients in fp32 against fp32 master weights, and a dp=1 run computes exactly as a dp=8 run does.
"""

from __future__ import annotations

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nanotron.models.llama import LlamaForCausalLM


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 master weights and fp32 gradient reduction."""
    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: LlamaForCausalLM, dp_mesh: DeviceMesh, zero_stage: int, dtype: str) -> None:
    """Wraps each decoder layer, then the root (a ModuleDict itself can't be wrapped).

    zero_stage 0 keeps full replicas and all-reduces grads; 1/2 shard grads and optimizer state but keep
    the gathered params between forward and backward; 3 also frees them after forward (re-gathers in backward).
    """
    policy = mixed_precision(dtype)
    if zero_stage == 0:
        for layer in model.model.layers.values():
            replicate(layer, mesh=dp_mesh, mp_policy=policy)
        replicate(model, mesh=dp_mesh, mp_policy=policy)
        return
    reshard = zero_stage == 3
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
