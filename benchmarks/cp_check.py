"""Context parallelism's attention on one device: numerics against full attention, then speed.

    python -m benchmarks.cp_check [--device cuda] [--seq-len 4096]

The ring runs for real (nanotron.parallel.context's forward and backward, block kernels and log-sum-exp
merge) with each cp rank a thread on the same device; only the peer-to-peer transport is replaced by an
in-process mailbox, so one GPU checks the CUDA path (multi-GPU runs check the transport: gpu_check's cp2 row).

- numerics: float64, causal and document masks (documents crossing chunk boundaries), cp 2 and 4, every
  rank's output and dq/dk/dv against a naive full attention: max error <= 1e-10;
- speed: forward + backward of bf16 attention over `--seq-len` tokens (1B shape: 32 heads, 4 KV heads,
  head dim 64), all cp=2 ranks' blocks on the one device against one full SDPA call (flash on CUDA): the
  block kernels' cost (with cp GPUs each rank does half of the ring's time).
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


def run_ring(cp: int, work: Callable[[int], object]) -> list[object]:
    """work(rank) on cp threads, each a cp rank of one in-process ring; results by rank."""
    mailbox, results, errors = _Mailbox(cp), [None] * cp, []
    original = context._Ring
    context._Ring = mailbox.ring
    try:

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as error:  # surfaced below, after every thread ended
                errors.append(error)
                with mailbox.cond:
                    mailbox.cond.notify_all()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        context._Ring = original
    if errors:
        raise errors[0]
    return results


def naive(q, k, v, doc, scale):
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def numerics(device: str, cp: int, document: bool, seq: int = 192) -> float:
    """Max abs error of every rank's output and gradients against the naive float64 attention."""
    g = torch.Generator(device=device).manual_seed(cp)
    shape = dict(dtype=torch.float64, device=device, generator=g)
    q, dout = torch.randn(2, 8, seq, 16, **shape), torch.randn(2, 8, seq, 16, **shape)
    k, v = torch.randn(2, 2, seq, 16, **shape), torch.randn(2, 2, seq, 16, **shape)
    tokens = torch.ones(2, seq, dtype=torch.long, device=device)
    tokens[:, torch.randint(0, seq, (seq // 10,), generator=g, device=device)] = 0
    doc = document_ids(tokens, 0) if document else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    naive(*leaves, doc, 0.25).backward(dout)
    expected = [x.grad for x in leaves]

    def rank_work(rank: int):
        local = [shard_sequence(x, cp, rank, dim=2).clone().requires_grad_() for x in (q, k, v)]
        out = RingAttention(0.25, None, cp, rank)(*local, doc)
        out.backward(shard_sequence(dout, cp, rank, dim=2))
        return [out.detach(), *(x.grad for x in local)]

    full_out = naive(q, k, v, doc, 0.25)
    worst = 0.0
    for rank, got in enumerate(run_ring(cp, rank_work)):
        for value, want in zip(got, [full_out, *expected]):
            worst = max(worst, (value - shard_sequence(want, cp, rank, dim=2)).abs().max().item())
    return worst


def speed(device: str, seq: int, rounds: int = 5) -> dict[str, float]:
    """ms per forward+backward: one full SDPA call vs both cp=2 ranks' ring blocks, bf16 (fp32 on CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 32, seq, 64, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, 4, seq, 64, dtype=dtype, device=device, requires_grad=True) for _ in range(2))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def full() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    def ring() -> None:
        def rank_work(rank: int):
            local = [shard_sequence(x.detach(), 2, rank, dim=2).requires_grad_() for x in (q, k, v)]
            RingAttention(0.125, None, 2, rank)(*local).sum().backward()

        run_ring(2, rank_work)

    times = {"full": [], "ring": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in (("full", full), ("ring", ring)):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    full_ms, ring_ms = (1e3 * sorted(times[n][1:])[rounds // 2] for n in ("full", "ring"))
    return {"seq_len": seq, "full_sdpa_ms": full_ms, "ring_cp2_all_ranks_ms": ring_ms, "ratio": ring_ms / full_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp_check", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens for the speed comparison")
    args = parser.parse_args(argv)
    return 0 if check(args.device, args.seq_len) else 1


def check(device: str, seq_len: int) -> bool:
    """Prints the numerics and the speed; False when an error exceeds 1e-10. On CPU both block kernels are
    checked: the fused CPU one and the plain-matmul one that CUDA runs."""
    ok = True
    fused = context._fused
    for kernel in ("fused", "matmul") if device == "cpu" else (device,):
        context._fused = fused if kernel != "matmul" else (lambda q: False)
        try:
            for cp in (2, 4):
                for document in (False, True):
                    error = numerics(device, cp, document)
                    verdict = "ok" if error <= 1e-10 else "FAILED (> 1e-10)"
                    ok &= error <= 1e-10
                    mask = "document" if document else "causal"
                    print(f"cp attention {kernel} cp{cp} {mask:8s}: max error vs full attention {error:.2e} {verdict}")
        finally:
            context._fused = fused
    result = speed(device, seq_len)
    print(
        f"cp attention {device} speed at {seq_len} tokens: full SDPA {result['full_sdpa_ms']:.1f} ms, ring cp2 "
        f"(both ranks on this device) {result['ring_cp2_all_ranks_ms']:.1f} ms, x{result['ratio']:.2f}",
        flush=True,
    )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
