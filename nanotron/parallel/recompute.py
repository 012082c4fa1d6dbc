"""Activation checkpointing: each decoder layer recomputes its forward in backward."""

from __future__ import annotations

from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.torch_private import checkpoint_in_place


def apply_recompute(model: LlamaForCausalLM) -> None:
    """Hooks each layer in place, so parameter names (FQNs) don't change."""
    for layer in model.model.layers.values():
        checkpoint_in_place(layer)
