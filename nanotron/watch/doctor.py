"""`nanotron doctor`: find bad nodes before step 1.

    nanotron doctor --config CFG [--section.key=value ...] [--nproc_per_node N]

or `training.preflight = true` to run the same checks inside the job, after the process group is up and before the
model is built. Every rank (at the config's layout, so the mesh dimensions are the job's):
  compute   a seeded matmul, timed, and its checksum: a device whose result differs from the others' is named;
            one slower than half the median is named (on CPU its process time is timed: ranks share a machine's
            cores, with other jobs too, and a rank the scheduler starves is not a slow device)
  links     all-reduce bus bandwidth over each mesh dimension's groups, then a pairwise pass (each rank with its
            ring neighbours): a rank or link slower than half the median is named
A rank that looks slow is measured again (MEASURE_AGAIN rounds, keeping its best) before it is named: a node shared
with another job, or a moment's contention, is not a bad node.
  disk      each node's first rank writes (fsync) and reads back a file in checkpoint.dir: the speed, the time one
            checkpoint would take, and the free space against the planned checkpoint size
  clocks    host clock skew against rank 0, from the time each rank leaves one barrier
One line per finding, naming rank and node, and a table of the figures. Exit code 75 (the node-fault code; inside a
job the suspect nodes go to <run dir>/suspect_nodes.txt, for the requeue) when a node is bad; 2 when the disk or
clocks need a fix, or when every node of the job would be excluded (a requeue without them all could go nowhere
useful: a person looks). Run standalone (`nanotron doctor`), it writes nothing into the run dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanotron.config import Config
from nanotron.console import say
from nanotron.errors import ConfigError, NodeFaultError
from nanotron.models.shapes import num_params
from nanotron.parallel.mesh import ParallelContext
from nanotron.watch.faults import Fault
from nanotron.watch.nodes import node_name
from nanotron.watch.suspects import write_suspects

MATMUL_SIZE, MATMUL_REPEATS = 512, 4
ROUNDS = 3  # every timing is the best of this many
MATMUL_TOLERANCE = 1e-2  # largest error relative to the largest element: TF32's 10-bit mantissa stays well below
COMM_BYTES = 1 << 22
DISK_BYTES = 32 << 20
SLOW = 0.5  # a rank or link below half the median is named
MEASURE_AGAIN = 2  # rounds an apparent outlier is measured again in (best kept) before it is named
CLOCK_SKEW_SECONDS = 1.0
MIN_DISK_MBPS = 50.0


def compute(ctx: ParallelContext, fault: Fault | None) -> dict:
    """TFLOP/s of a seeded matmul and a checksum of its result (the same inputs on every rank)."""
    generator = torch.Generator(device=ctx.device).manual_seed(1234)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator, device=ctx.device)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator, device=ctx.device)

    def matmuls() -> torch.Tensor:
        for _ in range(MATMUL_REPEATS):
            c = a @ b
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return c

    # CPU ranks on one node share its cores: timed together they time-slice, and a rank the scheduler happened to
    # starve looks like a slow device. They take turns instead (one barrier per local rank); GPUs time together.
    turns = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ctx.device.type == "cpu" else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if turns > 1:  # the first turn too starts when every rank is idle, not while some still run what came before
        dist.barrier()
    for turn in range(turns):
        if turn == local_rank % turns:
            c, elapsed = best_of(matmuls, fault, ctx.rank, time.process_time if ctx.device.type == "cpu" else None)
        if turns > 1:
            dist.barrier()
    if fault is not None and fault.kind == "bad_matmul" and fault.applies_to(ctx.rank, node_name()):
        c[0, 0] += 100.0  # what silent data corruption looks like
    checksum = hashlib.sha256(c.cpu().numpy().tobytes()).hexdigest()[:16]
    exact = a.cpu().double() @ b.cpu().double()  # also catches a device that is wrong alone (one rank, one GPU)
    error = ((c.cpu().double() - exact).abs().max() / exact.abs().max()).item()
    return {"tflops": 2 * MATMUL_SIZE**3 * MATMUL_REPEATS / elapsed / 1e12, "checksum": checksum, "error": error}


def best_of(action, fault: Fault | None, rank: int, clock: Callable[[], float] | None = None):
    """(the last result, the shortest of ROUNDS timings on `clock`, wall time by default) of `action`: ranks that
    share cores, or a busy link, time-slice, and the best round is the one that shows the device. An injected
    `slow:F` fault makes this rank F x slower at everything timed here."""
    clock = clock or time.perf_counter
    best = float("inf")
    for _ in range(ROUNDS):
        started = clock()
        result = action()
        elapsed = clock() - started
        if fault is not None and fault.kind == "slow" and fault.applies_to(rank, node_name()):
            time.sleep((fault.factor - 1) * elapsed)
            elapsed *= fault.factor
        best = min(best, elapsed)
    return result, best


def until_done(action: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """`action` (collectives), returning when the device has done them: NCCL's calls return once queued on the GPU,
    so a clock read right after them times the launch, not the transfer."""

    def run() -> None:
        action()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def bus_bandwidth(ctx: ParallelContext, fault: Fault | None) -> dict[str, float]:
    """GB/s of an all-reduce of COMM_BYTES over this rank's group of each mesh dimension (ring bus bandwidth)."""
    figures = {}
    for name in ctx.mesh.mesh_dim_names:
        group = ctx.mesh[name].get_group()
        size = dist.get_world_size(group)
        if size == 1:
            continue
        tensor = torch.ones(COMM_BYTES // 4, device=ctx.device)
        reduce = until_done(lambda group=group, tensor=tensor: dist.all_reduce(tensor, group=group), ctx.device)
        reduce()  # warm-up
        _, elapsed = best_of(reduce, fault, ctx.rank)
        figures[name] = 2 * (size - 1) / size * COMM_BYTES / elapsed / 1e9
    return figures


def ring_rounds(world: int) -> range:
    """The rounds in which every link of the ring of `world` ranks is measured once: 2 for an even ring (even
    pairs, then odd), 3 for an odd one (its last link, back to rank 0, has a round of its own)."""
    return range(0 if world < 2 else 2 if world % 2 == 0 else 3)


def ring_peer(rank: int, world: int, round_: int) -> int | None:
    """The ring neighbour `rank` exchanges with in `round_` of `ring_rounds(world)`, or None (it sits out)."""
    if round_ == 2:  # odd rings only: the link between the last rank and rank 0
        return {0: world - 1, world - 1: 0}.get(rank)
    if world % 2 and rank == (world - 1 if round_ == 0 else 0):
        return None  # an odd ring's rank left without a partner in this round
    return (rank + 1) % world if (rank - round_) % 2 == 0 else (rank - 1) % world


def ring_turn(rank: int, world: int, round_: int, turns: int) -> int:
    """Which of `turns` turns `rank`'s pair of `round_` exchanges in (the same for both ranks of the pair)."""
    return 0 if round_ == 2 else ((rank - round_) % world) // 2 % turns


def pairwise(ctx: ParallelContext, fault: Fault | None) -> dict[int, float]:
    """GB/s of an exchange with each ring neighbour (`ring_rounds`: even pairs, then odd, then an odd ring's last
    link), keyed by the neighbour. On CPU the pairs of a round take turns (one barrier each), as the matmuls do:
    pairs exchanging together on shared cores time-slice, and a starved pair looked like a slow link. GPUs' pairs
    exchange together."""
    world, rank = ctx.world_size, ctx.rank
    figures = {}
    send, receive = torch.ones(COMM_BYTES // 4, device=ctx.device), torch.empty(COMM_BYTES // 4, device=ctx.device)
    turns = max(world // 2, 1) if ctx.device.type == "cpu" else 1
    for round_ in ring_rounds(world):
        peer = ring_peer(rank, world, round_)

        def exchange(peer: int = peer) -> None:
            operations = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)]
            for request in dist.batch_isend_irecv(operations):
                request.wait()

        for turn in range(turns):
            if peer is not None and peer != rank and turn == ring_turn(rank, world, round_, turns):
                _, elapsed = best_of(until_done(exchange, ctx.device), fault, rank)
                figures[peer] = 2 * COMM_BYTES / elapsed / 1e9
            if turns > 1:
                dist.barrier()
        dist.barrier()
    return figures


def disk(cfg: Config, local_rank: int, fault: Fault | None, rank: int) -> dict:
    """Write (fsync) and read-back speed of checkpoint.dir, free space, and what one checkpoint would take."""
    if local_rank != 0:
        return {}
    folder = cfg.checkpoint_dir
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # removed again: the probe leaves nothing
    try:
        return _probe_disk(cfg, folder, fault, rank)
    except OSError as error:  # a file in the way, read-only, full: a finding, not a crash of the checks
        return {"error": f"{error.strerror or error} ({type(error).__name__})", "dir": str(folder)}
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()


def _probe_disk(cfg: Config, folder, fault: Fault | None, rank: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".doctor-{node_name()}-{os.getpid()}"
    data = os.urandom(DISK_BYTES)
    try:
        started = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if fault is not None and fault.kind == "slow_disk" and fault.applies_to(rank, node_name()):
            time.sleep(fault.factor)
        written = time.perf_counter() - started
        started = time.perf_counter()
        assert probe.read_bytes() == data, f"{probe} read back other bytes than were written"
        read = time.perf_counter() - started
    finally:
        probe.unlink(missing_ok=True)
    checkpoint_bytes = 12 * num_params(cfg.model)  # fp32 weights and AdamW's two moments
    return {
        "write_mbps": DISK_BYTES / written / 1e6,
        "read_mbps": DISK_BYTES / read / 1e6,
        "free_gb": shutil.disk_usage(folder).free / 1e9,
        "checkpoint_gb": checkpoint_bytes / 1e9,
        "save_seconds": checkpoint_bytes / (DISK_BYTES / written),
    }


def examine(cfg: Config, ctx: ParallelContext) -> list[dict]:
    """Every rank's figures, gathered on every rank; speeds measured again while a rank looks slow (every rank
    sees the same gathered figures, so all take part in the same rounds)."""
    fault, local_rank = Fault.from_env(), int(os.environ.get("LOCAL_RANK", "0"))
    dist.barrier()
    left_barrier = time.time()
    mine = {"rank": ctx.rank, "node": node_name(), "clock": left_barrier}
    mine |= compute(ctx, fault) | {"bus_gbps": bus_bandwidth(ctx, fault), "pair_gbps": pairwise(ctx, fault)}
    mine |= {"disk": disk(cfg, local_rank, fault, ctx.rank)}
    speeds = lambda: {"tflops": compute(ctx, fault)["tflops"], "pair_gbps": pairwise(ctx, fault)}  # noqa: E731
    return measured_again(_gather(ctx, mine), lambda: _gather(ctx, speeds()))


def measured_again(everyone: list[dict], measure: Callable[[], list[dict]]) -> list[dict]:
    """While a rank looks slow, up to MEASURE_AGAIN more rounds of every rank's speeds, each keeping its best."""
    for _ in range(MEASURE_AGAIN):
        if not any(slow_ranks(everyone)):
            break
        for r, again in zip(everyone, measure()):
            r["tflops"] = max(r["tflops"], again["tflops"])
            r["pair_gbps"] = {peer: max(gbps, again["pair_gbps"][peer]) for peer, gbps in r["pair_gbps"].items()}
    return everyone


def _gather(ctx: ParallelContext, mine: dict) -> list[dict]:
    everyone: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(everyone, mine)
    return everyone


def slow_ranks(everyone: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """({rank: TFLOP/s} of ranks computing below the slow share of the median, {rank: best GB/s} of ranks whose
    every link is below it): the outliers to measure again, or to name."""
    median = statistics.median(r["tflops"] for r in everyone)
    compute = {r["rank"]: r["tflops"] for r in everyone if r["tflops"] < SLOW * median}
    pairs = [gbps for r in everyone for gbps in r["pair_gbps"].values()]
    links = {}
    if pairs:
        median = statistics.median(pairs)
        best = {r["rank"]: max(r["pair_gbps"].values()) for r in everyone if r["pair_gbps"]}
        links = {rank: gbps for rank, gbps in best.items() if gbps < SLOW * median}
    return compute, links


def findings(everyone: list[dict]) -> tuple[list[str], set[str], bool]:
    """(one line per finding, the nodes to exclude, whether anything besides bad nodes needs a fix)."""
    lines, bad_nodes, other = [], set(), False
    by_rank = {r["rank"]: r for r in everyone}

    def bad(r: dict, what: str) -> None:
        lines.append(f"doctor: rank {r['rank']} (node {r['node']}): {what}")
        bad_nodes.add(r["node"])

    usual = statistics.mode(r["checksum"] for r in everyone)
    for r in everyone:
        if r["checksum"] != usual:
            bad(r, f"matmul result differs from the other ranks' ({r['checksum']} vs {usual}): a faulty device")
        elif r["error"] > MATMUL_TOLERANCE:
            bad(r, f"matmul result is {r['error']:.1e} off an fp64 reference (TF32 stays below 1e-2): a faulty device")
    compute, links = slow_ranks(everyone)
    median = statistics.median(r["tflops"] for r in everyone)
    for rank, tflops in compute.items():
        bad(by_rank[rank], f"matmul at {tflops:.4f} TFLOP/s, the median is {median:.4f}: a slow device")
    if links:
        median = statistics.median(gbps for r in everyone for gbps in r["pair_gbps"].values())
        for rank, gbps in links.items():  # slow with every neighbour: the rank (or its node's link)
            bad(by_rank[rank], f"exchanges at {gbps:.3f} GB/s at best, the median link does {median:.3f}: a slow link")
    for r in everyone:
        if abs(offset := r["clock"] - everyone[0]["clock"]) > CLOCK_SKEW_SECONDS:
            lines.append(f"doctor: rank {r['rank']} (node {r['node']}): clock {offset:+.2f}s off rank 0's: sync it")
            other = True
    for r in (r for r in everyone if r["disk"]):
        d, where = r["disk"], f"doctor: rank {r['rank']} (node {r['node']}): checkpoint.dir"
        if "error" in d:
            lines.append(f"{where} '{d['dir']}' cannot be written: {d['error']}: fix it (or set checkpoint.dir)")
            other = True
            continue
        if d["write_mbps"] < MIN_DISK_MBPS:
            lines.append(
                f"{where} writes at {d['write_mbps']:.1f} MB/s: one checkpoint ({d['checkpoint_gb']:.2f} GB) takes "
                f"~{d['save_seconds']:.0f}s: a slow disk"
            )
            other = True
        if d["free_gb"] < 2 * d["checkpoint_gb"]:
            need = f"two checkpoints need {2 * d['checkpoint_gb']:.2f} GB"
            lines.append(f"{where} has {d['free_gb']:.2f} GB free, {need}: free space or set checkpoint.keep_last")
            other = True
    return lines, bad_nodes, other


def table(everyone: list[dict]) -> str:
    rows = ["rank  node  matmul_tflops  checksum  bus_gbps  pair_gbps  disk_write_mbps  clock_offset_s"]
    start = everyone[0]["clock"]
    for r in everyone:
        bus = " ".join(f"{k}:{v:.3f}" for k, v in r["bus_gbps"].items()) or "-"
        pair = " ".join(f"{k}:{v:.3f}" for k, v in r["pair_gbps"].items()) or "-"
        written = f"{r['disk']['write_mbps']:.0f}" if "write_mbps" in r["disk"] else "-"
        rows.append(
            f"{r['rank']}  {r['node']}  {r['tflops']:.3f}  {r['checksum']}  {bus}  {pair}  {written}  "
            f"{r['clock'] - start:+.3f}"
        )
    return "\n".join(rows)


def preflight(cfg: Config, ctx: ParallelContext, standalone: bool = False) -> None:
    """The checks: findings stop the job before step 1 (exit code 75 with the suspect nodes, or 2). Every rank holds
    every rank's figures, so every rank reaches the same findings and stops alike. Inside a job the suspects go to
    the run dir, for the requeue; standalone (`nanotron doctor`) nothing is written there."""
    everyone = examine(cfg, ctx)
    lines, bad_nodes, other = findings(everyone)
    nodes = {r["node"] for r in everyone}
    every_node = bool(bad_nodes) and bad_nodes == nodes
    if ctx.rank == 0:
        say(table(everyone))
        for line in lines[1:]:
            print(line, file=sys.stderr, flush=True)
        if bad_nodes and not every_node and not standalone:
            write_suspects(cfg.run_dir, bad_nodes)
    if lines:
        more = f" ({len(lines) - 1} more findings above)" if len(lines) > 1 else ""
        suspects = ", ".join(sorted(bad_nodes))
        if every_node:
            raise ConfigError(
                f"{lines[0]}{more}; not requeueing without {suspects}: that is every node of the job (a requeue "
                "could land on no better ones); check the device by hand"
            )
        if bad_nodes:
            raise NodeFaultError(f"{lines[0]}{more}; requeue without node(s) {suspects}", nodes=sorted(bad_nodes))
        raise ConfigError(f"{lines[0]}{more}")
