"""Muon for the decoder layers' hidden matrices, AdamW for everything else, exact at every layout.

The update of a matrix W with gradient G (Keller Jordan's Muon; Moonlight's scaling, arXiv:2502.16982):
    B <- mu B + G;  U = G + mu B (Nesterov) or B;  O = NewtonSchulz(U);  W <- W (1 - lr wd) - lr rms sqrt(max(m, n)) O
Newton-Schulz needs the whole matrix while FSDP, TP and EP hold shards, so each step every rank sends its shards
of the matrices to their owners (one all-to-all over the pipeline stage's ranks: dp x cp x tp), each owner
orthogonalises the whole matrices it owns (owners chosen to balance the FLOPs: the work is spread, no rank does
all of it), and a second all-to-all brings each rank its shards of the updates. Momentum stays sharded like the
parameters (elementwise, on the local shards), so DCP saves and reshards it as it does AdamW's moments.

A logical matrix is what the model multiplies by: q/k/v/o and gate/up/down are separate parameters here
(`models/llama.py`), each one matrix; the experts' stacked [E, 2I, H] gate_up is 2E matrices (each expert's gate
and up halves: fused only for the grouped GEMM, they act on the input separately) and [E, H, I] down is E.
Which parameters: 2-D or stacked matrices inside `model.layers` (the hidden matrices), except names containing one
of `optimizer.muon_adamw_names` (the routers by default). The embedding and head (a lookup and the output
classifier, outside the layers), norms and biases (1-D) go to AdamW.

Cost at 512 GPUs / 70B (tp 8 x FSDP 64; `benchmarks/muon_exchange.py` on the fake process group, and `nanotron
plan`): the busiest owner sends and receives 1.47 GB per step (its fp32 shards of the 560 matrices, 0.53 GB, and the
other ranks' shards of the whole MLP matrix it owns, 0.94 GB): 0.033 s at 45 GB/s; it runs 44 TFLOP of
Newton-Schulz (~0.11 s in bf16, `optimizer.muon_ns_dtype`'s choice on CUDA; up to 2x that in fp32 on TF32): +0.9 %
on a 15.5 s step. The routes are built once at start-up, from every rank's blocks (two lists of ints per parameter
and rank, gathered then); a step touches only this rank's pieces.
"""

from __future__ import annotations

import difflib
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nanotron.config import ModelConfig, OptimizerConfig
from nanotron.errors import ConfigError
from nanotron.models.shapes import all_shapes
from nanotron.parallel.torch_private import local_block

COEFFICIENTS = {"jordan": (3.4445, -4.7750, 2.0315), "cubic": (1.5, -0.5, 0.0)}


def is_muon_matrix(name: str, ndim: int, adamw_names: list[str]) -> bool:
    """The stated rule: hidden matrices (2-D, or stacked experts) of the decoder layers, minus the named ones."""
    return name.startswith("model.layers.") and ndim >= 2 and not any(part in name for part in adamw_names)


def check_adamw_names(cfg: OptimizerConfig, model: ModelConfig) -> None:
    """Under Muon, each `muon_adamw_names` entry must be part of some parameter's name of the whole model (every
    pipeline stage's): a typo would leave its matrices to Muon without a word. The default's routers are absent from
    a dense model: no typo. Checked where the optimizer is built, and by plan and launch before anything is planned."""
    if cfg.name != "muon":
        return
    params = all_shapes(model)
    default = OptimizerConfig().muon_adamw_names
    for entry in cfg.muon_adamw_names:
        if entry in default or any(entry in name for name in params):
            continue
        inner = sorted({name.split(".", 3)[-1] for name in params if name.startswith("model.layers.")})
        close = difflib.get_close_matches(entry, inner, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"the decoder layers' parameters are {', '.join(inner)}"
        raise ConfigError(f"optimizer.muon_adamw_names: {entry!r} is part of no parameter's name; {hint}")


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """X X^T, its square and the product with X, on the shorter side m of an m x n matrix: (4 m^2 n + 2 m^3)
    per iteration."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ns_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`optimizer.muon_ns_dtype`: auto is bf16 on CUDA (tensor cores; Jordan's quintic is built to stay stable in
    bf16) and fp32 elsewhere (CPU bf16 matmuls are slow, and the layout matrix holds fp32 to 1e-5)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[setting]


@torch.no_grad()
def newton_schulz(
    matrix: torch.Tensor, steps: int, coefficients: tuple[float, float, float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthogonal factor's approximation U V^T of matrix = U S V^T (X X^T on the shorter side), iterated and
    returned in `dtype`; the normalisation by the Frobenius norm is done in fp32 first."""
    a, b, c = coefficients
    x = matrix.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = (x / (x.norm() + 1e-7)).to(dtype)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@dataclass(frozen=True)
class Matrix:
    """One logical matrix: rows [start, stop) of param[lead] (all columns), orthogonalised by rank `owner`."""

    param: int
    lead: tuple[int, ...]
    start: int
    stop: int
    cols: int
    owner: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.stop - self.start, self.cols


Block = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, local shape) of a rank's shard


def logical_matrices(name: str, shape: torch.Size) -> list[tuple[tuple[int, ...], int, int]]:
    """(lead index, row start, row stop) of every matrix in a parameter: its own for a 2-D one; for stacked
    experts each expert's, the fused gate_up split into gate and up."""
    if len(shape) == 2:
        return [((), 0, shape[0])]
    halves = 2 if name.endswith("gate_up_proj") else 1
    rows = shape[1] // halves
    return [((e,), h * rows, (h + 1) * rows) for e in range(shape[0]) for h in range(halves)]


def assign_owners(pieces: list[tuple[int, tuple, int, int, int]], ranks: int) -> list[Matrix]:
    """Largest Newton-Schulz cost first to the least-loaded rank (ties: the lowest rank), the same choice on every
    rank; a heap keeps it O(matrices x log ranks) for the planner's searches."""
    cost = [(stop - start) * cols * min(stop - start, cols) for _, _, start, stop, cols in pieces]
    loads = [(0, r) for r in range(ranks)]
    owners = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (-cost[i], i)):
        load, owner = heapq.heappop(loads)
        owners[i] = owner
        heapq.heappush(loads, (load + cost[i], owner))
    return [Matrix(*piece, owner) for piece, owner in zip(pieces, owners)]


def overlap(block: Block, m: Matrix) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where a rank's block meets matrix m: (index into the rank's local tensor, index into the whole matrix)."""
    offset, shape = block
    lead = len(m.lead)
    local: list[slice | int] = []
    for dim, index in enumerate(m.lead):
        if not offset[dim] <= index < offset[dim] + shape[dim]:
            return None
        local.append(index - offset[dim])
    row0, row1 = max(offset[lead], m.start), min(offset[lead] + shape[lead], m.stop)
    col0, col1 = offset[lead + 1], offset[lead + 1] + shape[lead + 1]
    if row0 >= row1 or col0 >= col1:
        return None
    local += [slice(row0 - offset[lead], row1 - offset[lead]), slice(None)]
    return tuple(local), (slice(row0 - m.start, row1 - m.start), slice(col0, col1))


class Plan:
    """Who sends which shard of which matrix to whom, fixed for the run: from the blocks every rank of the stage
    group holds (gathered once at start-up) and the owners, four routes, each in matrix order on both sides of its
    all-to-all. A step then touches only this rank's pieces (no loop over every rank and matrix)."""

    def __init__(
        self,
        names: list[str],
        params: list[torch.Tensor],
        group: dist.ProcessGroup | None,
        blocks: list[list[Block]] | None = None,
    ):
        """`blocks`: every rank's, when known without asking them (a fake process group's rank); else gathered."""
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        mine = [local_block(p) for p in params]
        if blocks is None:
            blocks = [mine]
        if self.size > 1 and len(blocks) == 1:  # at start-up only: two short lists of ints per parameter and rank
            blocks = [None] * self.size
            dist.all_gather_object(blocks, mine, group=group)
        # A block held by several ranks (replicated dims) is sent by the first of them only.
        first: list[dict[Block, int]] = [{} for _ in params]
        for r in range(self.size):
            for i, block in enumerate(blocks[r]):
                first[i].setdefault(block, r)
        pieces = [
            (i, *where, p.shape[-1])
            for i, (n, p) in enumerate(zip(names, params))
            for where in logical_matrices(n, p.shape)
        ]
        self.matrices = assign_owners(pieces, self.size)
        self.owned = [m for m in self.matrices if m.owner == self.rank]
        ranks = range(self.size)
        self.outgoing: list[list] = [[] for _ in ranks]  # by owner: (param, index into my shard)
        self.returning: list[list] = [[] for _ in ranks]  # by owner: (param, index into my shard, elements)
        self.incoming: list[list] = [[] for _ in ranks]  # by sender: (matrix, index into the whole matrix)
        self.back: list[list] = [[] for _ in ranks]  # by receiver: (matrix, index into the whole matrix)
        for m in self.matrices:
            here = overlap(mine[m.param], m)
            if here is not None:
                if first[m.param][mine[m.param]] == self.rank:
                    self.outgoing[m.owner].append((m.param, here[0]))
                self.returning[m.owner].append((m.param, here[0], numel(here[1])))
            if m.owner != self.rank:
                continue
            for r in ranks:
                theirs = overlap(blocks[r][m.param], m)
                if theirs is not None:
                    self.back[r].append((m, theirs[1]))
                    if first[m.param][blocks[r][m.param]] == r:
                        self.incoming[r].append((m, theirs[1]))
        self.incoming_sizes = [sum(numel(index) for _, index in route) for route in self.incoming]
        self.returning_sizes = [sum(n for _, _, n in route) for route in self.returning]


def numel(index: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in index)


class Muon(torch.optim.Optimizer):
    """Muon's groups stepped here, AdamW's by an inner `torch.optim.AdamW` sharing the param groups' dicts and
    the state, so one `state_dict` (and DCP's view of it) holds both."""

    def __init__(
        self,
        muon_groups: list[dict],
        adamw: torch.optim.AdamW,
        names: list[str],
        cfg: OptimizerConfig,
        group: dist.ProcessGroup | None,
    ):
        defaults = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "momentum": cfg.muon_momentum}
        super().__init__([*muon_groups, *adamw.param_groups], defaults)
        self.adamw = adamw
        self.cfg = cfg
        self._link()
        params = [p for g in self.param_groups if g.get("muon") for p in g["params"]]
        self.plan = Plan(names, params, group)
        self.ns_dtype = ns_dtype(cfg.muon_ns_dtype, params[0].device)  # where the matrices, hence the owners, are

    def _link(self) -> None:
        self.adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        muon = [(p, g) for g in self.param_groups if g.get("muon") for p in g["params"]]
        directions = [self._momentum(p) for p, _ in muon]
        updates = self._orthogonalised(directions)
        for (p, g), update in zip(muon, updates):
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - g["lr"] * g["weight_decay"])
            local.add_(update, alpha=-g["lr"])

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the direction to orthogonalise (momentum on the local shards: elementwise)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        grad = torch.zeros_like(local(p)) if p.grad is None else local(p.grad)
        buffer = local(state["momentum_buffer"])
        buffer.mul_(self.cfg.muon_momentum).add_(grad)
        return grad.add(buffer, alpha=self.cfg.muon_momentum) if self.cfg.muon_nesterov else buffer.clone()

    def _orthogonalised(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Shards in, whole matrices to their owners (one all-to-all), Newton-Schulz there, shards of the scaled
        updates back (a second all-to-all)."""
        plan = self.plan
        sends = [[directions[i][index].reshape(-1) for i, index in route] for route in plan.outgoing]
        received = self._exchange(sends, plan.incoming_sizes, directions[0])
        wholes = {m: directions[0].new_zeros(m.shape) for m in plan.owned}
        for route, flat in zip(plan.incoming, received):
            offset = 0
            for m, index in route:
                target = wholes[m][index]
                target.copy_(flat[offset : offset + target.numel()].view_as(target))
                offset += target.numel()
        coefficients = COEFFICIENTS[self.cfg.muon_coefficients]
        results = {}
        for m, whole in wholes.items():
            scale = self.cfg.muon_update_rms * math.sqrt(max(m.shape))
            ortho = newton_schulz(whole, self.cfg.muon_ns_steps, coefficients, self.ns_dtype)
            results[m] = ortho.to(whole.dtype).mul_(scale)
        back = [[results[m][index].reshape(-1) for m, index in route] for route in plan.back]
        returned = self._exchange(back, plan.returning_sizes, directions[0])
        updates = [torch.zeros_like(d) for d in directions]
        for route, flat in zip(plan.returning, returned):
            offset = 0
            for i, index, n in route:
                target = updates[i][index]
                target.copy_(flat[offset : offset + n].view_as(target))
                offset += n
        return updates

    def _exchange(
        self, sends: list[list[torch.Tensor]], recv_sizes: list[int], like: torch.Tensor
    ) -> list[torch.Tensor]:
        """One all-to-all of the concatenated pieces (uneven splits); one process keeps its own. A peer sent
        nothing gets an empty tensor of `like`'s dtype and device."""
        flat = [torch.cat(pieces) if pieces else like.new_zeros(0) for pieces in sends]
        if self.plan.size == 1:
            return flat
        send = torch.cat(flat)
        out = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, send, recv_sizes, [t.numel() for t in flat], group=self.plan.group)
        return list(out.split(recv_sizes))


def build_muon(module: nn.Module, cfg: OptimizerConfig, adamw_groups: dict, make_adamw, group, settings) -> Muon:
    """Splits `adamw_groups` ({settings key: params}) into Muon's and AdamW's by the rule; refuses a rule that
    leaves Muon nothing. `settings(name)`: a Muon matrix's (weight decay, lr_scale), µP's rule for Muon."""
    names = {id(p): n for n, p in module.named_parameters()}
    chosen: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    rest = []
    for key, params in adamw_groups.items():
        others = []
        for p in params:
            if is_muon_matrix(names[id(p)], p.ndim, cfg.muon_adamw_names):
                chosen[(*settings(names[id(p)]), key[-1])].append(p)  # key[-1]: the mesh
            else:
                others.append(p)
        if others:
            rest.append((key, others))
    if not chosen:
        raise ConfigError(
            f"optimizer.name=muon: no parameter goes to Muon (optimizer.muon_adamw_names={cfg.muon_adamw_names} "
            "leaves no decoder-layer matrix); name fewer matrices there, or use optimizer.name=adamw"
        )
    muon_groups = [
        {"params": params, "weight_decay": decay, "lr_scale": lr_scale, "muon": True}
        for (decay, lr_scale, _), params in chosen.items()
    ]
    muon_names = [names[id(p)] for g in muon_groups for p in g["params"]]
    return Muon(muon_groups, make_adamw(rest), muon_names, cfg, group)


def describe(optimizer: Muon, module: nn.Module) -> str:
    """The start-up line: which parameters each optimizer steps (this stage's, on its first rank)."""
    muon = {id(p) for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
    counts: dict[str, int] = defaultdict(int)
    adamw = []
    for name, p in module.named_parameters():
        if id(p) in muon:
            counts["muon"] += p.numel()
        else:
            counts["adamw"] += p.numel()
            adamw.append(name.split(".")[-2] if "." in name else name)
    plan = optimizer.plan
    return (
        f"optimizer: muon on {len(plan.matrices)} matrices of the decoder layers ({counts['muon']:,} parameters; "
        f"q/k/v/o, gate/up/down, each expert's own, fused gate_up split), spread over {plan.size} rank(s); "
        f"adamw on {counts['adamw']:,} parameters ({', '.join(sorted(set(adamw)))}); Newton-Schulz in "
        f"{str(optimizer.ns_dtype).removeprefix('torch.')} (optimizer.muon_ns_dtype={optimizer.cfg.muon_ns_dtype})"
    )
