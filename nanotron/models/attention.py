"""Attention over one rank's whole sequence, and the document structure of packed sequences.

The attention module has no parameters, so context parallelism (`nanotron.parallel.context`) swaps it for
ring attention without changing a parameter name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per token, its document's index in the sequence: the number of EOS tokens before it (an EOS belongs
    to the document it ends)."""
    eos = (inputs == eos_id).to(torch.int32)
    return (eos.cumsum(dim=-1) - eos).to(torch.int32)


def document_mask(doc_q: torch.Tensor, doc_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean [batch, 1, q, k]: True where the query may attend the key (same document, and not in its
    future when `causal`, for q and k blocks at the same positions)."""
    mask = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        mask &= torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask.unsqueeze(1)


class DotProductAttention(nn.Module):
    """Attention over the whole sequence on one rank (no parameters: context parallelism swaps it for
    `RingAttention`). Causal; within documents too when `doc` is given."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None = None):
        gqa = q.shape[1] != k.shape[1]
        if doc is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        mask = document_mask(doc, doc, causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
