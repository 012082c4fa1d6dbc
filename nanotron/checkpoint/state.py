"""Stateful views of this rank's model parts and optimizers, keyed by parameter FQN at any layout.

Each has `state_dict()` / `load_state_dict()`, which is all the checkpoint manager knows of them. Pipeline
stages are separate modules with their own optimizers; their state dicts are merged, and DCP reshards the
merged dict onto whatever dp/tp/pp layout loads it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nanotron.parallel.float8 import plain_tensors

FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState:
    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for module in self.modules:
            state.update(get_model_state_dict(module))
        return plain_tensors(state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for module in self.modules:  # each stage takes its own keys from the merged dict
            set_model_state_dict(module, state, options=StateDictOptions(strict=False))


class OptimizerState:
    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts = list(zip(modules, optimizers))

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {}
        for module, optimizer in self.parts:
            state.update(get_optimizer_state_dict(module, optimizer, options=FLATTENED))
        return plain_tensors(state)

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Moments and step counts come from the checkpoint; param-group settings (lr_scale, weight decay,
        betas, eps) stay the ones this run's config built, as the LR schedule does. Torch would take each
        group's settings from the saved values of its first parameter, so a run resumed with another µP base
        or weight decay would silently keep the old ones."""
        for module, optimizer in self.parts:
            settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            set_optimizer_state_dict(module, optimizer, state, options=FLATTENED)
            for group, setting in zip(optimizer.param_groups, settings, strict=True):
                group.update(setting)
