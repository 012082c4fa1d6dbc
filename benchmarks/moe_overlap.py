"""The expert all-to-all under the shared experts (`parallelism.ep_overlap`): measured on CPU, expected on a GPU.

    python -m benchmarks.moe_overlap [--rounds 6] [--iters 4] [--tokens 4096] [--quick]

CPU: two ranks on gloo (its collectives run on a background thread, so the overlap is real here) each run one MoE
layer's forward and backward at ep2 (4 of 8 experts each, top 2, and a shared expert), the overlap on and off in
interleaved rounds (the order alternating: the 2 shared cores are noisy). Per iteration, rank 0's wall time, its
process CPU time (`resource.getrusage`: every thread, gloo's included) and the time its host is blocked in the
all-to-alls (inside a synchronous one, or waiting for an asynchronous one): the dispatch's (forward, and its
reverse in backward: what the overlap hides) apart from the others' (the counts', which also absorbs the ranks'
skew, the combine's and its reverse's). A loaded machine's wall clock blurs the gain; the blocked time shows it.
In the same rounds, the parts alone: the token all-to-all there and back, and the shared experts' forward and
backward. The gain to expect is the smaller of the dispatch all-to-all (forward, and its reverse in backward) and
the shared experts' time; the combine all-to-all stays exposed. First, the layer's output and gradients with the
overlap on against off (`overlap_check`, gpu_check's row, does the same on two GPUs with NCCL).

GPU, expected (not measured): DeepSeek-V3's shape from `configs/deepseek_v3.toml` (4096 tokens per microbatch, top
8, hidden 7168, one shared expert of 2048, bf16) with the planner's H100 figures (bf16 peak, its calibrated
efficiency, NVLink and InfiniBand bandwidths): the dispatch all-to-all's time per layer and microbatch against the
shared experts' GEMMs, inside a node (ep 8) and across nodes (ep 64).
Writes benchmarks/results/moe_overlap.csv/.md.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, bench_parser, write_table

COLUMNS = ["what", "overlap", "wall_ms", "wall_min_ms", "wall_max_ms", "cpu_ms", "dispatch_blocked_ms"]
COLUMNS += ["dispatch_blocked_min_ms", "dispatch_blocked_max_ms", "other_blocked_ms", "rounds"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer(settings: dict, rank: int, group, device):
    """One MoE layer with this rank's half of the experts (ep2) and the shared experts, and this rank's tokens."""
    import torch

    from nanotron.config import ModelConfig
    from nanotron.config.validate import resolve_model
    from nanotron.models.llama import MLP
    from nanotron.models.moe import MoE
    from nanotron.parallel.expert import AllToAllDispatch, grouped_expert_mlp

    hidden, experts = settings["hidden"], settings["experts"]
    cfg = ModelConfig(hidden_size=hidden, intermediate_size=hidden, num_layers=2, num_heads=4, num_kv_heads=4)
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router = experts, settings["top_k"], "sigmoid"
    cfg.moe.moe_intermediate_size = settings["expert_width"]
    resolve_model(cfg)
    torch.manual_seed(0)
    moe = MoE(cfg, MLP(hidden, settings["shared_width"]))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mine = slice(rank * experts // 2, (rank + 1) * experts // 2)
    for name in ("gate_up_proj", "down_proj"):
        setattr(moe.experts, name, torch.nn.Parameter(getattr(moe.experts, name).data[mine].clone()))
    moe.to(device, settings["dtype"])
    moe.experts.mlp = grouped_expert_mlp  # the grouped GEMM on CUDA in bf16, the per-expert loop elsewhere
    moe.dispatcher = AllToAllDispatch(group, ep=2, overlap=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, settings["tokens"], hidden, generator=g).to(device, settings["dtype"]).requires_grad_()
    return moe, x


def _difference(moe, x) -> float:
    """The largest difference between the layer's output and gradients with the overlap on and off, relative to
    the largest magnitude of each (off's)."""
    import torch

    results = []
    for overlap in (False, True):
        moe.dispatcher.overlap = overlap
        moe.zero_grad()
        x.grad = None
        out = moe(x)
        out.float().square().mean().backward()
        results.append([out.detach(), x.grad, *(p.grad for p in moe.parameters())])
    worst = 0.0
    for off, on in zip(*results):
        scale = off.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        worst = max(worst, float((on.float() - off.float()).abs().max() / scale))
    return worst


# Seconds the host spent inside each synchronous all-to-all or waiting for each asynchronous one, in order. A
# layer's forward and backward make five: the counts, the dispatch, the combine, the combine's reverse and the
# dispatch's reverse (the counts' absorbs the ranks' skew: the first to arrive waits for the other there).
BLOCKED: list[float] = []
DISPATCH = (1, 4)


def _count_blocked() -> None:
    """Times every synchronous all_to_all_single and every wait for an asynchronous one (`_InFlight.wait`): the
    all-to-all time the host is exposed to, which a loaded machine's wall clock blurs far less than the total."""
    import torch.distributed as dist

    from nanotron.parallel import expert

    def blocking(fn, is_async):
        def timed(*args, **kwargs):
            if is_async(kwargs):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                BLOCKED.append(time.perf_counter() - start)

        return timed

    dist.all_to_all_single = blocking(dist.all_to_all_single, lambda kwargs: kwargs.get("async_op", False))
    expert._InFlight.wait = blocking(expert._InFlight.wait, lambda kwargs: False)


def _timed(fn, iters: int, synchronize=None) -> tuple[float, float, float, float]:
    """Per call: wall, process CPU (all threads) and all-to-all-blocked seconds, the dispatch's and the others'."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, wall = usage.ru_utime + usage.ru_stime, time.perf_counter()
    BLOCKED.clear()
    for _ in range(iters):
        fn()
    if synchronize is not None:
        synchronize()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu
    per_call = len(BLOCKED) // iters
    dispatch = sum(b for i, b in enumerate(BLOCKED) if per_call == 5 and i % 5 in DISPATCH)
    return (time.perf_counter() - wall) / iters, cpu / iters, dispatch / iters, (sum(BLOCKED) - dispatch) / iters


def worker(rank: int, port: int, queue, settings: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    cuda = settings["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2)
    _count_blocked()
    moe, x = _layer(settings, rank, dist.group.WORLD, device)
    difference = _difference(moe, x)  # numerics first
    tokens, hidden = settings["tokens"], settings["hidden"]
    rows = torch.randn(settings["top_k"] * tokens, hidden, device=device, dtype=settings["dtype"])
    half = [len(rows) // 2, len(rows) - len(rows) // 2]  # the dispatch all-to-all's size, half of it crossing

    def layer():
        moe(x).float().square().mean().backward()

    def all_to_all():  # there and back, as the dispatch does forward (and its reverse in backward)
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows, half, half)
        dist.all_to_all_single(rows, out, half, half)

    def shared():
        moe.shared_experts(x.view(tokens, hidden)).float().square().mean().backward()

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        try:
            return _timed(fn, settings["iters"], torch.cuda.synchronize if cuda else None)
        finally:
            dist.barrier()

    parts = {("layer", True): layer, ("layer", False): layer, ("all-to-all there and back", None): all_to_all}
    parts[("shared experts fwd+bwd", None)] = shared
    times: dict[tuple, list[tuple[float, float, float, float]]] = {key: [] for key in parts}
    for round_ in range(settings["rounds"]):
        for key in parts if round_ % 2 == 0 else reversed(list(parts)):
            moe.dispatcher.overlap = bool(key[1])
            parts[key]()  # warm
            dist.barrier()
            times[key].append(timed(parts[key]))
    if rank == 0:
        queue.put((difference, times))
    dist.barrier()
    dist.destroy_process_group()


def measure(settings: dict) -> tuple[float, list[dict]]:
    """Two ranks at ep2: the largest relative difference overlap on vs off (rank 0's output and gradients), and a
    row per part (the layer each way, the all-to-all alone, the shared experts alone)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=worker, args=(r, port, queue, settings)) for r in range(2)]
    for p in procs:
        p.start()
    difference, times = queue.get(timeout=3600)
    for p in procs:
        p.join(timeout=120)
    rows = []
    for (what, overlap), samples in times.items():
        walls, cpus, dispatch, others = ([1e3 * v for v in values] for values in zip(*samples))
        rows.append(
            {
                "what": what,
                "overlap": "" if overlap is None else ("on" if overlap else "off"),
                "wall_ms": statistics.median(walls),
                "wall_min_ms": min(walls),
                "wall_max_ms": max(walls),
                "cpu_ms": statistics.median(cpus),
                "dispatch_blocked_ms": statistics.median(dispatch),
                "dispatch_blocked_min_ms": min(dispatch),
                "dispatch_blocked_max_ms": max(dispatch),
                "other_blocked_ms": statistics.median(others),
                "rounds": len(samples),
            }
        )
    return difference, rows


# gpu_check's row: DeepSeek-V3's width and top 8 over 16 experts of 2048 (8 per GPU) and a shared expert of 2048, 4096
# tokens per GPU, bf16 (the grouped GEMM); --quick: a nano layer in float32 on CPU over gloo.
CHECK_SHAPES = {
    "cuda": dict(tokens=4096, hidden=7168, experts=16, top_k=8, expert_width=2048, shared_width=2048, tolerance=2e-2),
    "cpu": dict(tokens=64, hidden=32, experts=8, top_k=2, expert_width=16, shared_width=64, tolerance=1e-5),
}


def overlap_check(device: str, n_devices: int) -> bool:
    """`parallelism.ep_overlap` at ep2 on two devices (gloo on CPU): on vs off, the layer's output and gradients
    (numerics first: the same operations, only the accumulation order of the input's gradient and, on CUDA,
    index_add's atomics differ), then its forward + backward time each way. Skipped with fewer than two GPUs."""
    import torch

    if device == "cuda" and n_devices < 2:
        print("moe ep2 overlap: skipped (one GPU visible; it needs two)", flush=True)
        return True
    shape = CHECK_SHAPES[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    settings = {**shape, "device": device, "dtype": dtype, "rounds": 3, "iters": 5 if device == "cuda" else 1}
    difference, rows = measure(settings)
    ok = difference <= shape["tolerance"]
    print(
        f"moe ep2 overlap ({device}): largest difference on vs off {difference:.1e} of the largest value "
        f"(tolerance {shape['tolerance']:g}) {'ok' if ok else 'FAILED'}",
        flush=True,
    )
    ms = {(r["what"], r["overlap"]): r["wall_ms"] for r in rows}
    on, off = ms["layer", "on"], ms["layer", "off"]
    print(
        f"moe ep2 overlap ({device}): layer forward+backward {on:.2f} ms with the overlap, {off:.2f} ms without "
        f"({off / on:.2f}x); alone: the all-to-all there and back {ms['all-to-all there and back', '']:.2f} ms, the "
        f"shared experts forward+backward {ms['shared experts fwd+bwd', '']:.2f} ms (medians of 3 rounds)",
        flush=True,
    )
    return ok


def gpu_expectation() -> list[str]:
    """The dispatch all-to-all against the shared experts per MoE layer and microbatch at DeepSeek-V3's shape,
    from the planner's H100 figures."""
    from nanotron.config import load_config
    from nanotron.gpu import GPUS
    from nanotron.plan.timing import H100_EFFICIENCY

    m = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "deepseek_v3.toml"), []).model
    tokens = 4096  # micro_batch_size 1 x seq_len 4096
    h100 = GPUS["H100", ""]
    flops = 2 * tokens * m.hidden_size * 3 * m.moe.num_shared_experts * m.moe.moe_intermediate_size
    shared_fwd_ms = 1e3 * flops / (h100.bf16 * 1e12 * H100_EFFICIENCY.default)
    lines = [
        f"shared experts forward {flops / 1e9:.0f} GFLOP: {shared_fwd_ms:.2f} ms (backward {2 * shared_fwd_ms:.2f} ms)"
        f" at {h100.bf16:g} TFLOP/s x {H100_EFFICIENCY.default}"
    ]
    for ep, link, gbps in ((8, "NVLink", h100.nvlink_gbps), (64, "InfiniBand", h100.ib_gbps)):
        sent = m.moe.top_k * tokens * m.hidden_size * 2 * (ep - 1) / ep
        a2a_ms = 1e3 * sent / (gbps * 1e9)
        hidden = min(a2a_ms, shared_fwd_ms) + min(a2a_ms, 2 * shared_fwd_ms)
        exposed = 4 * a2a_ms  # dispatch and combine, forward and backward (recompute adds 2 more, none hidden)
        lines.append(
            f"ep {ep} over {link} ({gbps:g} GB/s): one all-to-all {sent / 1e6:.0f} MB, {a2a_ms:.2f} ms; hidden "
            f"{hidden:.2f} ms of the layer's {exposed:.2f} ms of all-to-alls ({100 * hidden / exposed:.0f}%)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("moe_overlap", __doc__)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each: every part once)")
    parser.add_argument("--iters", type=int, default=4, help="timed calls per part and round")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--shared-width", type=int, default=1024, help="the shared experts' intermediate size")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 2 rounds: a smoke test of the script")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "moe_overlap")
    args = parser.parse_args(argv)
    import torch

    settings = {"rounds": args.rounds, "iters": args.iters, "tokens": args.tokens, "hidden": args.hidden}
    settings |= {"shared_width": args.shared_width, "experts": 8, "top_k": 2, "expert_width": 64}
    settings |= {"device": "cpu", "dtype": torch.float32}
    if args.quick:
        settings |= {"rounds": 2, "iters": 1, "tokens": 64, "hidden": 32, "shared_width": 64}
    difference, rows = measure(settings)
    print(f"largest difference overlap on vs off: {difference:.1e} of the largest value")
    print(write_table(rows, COLUMNS, args.out))
    for line in gpu_expectation():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
