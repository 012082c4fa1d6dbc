"""Layout-independent initialisation: every rank gets its slice of the same full weights.

Each parameter's full tensor is drawn from a generator seeded by (seed, parameter name) alone, one tensor at
a time, and only this rank's shard is kept; so dp/tp/pp never change the weights, and no rank ever holds
more than one full tensor beyond its own shards. The draw happens on the training device: on a GPU a 70B
model's ~70e9 normal samples take seconds where the CPU takes minutes (CUDA's generator gives other values
than the CPU's for the same seed, but the same at every layout).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from nanotron.hashing import stable_hash64
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.parametrization import param_init_std


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Fills every parameter (plain or DTensor shard) of `model`, which may come from the meta device."""
    device = _device(model)
    model.init_buffers(device)
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=torch.float32, device=device)
        std = param_init_std(model.config, name)
        if std is None:
            full.fill_(1.0)
        else:
            full.normal_(0.0, std, generator=torch.Generator(device).manual_seed(name_seed(seed, name)))
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter name, stable across processes."""
    return stable_hash64(f"{seed}:{name}") >> 1


def _device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device
