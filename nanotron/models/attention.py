"""Attention over one rank's whole sequence, and the document structure of packed sequences.

The attention module has no parameters, so context parallelism (`nanotron.parallel.context`) swaps it for
ring attention without changing a parameter name.

Document masks come in two forms. The boolean mask (`document_mask`, [batch, 1, q, k]) is exact everywhere and is
what CPU training uses; on GPU a boolean mask sends SDPA to a slow kernel and costs q x k bytes per microbatch.
FlexAttention's block mask (`document_block_mask`) records, per 128 x 128 tile, whether it is empty, full or
partial, so empty tiles (other documents) are skipped and the fused kernel is kept; it is built once per
microbatch and position set (`cached_document_block_mask`), not per layer. CUDA selects it (`document_kernel`):
FlexAttention's backward raises on CPU, where its forward is checked against the boolean path instead.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from torch.utils.weak import WeakIdKeyDictionary


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


def document_kernel(device_type: str) -> str:
    """How attention within documents runs: "flex" (FlexAttention over a block mask: CUDA, compiled) or "mask"
    (SDPA with a boolean mask: CPU, where FlexAttention has no backward)."""
    return "flex" if device_type == "cuda" else "mask"


def document_block_mask(doc: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> BlockMask:
    """FlexAttention's causal same-document block mask of queries at *global* sequence positions `q_positions`
    against keys at `k_positions` (`doc`: the whole sequence's document ids, [batch, seq]). Global positions make
    one rule serve the whole sequence and every ring block (a context-parallel rank's chunks are not contiguous)."""

    def mask_mod(b, h, q_index, k_index):
        q_pos, k_pos = q_positions[q_index], k_positions[k_index]
        return (doc[b, q_pos] == doc[b, k_pos]) & (q_pos >= k_pos)

    return create_block_mask(mask_mod, doc.shape[0], None, len(q_positions), len(k_positions), device=doc.device)


_block_masks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # doc tensor -> {key: BlockMask}, for its microbatch


@torch.compiler.disable  # a cache lookup and, once per microbatch, the mask's construction: eager in compiled layers
def cached_document_block_mask(doc: torch.Tensor, key: Hashable, q_positions, k_positions) -> BlockMask:
    """`document_block_mask`, built once per `doc` tensor (one microbatch: every layer gets the same one) and `key`
    (which positions: the whole sequence, or one ring block); forgotten with the tensor."""
    masks = _block_masks.setdefault(doc, {})
    if key not in masks:
        masks[key] = document_block_mask(doc, q_positions, k_positions)
    return masks[key]


_compiled_flex: list = []


def flex(q, k, v, block_mask: BlockMask, scale: float | None, lse: bool = False, compiled: bool = True):
    """FlexAttention, compiled once per process (eager FlexAttention is the unfused reference: scores in memory).
    With `lse`, also the natural log-sum-exp per query row (-inf for rows that see no key, whose output is 0)."""
    if torch.compiler.is_compiling():  # inside a compiled layer (training.compile): compiled with it
        compiled = False
    if compiled and not _compiled_flex:
        _compiled_flex.append(torch.compile(flex_attention, dynamic=False))
    kernel = _compiled_flex[0] if compiled else flex_attention
    gqa = q.shape[1] != k.shape[1]
    if not lse:
        return kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


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
        if document_kernel(q.device.type) == "flex":
            positions = torch.arange(q.shape[2], device=q.device)
            mask = cached_document_block_mask(doc, "sequence", positions, positions)
            return flex(q, k, v, mask, self.scale, compiled=q.is_cuda)
        mask = document_mask(doc, doc, causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
