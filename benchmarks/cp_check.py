"""Context parallelism's attention on one device: numerics against full attention, then speed.

    python -m benchmarks.cp_check [--device cuda] [--seq-len 4096 32768 131072]

The ring runs for real (nanotron.parallel.context's forward and backward, block kernels and log-sum-exp
merge) with each cp rank a thread on the same device; only the peer-to-peer transport is replaced by an
in-process mailbox, so one GPU checks the CUDA path (multi-GPU runs check the transport: gpu_check's cp2 row).

- numerics: float64, causal and document masks (documents crossing chunk boundaries), cp 2 and 4, every
  rank's output and dq/dk/dv against a naive full attention: max error <= 1e-10; then each fused block
  kernel the ring selects in bf16 and fp32 (CPU: its one; CUDA: flash for bf16 unmasked, memory-efficient for
  masked or fp32) against float64, bounded by the matmul path's error in the same dtype;
- speed and peak memory: forward + backward of bf16 attention over each `--seq-len` (1B shape: 32 heads, 4 KV
  heads, head dim 64), all cp=2 ranks' blocks on the one device against one full SDPA call (flash on CUDA): the
  block kernels' cost (with cp GPUs each rank does half of the ring's time); the matmul path too up to 8192
  tokens.
- document masks (`flex_check`): FlexAttention's block masks against the boolean-mask path on ~200-token
  documents: bf16 numerics against float64 (CUDA: forward and backward of the one-rank path and every ring
  block's forward at cp 2/4; CPU: forward only, FlexAttention has no CPU backward), then speed and peak memory
  at up to 32k tokens (CUDA).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from nanotron.models.attention import document_ids
from nanotron.parallel import context
from nanotron.parallel.context import RingAttention, shard_sequence


class _Mailbox:
    """Stands in for the cp group's send/recv: the n-th ring transfer a rank starts pairs with the n-th of its
    predecessor (every rank starts them in the same order)."""

    def __init__(self, cp: int):
        self.cp, self.slots, self.cond = cp, {}, threading.Condition()
        self.local = threading.local()

    def ring(self, tensor: torch.Tensor, group, cp: int, rank: int):
        mailbox = self
        seq = getattr(self.local, "seq", 0)
        self.local.seq = seq + 1
        with self.cond:
            self.slots[((rank + 1) % cp, seq)] = tensor.clone()
            self.cond.notify_all()

        class Pending:
            def wait(self) -> torch.Tensor:
                with mailbox.cond:
                    mailbox.cond.wait_for(lambda: (rank, seq) in mailbox.slots)
                    return mailbox.slots.pop((rank, seq))

        return Pending()


def run_ring(cp: int, work: Callable[[int], object], timeout: float = 300) -> list[object]:
    """work(rank) on cp threads, each a cp rank of one in-process ring; results by rank.

    Each rank's backward runs on its own thread: autograd otherwise runs the backward of CUDA tensors on one
    worker thread per device, where a rank waiting in the ring for its peer's gradient blocks the peer's backward
    for good. A ring still running after `timeout` seconds is an error, not a hang."""
    mailbox, results, errors = _Mailbox(cp), [None] * cp, []
    original = context._Ring
    context._Ring = mailbox.ring
    try:

        def target(rank: int) -> None:
            try:
                with torch.autograd.set_multithreading_enabled(False):  # thread-local
                    results[rank] = work(rank)
            except BaseException as error:  # surfaced below, after every thread ended
                errors.append(error)
                with mailbox.cond:
                    mailbox.cond.notify_all()

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(cp)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        context._Ring = original
    if errors:
        raise errors[0]
    stuck = [rank for rank, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"cp ranks {stuck} of the in-process ring still run after {timeout:.0f} s")
    return results


def naive(q, k, v, doc, scale):
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def numerics(device: str, cp: int, document: bool, seq: int = 192, dtype: torch.dtype = torch.float64) -> float:
    """Max abs error of every rank's output and gradients (ring run in `dtype`) against the naive float64
    attention of the same (rounded) inputs."""
    g = torch.Generator(device=device).manual_seed(cp)
    shape = dict(dtype=torch.float64, device=device, generator=g)
    q, dout = torch.randn(2, 8, seq, 16, **shape), torch.randn(2, 8, seq, 16, **shape)
    k, v = torch.randn(2, 2, seq, 16, **shape), torch.randn(2, 2, seq, 16, **shape)
    q, k, v, dout = (x.to(dtype).double() for x in (q, k, v, dout))  # the reference sees what the ring sees
    tokens = torch.ones(2, seq, dtype=torch.long, device=device)
    tokens[:, torch.randint(0, seq, (seq // 10,), generator=g, device=device)] = 0
    doc = document_ids(tokens, 0) if document else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    naive(*leaves, doc, 0.25).backward(dout)
    expected = [x.grad for x in leaves]

    def rank_work(rank: int):
        local = [shard_sequence(x, cp, rank, dim=2).to(dtype).requires_grad_() for x in (q, k, v)]
        out = RingAttention(0.25, None, cp, rank)(*local, doc)
        out.backward(shard_sequence(dout, cp, rank, dim=2).to(dtype))
        return [out.detach().double(), *(x.grad.double() for x in local)]

    full_out = naive(q, k, v, doc, 0.25)
    worst = 0.0
    for rank, got in enumerate(run_ring(cp, rank_work)):
        for value, want in zip(got, [full_out, *expected]):
            worst = max(worst, (value - shard_sequence(want, cp, rank, dim=2)).abs().max().item())
    return worst


def speed(device: str, seq: int, kernels: tuple[str, ...] = ("fused",), rounds: int = 5) -> dict[str, float]:
    """ms per forward+backward and peak memory (CUDA): one full SDPA call vs both cp=2 ranks' ring blocks (the
    selected fused kernel; "matmul" adds the reference path), bf16 (fp32 on CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 32, seq, 64, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, 4, seq, 64, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    cuda = device == "cuda"

    def full() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    def ring(kernel: str) -> Callable[[], None]:
        def rank_work(rank: int):
            local = [shard_sequence(x.detach(), 2, rank, dim=2).requires_grad_() for x in (q, k, v)]
            RingAttention(0.125, None, 2, rank)(*local).sum().backward()

        def run() -> None:
            chosen = context.block_kernel
            context.block_kernel = chosen if kernel == "fused" else (lambda q, masked: "matmul")
            try:
                run_ring(2, rank_work)
            finally:
                context.block_kernel = chosen

        return run

    runs = {"full_sdpa": full, **{f"ring_cp2_{kernel}": ring(kernel) for kernel in kernels}}
    result: dict[str, float] = {"seq_len": seq}
    for name, fn in runs.items():
        times = []
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(rounds + 1):  # the first round warms up
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result[f"{name}_ms"] = 1e3 * sorted(times[1:])[rounds // 2]
        result[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        q.grad = k.grad = v.grad = None
    return result


def flex_check(device: str, seq_len: int) -> bool:
    """FlexAttention's document block masks against the boolean-mask path they replace on CUDA, on short documents
    (~200 tokens, 1B shape): numerics in bf16 against float64 (CUDA: forward and backward of the one-rank path, and
    every ring block's forward at cp 2 and 4; CPU, where FlexAttention has no backward: the forward at a small size),
    bounded like the block kernels; then forward+backward speed of both at `seq_len` tokens (CUDA)."""
    from nanotron.models import attention
    from nanotron.models.attention import DotProductAttention

    cuda = device == "cuda"
    seq, heads = (2048, 32) if cuda else (128, 4)
    g = torch.Generator(device=device).manual_seed(0)

    def case(seq: int, heads: int):
        shape = dict(dtype=torch.float64, device=device, generator=g)
        q, dout = torch.randn(1, heads, seq, 64, **shape), torch.randn(1, heads, seq, 64, **shape)
        k, v = torch.randn(1, heads // 8 or 1, seq, 64, **shape), torch.randn(1, heads // 8 or 1, seq, 64, **shape)
        tokens = torch.ones(1, seq, dtype=torch.long, device=device)
        tokens[:, torch.randint(0, seq, (max(seq // 200, 2),), generator=g, device=device)] = 0
        return [x.bfloat16().double() for x in (q, k, v)], dout.bfloat16().double(), document_ids(tokens, 0)

    (q, k, v), dout, doc = case(seq, heads)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = naive(*leaves, doc, 0.125)
    if cuda:
        expected.backward(dout)
    want = [expected.detach(), *(x.grad for x in leaves if cuda)]
    errors, chosen = {}, attention.document_kernel
    for kernel in ("mask", "flex"):
        attention.document_kernel = lambda device_type, kernel=kernel: kernel
        try:
            inputs = [x.bfloat16().requires_grad_(cuda) for x in (q, k, v)]
            out = DotProductAttention(0.125)(*inputs, doc)
            if cuda:
                out.backward(dout.bfloat16())
            got = [out.detach(), *(x.grad for x in inputs if cuda)]
            errors[kernel] = max((a.double() - b).abs().max().item() for a, b in zip(got, want))
        finally:
            attention.document_kernel = chosen
    bound = min(
        KERNEL_ERROR_RATIO * errors["mask"] + KERNEL_ERROR_FLOOR[torch.bfloat16], KERNEL_ERROR_CAP[torch.bfloat16]
    )
    ok = errors["flex"] <= bound
    what = "forward and backward" if cuda else "forward"
    print(
        f"document masks flex vs boolean mask ({device}, {seq} tokens, {what}): max error vs float64 flex "
        f"{errors['flex']:.2e}, mask {errors['mask']:.2e}  {'ok' if ok else f'FAILED (> {bound:.2e})'}",
        flush=True,
    )
    ok &= flex_ring_numerics(device, q, k, v, doc)
    if cuda:
        (q, k, v), dout, doc = case(seq_len, 32)
        q, k, v, dout = (x.bfloat16() for x in (q, k, v, dout))
        times = {}
        for kernel in ("mask", "flex"):
            attention.document_kernel = lambda device_type, kernel=kernel: kernel
            try:
                # SDPA takes grouped KV heads on CUDA only in its flash (no mask) and math kernels: the boolean mask
                # is timed on K/V expanded to every head (the memory-efficient kernel), not the math kernel's
                # [heads, seq, seq] fp32 scores (128 GiB at 32k tokens).
                kv = (
                    [x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v)]
                    if kernel == "mask"
                    else [k, v]
                )
                leaves = [x.clone().requires_grad_() for x in (q, *kv)]
                torch.cuda.reset_peak_memory_stats()
                times[kernel] = _time_ms(lambda leaves=leaves: DotProductAttention(0.125)(*leaves, doc).backward(dout))
                times[kernel + "_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            finally:
                attention.document_kernel = chosen
        print(
            f"document masks speed at {seq_len} tokens (~200-token documents, forward+backward): flex "
            f"{times['flex']:.1f} ms (peak {times['flex_peak_gib']:.2f} GiB), boolean mask (K/V expanded) "
            f"{times['mask']:.1f} ms (peak {times['mask_peak_gib']:.2f} GiB), x{times['mask'] / times['flex']:.2f}",
            flush=True,
        )
    return ok


def flex_ring_numerics(device: str, q, k, v, doc) -> bool:
    """Every visible ring block's forward through FlexAttention (global-position block masks) against the block
    the ring trains with, in bf16, at cp 2 and 4: output and log-sum-exp within bf16 rounding."""
    ok = True
    q, k, v = (x.bfloat16() for x in (q, k, v))
    for cp in (2, 4):
        worst = 0.0
        for rank in range(cp):
            local_q = shard_sequence(q, cp, rank, dim=2)
            for source in range(cp):
                local_k, local_v = (shard_sequence(x, cp, source, dim=2) for x in (k, v))
                out, lse = context.flex_block_forward(local_q, local_k, local_v, doc, cp, rank, source, 0.125)
                rows, cols, causal = context.block_plan(cp, rank, source, local_q.shape[2])
                mask = context._block_mask(doc, cp, rank, source, rows, cols, causal)
                want_out, want_lse = context._block_forward(
                    local_q[:, :, rows], local_k[:, :, cols], local_v[:, :, cols], causal, mask, 0.125
                )
                same_empty = torch.equal(lse.isinf(), want_lse.isinf())
                lse_error = (lse.float() - want_lse.float()).nan_to_num(0.0).abs().max().item()
                out_error = (out.float() - want_out.float()).abs().max().item()
                worst = max(worst, lse_error, out_error) if same_empty else float("inf")
        good = worst <= 3e-2  # two bf16 roundings of values of order 1
        ok &= good
        verdict = "ok" if good else "FAILED"
        print(f"document masks flex ring blocks cp{cp} ({device}): max difference {worst:.2e}  {verdict}", flush=True)
    return ok


def _time_ms(fn: Callable[[], object], rounds: int = 5) -> float:
    times = []
    for _ in range(rounds + 1):  # the first warms up (and compiles)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[1:])[rounds // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp_check", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096], help="tokens for the speed comparison")
    args = parser.parse_args(argv)
    return 0 if check(args.device, tuple(args.seq_len)) else 1


# The fused kernels' errors against float64 may be at most this multiple of the matmul path's in the same dtype (which
# multiplies in that dtype and accumulates in fp32), plus a floor for when that one is near zero, and never above
# the cap (the matmul path shares the ring's merge: a wrong merge would move both). CPU, seq 192, max abs over
# output and gradients: fp32 1.3-2.3e-6 on both kernels, bf16 1.4-2.8e-2 (matmul) and 2.7-3.7e-2 (fused).
KERNEL_ERROR_RATIO, KERNEL_ERROR_FLOOR = 3.0, {torch.float32: 1e-5, torch.bfloat16: 1e-2}
KERNEL_ERROR_CAP = {torch.float32: 1e-4, torch.bfloat16: 1e-1}


def check(device: str, seq_lens: tuple[int, ...]) -> bool:
    """Prints the numerics, then the speed; False when an error is out of bounds.

    CPU: both block kernels (the fused CPU one and the plain-matmul one) in float64, at most 1e-10 from full
    attention. CUDA: the matmul path in float64 (1e-10). Then the fused kernels the ring selects in bf16 and fp32
    (CUDA: bf16 unmasked flash; masked, or fp32, memory-efficient), each within KERNEL_ERROR_RATIO of the matmul
    path's error in the same dtype. Then speed and peak memory of ring cp2 vs full SDPA at each of `seq_lens` (the
    matmul path only up to 8192 tokens: beyond, its [q, k] score blocks do not fit)."""
    ok = True
    # FlexAttention compiles once per shape: the one-rank case, each ring block at cp 2 and 4 and the timed length
    # are 8 variants, dynamo's default limit; past it flex falls back to eager (scores in memory).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    chosen = context.block_kernel
    matmul = lambda q, masked: "matmul"  # noqa: E731
    kernels = ("fused", "matmul") if device == "cpu" else ("matmul",)
    for kernel in kernels:
        context.block_kernel = chosen if kernel != "matmul" else matmul
        try:
            for cp in (2, 4):
                for document in (False, True):
                    error = numerics(device, cp, document)
                    verdict = "ok" if error <= 1e-10 else "FAILED (> 1e-10)"
                    ok &= error <= 1e-10
                    mask = "document" if document else "causal"
                    print(f"cp attention {kernel} cp{cp} {mask:8s}: max error vs full attention {error:.2e} {verdict}")
        finally:
            context.block_kernel = chosen
    ok &= kernel_numerics(device)
    ok &= flex_check(device, min(max(seq_lens), 32768))  # beyond, the boolean mask alone is 4 GB and more
    for seq in seq_lens:
        kernels = ("fused", "matmul") if seq <= 8192 else ("fused",)
        result = speed(device, seq, kernels)
        times = ", ".join(
            f"{name[:-3]} {value:.1f} ms"
            + (f" (peak {result[name[:-3] + '_peak_gib']:.2f} GiB)" if device == "cuda" else "")
            for name, value in result.items()
            if name.endswith("_ms")
        )
        print(f"cp attention {device} speed at {seq} tokens, both cp2 ranks on this device: {times}", flush=True)
    return ok


def kernel_numerics(device: str) -> bool:
    """Each fused block kernel the ring selects on `device` (CUDA: flash and memory-efficient; CPU: its one), in
    bf16 and fp32 through the ring at cp 2 and 4, against float64, bounded by the matmul path's error."""
    ok, chosen = True, context.block_kernel
    for dtype in (torch.bfloat16, torch.float32):
        for cp in (2, 4):
            for document in (False, True):
                q = torch.empty(1, 1, 1, 16, dtype=dtype, device=device)
                kernel = chosen(q, document)
                context.block_kernel = lambda q, masked: "matmul"
                try:
                    reference = numerics(device, cp, document, dtype=dtype)
                finally:
                    context.block_kernel = chosen
                error = numerics(device, cp, document, dtype=dtype)
                bound = min(KERNEL_ERROR_RATIO * reference + KERNEL_ERROR_FLOOR[dtype], KERNEL_ERROR_CAP[dtype])
                ok &= error <= bound
                print(
                    f"cp attention {kernel} {str(dtype).removeprefix('torch.')} cp{cp} "
                    f"{'document' if document else 'causal':8s}: max error vs float64 {error:.2e} (matmul path "
                    f"{reference:.2e}) {'ok' if error <= bound else f'FAILED (> {bound:.2e})'}",
                    flush=True,
                )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
