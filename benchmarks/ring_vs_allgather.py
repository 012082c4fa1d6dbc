"""Context parallelism's attention, two ways, measured: nanotron's ring against an all-gather of K/V.

    python -m benchmarks.ring_vs_allgather [--seq-len 8192] [--cp 2,4] [--rounds 5]

Both run for real over a gloo group of cp processes on this machine, each rank holding its zigzag chunks of
one sequence (heads 8, KV heads 2, head dim 64, fp32), forward and backward of the attention alone:
- ring: `nanotron.parallel.context.RingAttention` (K/V blocks passed peer to peer, log-sum-exp merges);
- all-gather: every rank gathers the whole sequence's K/V (`torch.distributed.nn.functional.all_gather`,
  gradients reduce-scattered back), then attends with its two query chunks against the keys before them
  (the same fused CPU kernel, with an additive causal mask for the chunk's diagonal).
Measured per rank: forward+backward time (median over interleaved rounds), and the bytes autograd saves for
backward (saved-tensor hooks, each storage once): what stays alive per layer until backward. The outputs of
the two are compared (they must agree to 1e-5).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS_DIR, bench_parser, write_table
from nanotron.parallel.context import RingAttention, shard_sequence, zigzag_positions
from nanotron.parallel.torch_private import attention_with_lse

HEADS, KV_HEADS, DIM, SCALE = 8, 2, 64, 0.125


def allgather_attention(q, k, v, cp: int, rank: int, seq_len: int) -> torch.Tensor:
    """The all-gather alternative: whole-sequence K/V on every rank, each query chunk against its past."""
    from torch.distributed.nn.functional import all_gather

    chunk = seq_len // (2 * cp)

    def whole(x: torch.Tensor) -> torch.Tensor:  # zigzag parts of every rank -> the sequence in order
        parts = all_gather(x.contiguous())
        chunks = [None] * (2 * cp)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp - 1 - r] = part[:, :, :chunk], part[:, :, chunk:]
        return torch.cat(chunks, dim=2)

    groups = q.shape[1] // k.shape[1]
    k_all, v_all = (whole(x).repeat_interleave(groups, dim=1) for x in (k, v))
    positions = zigzag_positions(seq_len, cp, rank)
    outs = []
    for half in (slice(0, chunk), slice(chunk, 2 * chunk)):
        pos = positions[half]
        end = int(pos[-1]) + 1
        # the same fused CPU kernel the ring uses (SDPA with a boolean mask would take its unfused math path)
        mask = torch.zeros(chunk, end).masked_fill_(pos[:, None] < torch.arange(end)[None, :], float("-inf"))
        out, _ = attention_with_lse(q[:, :, half], k_all[:, :, :end], v_all[:, :, :end], False, mask, SCALE)
        outs.append(out)
    return torch.cat(outs, dim=2)


def saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """fn(*args)'s output and the bytes of the storages autograd saved for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


def _worker(rank: int, cp: int, port: int, seq_len: int, rounds: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*")  # the public one, with autograd
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq_len, DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, seq_len, DIM, generator=g) for _ in range(2))
    local = [shard_sequence(x, cp, rank, dim=2) for x in (q, k, v)]
    ring = RingAttention(SCALE, dist.group.WORLD, cp, rank)
    ways = {
        "ring": lambda a, b, c: ring(a, b, c),
        "all-gather K/V": lambda a, b, c: allgather_attention(a, b, c, cp, rank, seq_len),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    saved, outputs = {}, {}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, way in ways.items():
            leaves = [x.clone().requires_grad_() for x in local]
            dist.barrier()
            start = time.perf_counter()
            out, nbytes = saved_bytes(way, *leaves)
            out.sum().backward()
            dist.barrier()
            if round_:
                times[name].append(time.perf_counter() - start)
            saved[name], outputs[name] = nbytes, out.detach()
    difference = (outputs["ring"] - outputs["all-gather K/V"]).abs().max().item()
    queue.put((rank, {n: (statistics.median(t), saved[n]) for n, t in times.items()}, difference))
    dist.destroy_process_group()


def measure(cp: int, seq_len: int, rounds: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, seq_len, rounds, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    worst_difference = max(diff for *_, diff in results)
    if worst_difference > 1e-5:
        raise RuntimeError(f"ring and all-gather disagree by {worst_difference:.2e} at cp {cp}")
    rows = []
    for name in ("ring", "all-gather K/V"):
        seconds = max(r[1][name][0] for r in results)  # the slowest rank sets the step
        saved = max(r[1][name][1] for r in results)
        rows.append(
            {"cp": cp, "seq_len": seq_len, "attention": name, "fwd_bwd_ms": 1e3 * seconds, "saved_mib": saved / 2**20}
        )
    for row in rows:
        row["vs_ring_time"] = row["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"]
        row["vs_ring_saved"] = row["saved_mib"] / rows[0]["saved_mib"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("ring_vs_allgather", __doc__)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", default="2,4", help="comma-separated cp sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="512 tokens, cp 2, 2 rounds")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    seq, cps, rounds = args.seq_len, [int(c) for c in args.cp.split(",")], args.rounds
    if args.quick:
        seq, cps, rounds = 512, [2], 2
    rows = [row for cp in cps for row in measure(cp, seq, rounds)]
    from pathlib import Path

    print(write_table(rows, list(rows[0]), Path(args.out) / "ring_vs_allgather"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
