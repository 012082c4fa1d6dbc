"""AdamW (or Muon for the hidden matrices: `optim.muon`) with decay only on matrices, an LR schedule that is a
function of (step, config), and global-norm gradient clipping that stays on the device."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nanotron.config import ModelConfig, OptimizerConfig
from nanotron.models.parametrization import (
    param_eps_scale,
    param_lr_scale,
    param_muon_lr_scale,
    param_muon_weight_decay_scale,
    param_weight_decay_scale,
)
from nanotron.optim.muon import build_muon, check_adamw_names
from nanotron.parallel.torch_private import scale_in_place


def build_optimizer(
    module: nn.Module,
    cfg: OptimizerConfig,
    device: torch.device,
    model: ModelConfig,
    group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """No weight decay on norms and embeddings: decaying them only hurts (they are scales and lookups).

    Each group carries the `lr_scale`, weight decay and epsilon its parameters get from the parametrization
    (µP's per-width and per-depth LR, `optimizer.weight_decay_mode`, `optimizer.eps_mode`; the config's values
    under standard). Groups are keyed by parameter name, so every layout builds the same ones.
    Params are also grouped by their DTensor mesh: fused/foreach kernels can't mix plain tensors (e.g.
    replicated norms under plain TP) with DTensors, nor DTensors of different meshes, in one call.
    With optimizer.name = "muon" the hidden matrices leave these groups for Muon's, which exchanges shards over
    `group` (the pipeline stage's ranks), with their own µP LR and decay factors (`param_muon_lr_scale`).
    """
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for name, param in module.named_parameters():  # tied weights are yielded once
        decay = 0.0
        if "norm" not in name and "embed_tokens" not in name:
            decay = cfg.weight_decay * param_weight_decay_scale(model, name, cfg.weight_decay_mode)
        eps = cfg.eps * param_eps_scale(model, name, cfg.eps_mode)
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        groups[decay, param_lr_scale(model, name), eps, mesh].append(param)

    def adamw(items) -> torch.optim.AdamW:
        param_groups = [
            {"params": params, "weight_decay": decay, "lr_scale": lr_scale, "eps": eps}
            for (decay, lr_scale, eps, _), params in items
        ]
        fused = cfg.fused and device.type in ("cuda", "cpu")
        return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)

    def muon_settings(name: str) -> tuple[float, float]:
        decay = cfg.weight_decay * param_muon_weight_decay_scale(model, name, cfg.weight_decay_mode)
        return decay, param_muon_lr_scale(model, name)

    check_adamw_names(cfg, model)
    if cfg.name == "muon":
        optimizer = build_muon(module, cfg, groups, adamw, group, muon_settings)
    else:
        optimizer = adamw(groups.items())
    init_state(optimizer)
    return optimizer


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates AdamW's state now (zero moments, step 0; Muon's zero momentum), what a first step would create.

    So a checkpoint taken before the first step holds optimizer state like any other, and loading one never
    needs a throw-away step to build a template to load into.
    """
    lrs = [group["lr"] for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # with zero grads and lr 0, neither Adam nor weight decay moves a weight
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for param in params:
        param.grad = None
        if "step" in optimizer.state[param]:  # Muon's momentum has no step count
            optimizer.state[param]["step"].zero_()


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, lr until `decay_start` (when set: WSD),
    then the chosen decay to min_lr over `decay_steps` (0: until `total_steps`), then min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = cfg.decay_start or cfg.warmup_steps
    if cfg.decay_style == "constant" or step < start:
        return cfg.lr
    decay_steps = cfg.decay_steps or max(total_steps - start, 1)
    progress = min((step - start) / decay_steps, 1.0)
    shape = {
        "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
        "linear": 1 - progress,
        "1-sqrt": 1 - math.sqrt(progress),
    }[cfg.decay_style]
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * shape


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets the step's learning rate; a param group's `lr_scale` (e.g. µP's per-width factor) scales it."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global L2 norm over every DTensor shard and every pipeline stage, as a device tensor (no host sync);
    clips to max_norm when max_norm > 0.

    Parameters are grouped by their gradients' (mesh, placements) so each group reduces its partial norms in
    one collective (and foreach kernels never mix DTensors of different meshes); the stages' squared norms are
    then summed over the pp group.
    """
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p)
    # Summed on the parameters' device: a CPU zero moved to a GPU would be a blocking copy, a host sync per step.
    squared = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    if max_norm > 0:
        # torch's rule (clip_grads_with_norm_), applied to each DTensor's local gradient: scaling every shard, or
        # every rank's share of a Partial sum, scales the whole. torch 2.11's in-place foreach ops leave a Partial
        # DTensor (a sequence-parallel norm's gradient) unchanged, so its own function skipped those silently.
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for key, group in groups.items():
            grads = [p.grad.to_local() if key is not None else p.grad for p in group]
            scale_in_place(grads, coefficient.to(grads[0].device))
    return total
