"""Activation checkpointing: each decoder layer recomputes its forward in backward."""

from __future__ import annotations

from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.moe import MoE
from nanotron.parallel.torch_private import checkpoint_in_place, in_backward_pass


def apply_recompute(model: LlamaForCausalLM) -> None:
    """Hooks each layer in place, so parameter names (FQNs) don't change."""
    for layer in model.model.layers.values():
        checkpoint_in_place(layer)
        if isinstance(layer.mlp, MoE):  # its recomputed forward must not count the step's tokens again
            layer.mlp.counting = lambda: not in_backward_pass()
