"""Activation checkpointing: each decoder layer recomputes its forward in backward."""

from __future__ import annotations

from torch.distributed._composable import checkpoint

from nanotron.models.llama import LlamaForCausalLM


def apply_recompute(model: LlamaForCausalLM) -> None:
    """The composable `checkpoint` hooks the layer in place, so parameter names (FQNs) don't change."""
    for layer in model.model.layers.values():
        checkpoint(layer)
