"""Context parallelism: every sequence split over the `cp` ranks, attention computed as a ring.

Load balance. The sequence is cut into 2·cp chunks and cp rank r holds chunks r and 2·cp-1-r (zigzag), so
under the causal mask every rank does the same attention work; RoPE uses the tokens' global positions (the
model's table is re-indexed once, at build time).

Ring attention. Each rank keeps its queries and passes its keys/values around the cp ring (peer to peer,
the next block's transfer overlapping this block's compute). Each block's output is merged into the running
result with its log-sum-exp (online softmax), so no rank ever holds the whole sequence's keys, values or
scores. With zigzag chunks the blocks are: the own block (causal), then from a lower rank all queries against
the first key chunk, from a higher rank the second query chunk against all keys — equal work per step.
Backward walks the ring again: each block's gradients come from the final output and log-sum-exp, and the
key/value gradients travel with their keys back to their owner.

Why a ring and not an all-gather of K/V: the all-gather holds the full sequence's K/V on every rank (at 128k
tokens and 8 KV heads of 128, 512 MB per layer in bf16 for K and V, kept for backward unless recomputed) and
cannot start computing before the gather ends; the ring holds two blocks and overlaps its transfers. Both
move the same bytes per rank ((cp-1)/cp of the sequence's K/V forward, twice that backward).

Block kernels (`choose_block_kernel`): each block runs a fused attention kernel that also returns the log-sum-exp
the merge needs — on CPU torch's flash kernel for CPU; on CUDA FlashAttention-2 for unmasked bf16/fp16 blocks
(sm80+, head dim <= 256) and the memory-efficient kernel for document-masked or fp32 blocks — causal on the own
block, full on the visible off-diagonal ones, with no [q, k] scores in memory. The plain-matmul path (scores in
fp32) stays as the exact reference and for devices and dtypes without such a kernel (fp64 on CUDA).

Document masking (`doc`: a document id per token of the whole sequence, from the EOS tokens) adds a
same-document mask to each block; the ids are tiny (one int per token) and every cp rank has them all, so a
block's mask needs no communication.

Cost at scale, per layer and step: cp-1 transfers of this rank's K/V forward and 2·(cp-1) backward (K/V plus
their gradients), each overlapped with a block's compute; nothing grows with the world size beyond cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron.models.attention import cached_document_block_mask, document_mask, flex
from nanotron.models.llama import decoder_layers
from nanotron.parallel.torch_private import attention_with_lse, attention_with_lse_backward


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of cp rank `rank`'s tokens: chunks rank and 2·cp-1-rank of 2·cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's zigzag part of `x` along `dim` (the whole sequence there)."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


class RingAttention(nn.Module):
    """Attention over a sequence held in zigzag parts by the ranks of `group` (this rank is `rank` of `cp`)."""

    def __init__(self, scale: float | None, group: dist.ProcessGroup, cp: int, rank: int):
        super().__init__()
        self.scale = scale  # None: 1/sqrt(head_dim)
        self.group = group
        self.cp = cp
        self.rank = rank

    @torch.compiler.disable  # peer-to-peer transfers inside an autograd function: eager, also under compile
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None = None):
        return _RingAttention.apply(q, k, v, doc, self)


def block_plan(cp: int, rank: int, source: int, local: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the block of `rank`'s queries against `source`'s keys that the
    causal mask leaves visible; `local` is the tokens per rank (two chunks)."""
    half = local // 2
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


class _Ring:
    """The cp ring's send-to-next / receive-from-previous of one tensor, started now, finished by wait()."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, cp: int, rank: int):
        self.received = torch.empty_like(tensor)
        nxt = dist.get_global_rank(group, (rank + 1) % cp)
        prev = dist.get_global_rank(group, (rank - 1) % cp)
        ops = [dist.P2POp(dist.isend, tensor, nxt, group), dist.P2POp(dist.irecv, self.received, prev, group)]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, module: RingAttention):
        cp, rank = module.cp, module.rank
        scale = _scale(module, q)
        acc = torch.promote_types(q.dtype, torch.float32)
        # [batch, seq, heads, dim] in memory, as SDPA returns it: the caller's transpose and reshape into the
        # output projection's input is then a view, not a copy that autograd would keep.
        b, h, s, _ = q.shape
        out = torch.empty(b, s, h, v.shape[-1], dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
        kv, split = _joined(k, v)
        for step in range(cp):
            source = (rank - step) % cp
            ring = _Ring(kv, module.group, cp, rank) if step < cp - 1 else None
            rows, cols, causal = block_plan(cp, rank, source, q.shape[2])
            mask = _block_mask(doc, cp, rank, source, rows, cols, causal)
            block_k, block_v = split(kv[:, :, cols])
            block_out, block_lse = _block_forward(q[:, :, rows], block_k, block_v, causal, mask, scale)
            if step == 0:  # the own block: every query sees itself, so the running log-sum-exp is finite from here
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if ring is not None:
                kv = ring.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([] if doc is None else [doc]))
        ctx.module = module
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        doc = rest[0] if rest else None
        module = ctx.module
        cp, rank = module.cp, module.rank
        scale = _scale(module, q)
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, split = _joined(k, v)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for step in range(cp):
            source = (rank - step) % cp
            ring = _Ring(kv, module.group, cp, rank) if step < cp - 1 else None
            rows, cols, causal = block_plan(cp, rank, source, q.shape[2])
            mask = _block_mask(doc, cp, rank, source, rows, cols, causal)
            grads = _block_backward(
                dout[:, :, rows], q[:, :, rows], *split(kv[:, :, cols]),
                out[:, :, rows], lse[:, :, rows], causal, mask, scale,
            )  # fmt: skip
            dq[:, :, rows] += grads[0]
            dkv[:, :, cols] += torch.cat(grads[1:], dim=-1)
            # The gradient of `source`'s keys moves on with them; after the last step one more hop takes
            # every rank's accumulated gradient home.
            dkv = _Ring(dkv, module.group, cp, rank).wait()
            if ring is not None:
                kv = ring.wait()
        dk, dv = split(dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _scale(module: RingAttention, q: torch.Tensor) -> float:
    """The softmax scale: µP's, or SDPA's default 1/sqrt(head_dim) (standard parametrization passes None)."""
    return module.scale if module.scale is not None else q.shape[-1] ** -0.5


def _block_mask(doc, cp, rank, source, rows, cols, causal) -> torch.Tensor | None:
    if doc is None:
        return None
    doc_q = shard_sequence(doc, cp, rank)[:, rows]
    doc_k = shard_sequence(doc, cp, source)[:, cols]
    return document_mask(doc_q, doc_k, causal)


def flex_block_forward(q, k, v, doc, cp: int, rank: int, source: int, scale: float):
    """(output, log-sum-exp) of `rank`'s queries against `source`'s keys and values through FlexAttention, its block
    mask built from the block's *global* positions (cached per microbatch and block): empty tiles skipped, no
    boolean mask. Forward only: the ring's backward needs each block's gradient from the merged output and
    log-sum-exp, which FlexAttention's public API does not take, so training keeps `_block_forward`; gpu_check
    measures this against it on CUDA, the tests on CPU."""
    rows, cols, _ = block_plan(cp, rank, source, q.shape[2])
    seq = doc.shape[1]
    q_positions = zigzag_positions(seq, cp, rank).to(doc.device)[rows]
    k_positions = zigzag_positions(seq, cp, source).to(doc.device)[cols]
    mask = cached_document_block_mask(doc, ("ring", cp, rank, source), q_positions, k_positions)
    return flex(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, scale, lse=True, compiled=q.is_cuda)


def _joined(k: torch.Tensor, v: torch.Tensor):
    """K and V as one tensor for the ring (joined on the head dim: multi-head latent attention's values are
    narrower than its keys), and the function that splits a block of it again."""
    width = k.shape[-1]
    return torch.cat([k, v], dim=-1), lambda kv: (kv[..., :width], kv[..., width:])


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x with zero columns up to `width`: the fused CPU kernel wants values as wide as queries and keys (MLA's
    are narrower); the zeros add nothing to the output's other columns or to any gradient."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for grouped-query attention (the kernels want equal head counts)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: the query heads of each group summed into their K/V head."""
    b, heads, s, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, s, d).sum(dim=2)


def choose_block_kernel(
    device_type: str, dtype: torch.dtype, head_dim: int, masked: bool, capability: tuple[int, int] | None = None
) -> str:
    """Which kernel computes a ring block: a fused one that returns the log-sum-exp where the device has one
    ("cpu_flash"; on CUDA "flash" for unmasked bf16/fp16 blocks on sm80+, else "efficient", which takes the
    document mask as an additive bias), otherwise "matmul" (the reference, which materialises the block's scores:
    at 128k tokens over cp 8, 16k x 16k per head)."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda" or head_dim % 8 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "matmul"
    if not masked and dtype != torch.float32 and head_dim <= 256 and capability is not None and capability >= (8, 0):
        return "flash"
    return "efficient"


def block_kernel(q: torch.Tensor, masked: bool) -> str:
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return choose_block_kernel(q.device.type, q.dtype, q.shape[-1], masked, capability)


def _additive(mask: torch.Tensor, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """The boolean mask [batch, 1, q, k] as an additive one over `heads`: the memory-efficient kernel wants each
    row 16-element aligned (as SDPA pads it) and every head given (a stride-0 view of one)."""
    b, _, rows, cols = mask.shape
    bias = torch.zeros(b, 1, rows, -(-cols // 16) * 16, dtype=dtype, device=mask.device)[..., :cols]
    return bias.masked_fill_(~mask, float("-inf")).expand(b, heads, rows, cols)


def _block_forward(q, k, v, causal, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp per query row) of q against one block of keys; -inf for rows that see no key."""
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    kernel = block_kernel(q, mask is not None)
    if kernel != "matmul":
        width = v.shape[-1]
        v = _padded(v, q.shape[-1])
        if mask is None:
            out, lse = attention_with_lse(q, k, v, causal, None, scale, kernel)
            return out[..., :width], lse
        out, lse = attention_with_lse(q, k, v, False, _additive(mask, q.dtype, heads), scale, kernel)
        empty = ~mask.any(dim=-1)  # [batch, 1, q]: rows whose document has no key in this block
        return out[..., :width].masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    scores = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ v.to(probs.dtype)).to(q.dtype), lse


def _block_backward(dout, q, k, v, out, lse, causal, mask, scale):
    """(dq, dk, dv) of one block, from the final output and log-sum-exp of the block's query rows."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    kernel = block_kernel(q, mask is not None)
    if kernel != "matmul":
        additive = None if mask is None else _additive(mask, q.dtype, heads)
        width, qk = v.shape[-1], q.shape[-1]
        dq, dk, dv = attention_with_lse_backward(
            _padded(dout, qk), q, k, _padded(v, qk), _padded(out, qk),
            lse.to(torch.promote_types(q.dtype, torch.float32)), causal and mask is None, additive, scale, kernel,
        )  # fmt: skip
        dv = dv[..., :width]
    else:
        scores = _scores(q, k, causal, mask, scale)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        d_out = dout.to(probs.dtype)
        dv = probs.transpose(-1, -2) @ d_out
        dp = d_out @ v.to(probs.dtype).transpose(-1, -2)
        ds = probs * (dp - (d_out * out.to(probs.dtype)).sum(-1, keepdim=True)) * scale
        dq, dk = ds @ k.to(probs.dtype), ds.transpose(-1, -2) @ q.to(probs.dtype)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _scores(q, k, causal, mask, scale) -> torch.Tensor:
    """The block's masked scores in at least fp32 (the reference path for devices without the fused kernel)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        mask = _tril(scores) if mask is None else mask & _tril(scores)
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _tril(scores: torch.Tensor) -> torch.Tensor:
    return torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()


def _merge(out, lse, block_out, block_lse) -> None:
    """Online softmax: the running (out, lse) of some query rows, in place, with one more block's."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, cp: int, rank: int, seq_len: int) -> None:
    """Swaps every layer's attention for ring attention over `group` and gives the model its global positions."""
    for _, layer in decoder_layers(model):  # the MTP modules' blocks too
        attention = layer.self_attn
        attention.core = RingAttention(attention.core.scale, group, cp, rank)
    model.model.positions = zigzag_positions(seq_len, cp, rank)
