"""Expert parallelism and the MoE bookkeeping that needs a process group.

Expert parallelism (`parallelism.ep`) splits each MoE layer's experts over an `ep` group carved out of the data-
parallel ranks: dp x cp unflattened into ("edp", "ep"), ep innermost (neighbouring ranks, a node's fast links
first). It adds no ranks: each rank still routes its own tokens. A layer's (token, choice) pairs, already grouped by
expert, go to the ranks that own their experts with one all-to-all (uneven splits, learnt from an all-to-all of the
per-expert counts first: dropless routing has no fixed sizes), are regrouped by local expert, run, and go home with
a second all-to-all; backward does the same in reverse. The expert weights are DTensors sharded over "ep" on the
expert dimension, and FSDP shards them further over "edp" (the hidden dimension) — so a checkpoint holds the full
[num_experts, ...] tensors and resumes at any ep. Their gradients sum over the ep group's tokens (the all-to-all's
backward) and over "edp" (FSDP), divided by dp x cp like every other gradient.

Cost at scale (DeepSeek-V3-like: 61 layers, 256 experts, top-8, 7168 hidden, 4k tokens per rank in bf16): per layer
and microbatch, the token all-to-all moves top_k x tokens x hidden x 2 bytes each way (~470 MB per rank forward,
the same back and twice again in backward) and the counts all-to-all 8 bytes x num_experts; it needs the counts on
the host (one device sync per layer and microbatch, one read of the send and receive sizes together). Kept:
all_to_all_single takes its split sizes as host integers, and dropless routing has no fixed sizes; removing it would
take a device-initiated all-to-all (NVSHMEM, DeepEP-style kernels: not a public torch API on 2.13) or fixed-capacity
buffers (dropped tokens, or worst-case padding of E x tokens: at the shape above 256 x 4k rows of 7168 bf16, 15 GB,
against ~470 MB). Its cost: the host waits for the GPU to reach the counts all-to-all (the queue drains once per
layer), then launches the rest; tens of microseconds against the ~10 ms token all-to-all over InfiniBand, the same
at 512 GPUs as at 16 (constant in the world size). Without expert parallelism the grouped GEMM path has no host sync
at all (`padded_grouped_mlp` sizes its buffer from row counts the host knows; the counts come from scatter_add, not
bincount, which reads its largest id back on CUDA); `capacity_factor` adds one (the kept count sizes the rows).

With shared experts, `parallelism.ep_overlap` hides the token all-to-all behind them: it starts asynchronously, the
shared experts run, then it is waited for; in backward the reverse exchange runs under their backward (no extra
communication, memory or sync: the same operations, waited for later). At the shape above on H100s (the planner's
figures, `benchmarks/moe_overlap.py`): the shared expert's forward is ~0.9 ms and its backward ~1.8 ms against
~1.1 ms per all-to-all inside a node (ep 8: mostly hidden) or ~10 ms across nodes (ep 64: ~2.7 ms of ~41 ms per
layer hidden; DeepSeek hides the rest with DualPipe, across microbatches).

`ExpertBalance` moves each router's bias (auxiliary-loss-free balancing) from the step's global load, one all-
reduce of num_layers x num_experts counts over dp x cp per step on the device (61 x 256 floats: 62 KB, latency-
bound, no host sync), and gathers the MoE metrics on logging steps (one more all-reduce, then a host read).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nanotron.config import Config
from nanotron.models.llama import decoder_layers
from nanotron.models.moe import MoE, expert_mlp
from nanotron.parallel.mesh import ParallelContext
from nanotron.parallel.torch_private import grouped_mm
from nanotron.step_end import StepInfo, StepReport


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatch(nn.Module):
    """Sends tokens grouped by (global) expert to the ep ranks owning those experts and brings the outputs back in
    the same order. Rank r of the ep group owns experts [r x E/ep, (r + 1) x E/ep).

    With `overlap`, `during` (the shared experts) runs while the tokens travel: the token all-to-all starts
    asynchronously, `during` runs, then the dispatch waits; in backward the reverse exchange of the tokens'
    gradients likewise runs under `during`'s backward (see `_Started`). Without it, `during` is left to the caller.
    The same operations on the same values either way: only when the host waits changes."""

    def __init__(self, group: dist.ProcessGroup, ep: int, overlap: bool = True):
        super().__init__()
        self.group, self.ep, self.overlap = group, ep, overlap

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, experts: nn.Module, during: Callable[[], torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        local = counts.numel() // self.ep
        received = torch.empty_like(counts)  # [source rank x local expert]: what each peer sends each of mine
        dist.all_to_all_single(received, counts, group=self.group)
        # The layer's one host sync (per microbatch, and again if recomputed): all_to_all_single takes its split
        # sizes as host integers, and dropless routing has no fixed sizes (see the module's docstring).
        send, recv = torch.stack([counts, received]).view(2, self.ep, local).sum(dim=2).tolist()
        by_source = received.view(self.ep, local)
        # Rows arrive grouped by source, then expert: regroup by local expert (stable: sources stay in order).
        expert_of = torch.arange(local, device=x.device).repeat(self.ep)
        order = expert_of.repeat_interleave(received, output_size=sum(recv)).argsort(stable=True)
        if self.overlap and during is not None:
            tokens, done = _exchange_during(x, recv, send, self.group, during)
        else:
            tokens, done = _AllToAll.apply(x, recv, send, self.group), None
        tokens = _ScaleGradient.apply(tokens, self.ep)
        out = _ScaleGradient.apply(experts(tokens[order], by_source.sum(dim=0)), 1.0 / self.ep)
        return _AllToAll.apply(out[order.argsort()], send, recv, self.group), done


def _exchange_during(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, during):
    """`_AllToAll.apply(x, ...)` with `during()` computed while the rows travel, forward and backward; returns
    both. The autograd engine runs ready nodes latest-created first, so creating `during`'s nodes between
    `_WaitForGradient` and `_Started` puts its backward between the reverse exchange's start and its wait."""
    pending = _InFlight()
    x = _WaitForGradient.apply(x, pending)
    received = x.new_empty(sum(out_splits), *x.shape[1:])
    send = x.contiguous()
    pending.start(received, send, out_splits, in_splits, group)
    done = during()
    return _Started.apply(x, pending, (out_splits, in_splits), group), done


class _InFlight:
    """One asynchronous all_to_all_single: its output and the work to wait for (the tensors it reads and writes
    are held until then)."""

    def __init__(self):
        self.work, self.tensors = None, ()

    def start(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
        self.tensors = (out, x)
        self.work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        out, self.work, self.tensors = self.tensors[0], None, ()
        return out


class _Started(torch.autograd.Function):
    """Forward: waits for the all-to-all `pending` started on `x` and returns what it received. Backward: starts
    the reverse exchange of the gradient into `pending` and returns its output buffer, unread until
    `_WaitForGradient` (nearer the input) waits for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: _InFlight, splits: tuple[list[int], list[int]], group) -> torch.Tensor:
        ctx.pending, ctx.splits, ctx.group = pending, splits, group
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        ctx.pending.start(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


class _WaitForGradient(torch.autograd.Function):
    """Identity forward; backward waits for the exchange `_Started.backward` began and passes its result on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: _InFlight) -> torch.Tensor:
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.pending.wait(), None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`.

    An expert's weight gradient sums the gradients of every ep rank's tokens, each rank's loss being its own
    mean: ep times the share a data-parallel rank's gradient should carry, before FSDP averages over edp. The
    gradient entering the experts' outputs is divided by ep (so the weight gradient is), and multiplied back on
    leaving their inputs (so the tokens' gradients are unchanged; exact for ep a power of two)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def local_expert_mlp(x: torch.Tensor, counts: torch.Tensor, gate_up, down) -> torch.Tensor:
    """The per-expert loop on this rank's experts: an ep-sharded weight's local part (its own experts)."""
    return expert_mlp(x, counts, _local(gate_up), _local(down))


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


# torch's grouped GEMM wants 16-byte aligned rows and columns (torch/_meta_registrations.py, `_grouped_mm`'s stride
# checks): bf16 widths that are multiples of 8. Each expert's group of rows is padded to a multiple of 8 too, so
# every group starts 16-byte aligned, as torchtitan pads its token groups for bf16.
GROUP_ALIGNMENT = 8


def choose_expert_kernel(device_type: str, dtype: torch.dtype, hidden: int, intermediate: int) -> str:
    """ "grouped" (torch's grouped GEMM over padded groups: CUDA, bf16, widths multiples of 8) or "loop" (one matmul
    per expert, the reference; CPU trains with it: the grouped GEMM runs there but is not the fast path)."""
    aligned = hidden % GROUP_ALIGNMENT == 0 and intermediate % GROUP_ALIGNMENT == 0
    return "grouped" if device_type == "cuda" and dtype == torch.bfloat16 and aligned else "loop"


def grouped_expert_mlp(x: torch.Tensor, counts: torch.Tensor, gate_up, down) -> torch.Tensor:
    """`expert_mlp` with the grouped GEMM where `choose_expert_kernel` says so, else the loop (same numbers)."""
    gate_up, down = _local(gate_up), _local(down)
    if choose_expert_kernel(x.device.type, x.dtype, x.shape[-1], down.shape[-1]) == "loop":
        return expert_mlp(x, counts, gate_up, down)
    return padded_grouped_mlp(x, counts, gate_up, down)


def padded_grouped_mlp(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
    """Both expert GEMMs as grouped GEMMs over one padded copy of the rows, with no host sync: each expert's group
    is padded with zero rows to a multiple of GROUP_ALIGNMENT, in a buffer of rows + E x (GROUP_ALIGNMENT - 1)
    rows (a size the host knows without reading `counts`), the slack going to the last expert so that no row of
    the buffer is outside a group. Zero rows stay zero through SwiGLU and the GEMMs, and only the real rows are
    read back. Cost per layer and microbatch, at DeepSeek-V3's shape (4k tokens x top 8 x 7168 per rank, bf16): the
    zeroed buffer, the copy in and the copy out, ~1.4 GB of memory traffic (~0.5 ms at ~3 TB/s) against ~2.9 TFLOP
    of forward expert GEMMs (~5 ms at ~600 TFLOP/s), about 10%, plus E x 7 zero rows; constant in the world size.
    `benchmarks/moe.py`'s kernel check measures it against unpadded offsets where the kernel takes those."""
    experts, rows = counts.numel(), x.shape[0]
    total = rows + experts * (GROUP_ALIGNMENT - 1)
    padded = (counts + GROUP_ALIGNMENT - 1) // GROUP_ALIGNMENT * GROUP_ALIGNMENT
    padded[-1] += total - padded.sum()
    # Row i (of expert e) goes to e's padded start + its rank within e's group.
    ends = counts.cumsum(0)
    expert = torch.searchsorted(ends, torch.arange(rows, device=x.device), right=True)
    position = (padded.cumsum(0) - padded - ends + counts)[expert] + torch.arange(rows, device=x.device)
    buffer = x.new_zeros(total, x.shape[-1]).index_copy(0, position, x)
    return expert_mlp(buffer, padded, gate_up, down, aligned_grouped_matmul)[position]


def aligned_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`loop_matmul` as one grouped GEMM, for groups that already start aligned and cover every row of `x`."""
    return grouped_mm(x, weight, counts.cumsum(0).to(torch.int32))


def use_grouped_gemm(module: nn.Module) -> None:
    for moe in expert_layers(module):
        moe.experts.mlp = grouped_expert_mlp


def expert_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh, overlap: bool = True) -> None:
    """Shards every MoE layer's experts over `ep_mesh` (the expert dim) and routes its tokens by all-to-all, with
    the shared experts computed while the tokens travel if `overlap` (`parallelism.ep_overlap`)."""
    ep = ep_mesh.size()
    for moe in expert_layers(module):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded))
        experts.mlp = local_expert_mlp
        moe.dispatcher = AllToAllDispatch(ep_mesh.get_group(), ep, overlap)


def expert_shard_dim(param: nn.Parameter) -> Shard:
    """FSDP's shard of an expert weight: dim 1 (its hidden or 2 x intermediate rows), since ep already splits
    dim 0 and FSDP needs even splits on any other dim."""
    return Shard(1)


class ExpertBalance:
    """Per step: the routers' bias update from the global load (auxiliary-loss-free balancing) and, on logging
    steps, the MoE metrics; both read and then clear the layers' per-step counters."""

    def __init__(self, cfg: Config, modules: list[nn.Module], ctx: ParallelContext):
        # by global layer index; an MTP module's block is layer num_layers + k (DeepSeek-V3's checkpoint numbering)
        self.layers = sorted(
            (
                (index, layer.mlp)
                for module in modules
                for index, layer in decoder_layers(module)
                if isinstance(layer.mlp, MoE)
            ),
            key=lambda item: item[0],
        )
        moe, p = cfg.model.moe, cfg.parallelism
        self.rate = moe.bias_update_rate
        self.device = ctx.device
        self.group = ctx.loss_group()  # the ranks that route distinct tokens
        self.num_layers = cfg.model.num_layers + cfg.model.mtp_depth
        self.num_experts = moe.num_experts
        self.tp = p.tp
        self.dp_cp = p.dp * p.cp
        self.microbatches = cfg.training.grad_accum_steps

    @torch.no_grad()
    def step_end(self, info: StepInfo) -> StepReport | None:
        """After the optimizer step: moves the biases (if the step was applied) and reports the metrics on
        logging steps (a collective over the world: every rank calls it with the same `info`)."""
        if not self.num_experts:
            return None
        loads = torch.stack([m.tokens_per_expert for _, m in self.layers]) if self.layers else None
        if self.rate and info.applied and loads is not None:
            total = loads.clone()
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            for (_, m), load in zip(self.layers, total):
                m.gate.expert_bias += self.rate * torch.sign(load.mean() - load)
        metrics = self._metrics(loads) if info.logging else None
        self.reset()
        return StepReport([({"step": info.step} | metrics, None)]) if metrics is not None else None

    def reset(self) -> None:
        """Forgets the step's counts: after it ends, or before it is recomputed or rolled back."""
        for _, m in self.layers:
            m.tokens_per_expert.zero_()
            m.dropped_tokens.zero_()
            m.aux_loss.zero_()

    def _metrics(self, loads: torch.Tensor | None) -> dict[str, float]:
        """Per MoE layer: max/mean tokens per expert over the step, the balance loss, the routing bias norm and
        the dropped share, summed over the world (each tp rank routes the same tokens: counted once)."""
        e = self.num_experts
        table = torch.zeros(self.num_layers, e + 4, dtype=torch.float64, device=self.device)
        for (index, m), load in zip(self.layers, loads if loads is not None else []):
            table[index, :e] = load / self.tp
            table[index, e] = m.aux_loss / (self.tp * self.dp_cp * self.microbatches)
            table[index, e + 1] = m.gate.expert_bias.norm() / (self.tp * self.dp_cp)
            table[index, e + 2] = m.dropped_tokens / self.tp
            table[index, e + 3] = 1.0 / (self.tp * self.dp_cp)  # this layer's presence: 1 once summed
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        out = {}
        for index, row in enumerate(table.cpu().tolist()):
            if row[e + 3] < 0.5:
                continue  # a dense layer
            load, routed = row[:e], sum(row[:e])
            mean = routed / e
            out[f"moe/layers.{index}.load_max_over_mean"] = max(load) / mean if mean else 0.0
            out[f"moe/layers.{index}.aux_loss"] = row[e]
            out[f"moe/layers.{index}.bias_norm"] = row[e + 1]
            out[f"moe/layers.{index}.dropped_fraction"] = row[e + 2] / (routed + row[e + 2]) if routed else 0.0
        if out:
            ratios = [v for k, v in out.items() if k.endswith("load_max_over_mean")]
            out["moe/load_max_over_mean"] = max(ratios)
        return out
