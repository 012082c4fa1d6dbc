"""The one door to private torch APIs outside checkpointing (`checkpoint/torch_private.py` is the other).

Each entry names what it reaches and why no public API does the job on torch 2.13. A torch upgrade that
moves or changes one of them fails its canary in `tests/test_torch_private.py`, not a run on a cluster.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.pipelining import PipelineStage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

__all__ = [
    "AsyncCollectiveTensor",
    "PortablePipelineStage",
    "attention_with_lse",
    "attention_with_lse_backward",
    "checkpoint_in_place",
    "collective_wait_clock",
    "concatenate_meshes",
    "enable_inductor_async_tp",
    "fake_process_group",
    "flatten_mesh",
    "flattened_meshes",
    "flight_recorder_trace",
    "fsdp_ends_backward",
    "fsdp_param_groups",
    "grouped_mm",
    "in_backward_pass",
    "is_checkpointed",
    "local_block",
    "pipeline_keeps_receive_buffers",
    "pytree_logger",
    "reduce_accumulated_gradients",
    "replicate",
    "scale_in_place",
    "set_group_timeout",
    "shard_block_at",
    "stage_backward",
    "submesh",
    "unflatten_mesh",
]


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """The collective timeout of an existing group: public as `dist.set_timeout` from torch 2.14 (where the private
    setter warns on every rank, once per group); torch 2.11 and 2.13 set it publicly only when a group is created."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


_waited = [0.0]  # seconds the main thread spent blocked on collectives, since the clock was first asked for


def collective_wait_clock() -> Callable[[], float]:
    """A clock of the seconds this process's main thread has spent blocked waiting for collectives: c10d's
    `Work.wait` (plain and FSDP collectives, pipeline sends and receives) and the functional collectives'
    `wait_tensor` (DTensor's). torch has no public hook on a collective's wait (the NCCL completion hook is NCCL's
    alone), so both are wrapped, once per process; other threads' waits (an async save's) are not counted. On CUDA
    a wait only orders streams and returns at once: the host's clock does not see the device's waits there."""
    if not getattr(dist.Work.wait, "_timed", False):
        main = threading.main_thread().ident
        dist.Work.wait = _timed(dist.Work.wait, main)
        funcol.wait_tensor = _timed(funcol.wait_tensor, main)
    return lambda: _waited[0]


def _timed(wait: Callable, main: int | None) -> Callable:
    def timed_wait(*args, **kwargs):
        if threading.get_ident() != main:
            return wait(*args, **kwargs)
        started = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            _waited[0] += time.perf_counter() - started

    timed_wait._timed = True
    return timed_wait


_FLATTENED = "_nanotron_flattened"  # on a root mesh: the meshes flatten_mesh made of its dims, by name


def flatten_mesh(root: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The dims `dims` of `root` as one dimension `name` (HSDP's "dp", dp x cp), kept on `root` for `submesh`:
    torch deprecates slicing a flattened dim from the root mesh (a warning on every rank since 2.11)."""
    flat = root[dims]._flatten(name)
    root.__dict__.setdefault(_FLATTENED, {})[name] = flat
    return flat


def flattened_meshes(root: DeviceMesh) -> list[DeviceMesh]:
    """Every mesh `flatten_mesh` made of `root`'s dims (each has a communicator of its own)."""
    return list(root.__dict__.get(_FLATTENED, {}).values())


def submesh(root: DeviceMesh, *names: str) -> DeviceMesh:
    """`root[names]`, where a name may be a dimension `flatten_mesh` made: that mesh itself, or beside the others
    (HSDP's ("dp_replicate", "dp_shard_cp"))."""
    flattened = root.__dict__.get(_FLATTENED, {})
    if not any(name in flattened for name in names):
        return root[names[0] if len(names) == 1 else names]
    parts = [flattened[name] if name in flattened else root[name] for name in names]
    return parts[0] if len(parts) == 1 else concatenate_meshes(parts)


def local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's shard of a DTensor (the whole tensor for a plain one): DCP's own
    rule (`compute_local_shape_and_global_offset`, in the private `_utils`), FSDP's strided shards under TP
    included. Muon assembles whole matrices from these blocks."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.ndim, tuple(tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def shard_block_at(tensor: torch.Tensor, coordinate: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`local_block` of the rank at `coordinate` of the DTensor's mesh (torch's coordinate-taking twin of DCP's
    rule): one process can route every rank's shards (`benchmarks/muon_exchange.py` on the fake process group)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh_shape = tensor.device_mesh.shape
    shape, offset = _compute_local_shape_and_global_offset(tensor.shape, mesh_shape, coordinate, tensor.placements)
    return tuple(offset), tuple(shape)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A 1-D `mesh` (e.g. the flattened dp x cp) split into named dims of its root mesh (expert parallelism's
    ("edp", "ep")); FSDP can then combine a parameter's ep sharding with its own over edp."""
    return mesh._unflatten(0, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Dims of one root mesh side by side as one mesh (HSDP's ("dp_replicate", "edp") for expert weights);
    FSDP does the same with a parameter's own DTensor mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One GEMM over groups of rows, each with its own [in, out] matrix (`offsets`: cumulative row ends, int32):
    torch's grouped GEMM (CUDA, bf16), the MoE experts' kernel; no public API on torch 2.13."""
    return torch._grouped_mm(x, weight, offs=offsets)


def replicate(module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """DDP semantics on FSDP2's machinery (the same mixed precision and hooks as `fully_shard`)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

    fsdp_replicate(module, mesh=mesh, mp_policy=mp_policy)


def checkpoint_in_place(module: nn.Module, context_fn: Callable | None = None) -> None:
    """Activation checkpointing that keeps parameter names (unlike the public `checkpoint_wrapper`).

    Full (no `context_fn`): torch's composable checkpoint, forward hooks; compiled, the module still keeps its input
    only. Selective (`context_fn`: torch.utils.checkpoint's, e.g. `create_selective_checkpoint_contexts`): the
    module's forward runs inside `torch.utils.checkpoint.checkpoint`, which torch.compile traces as one region and
    applies the policy to; under the composable hooks a compiled module's ops never reach the policy (torch 2.13:
    everything was rerun; 2.11: the module ran uncompiled)."""
    if context_fn is None:
        from torch.distributed._composable import checkpoint

        checkpoint(module)
        return
    # A partial over the bound forward, not a closure: a deep copy of the module (a bound method copies to one bound
    # to the copy) then recomputes with the copy's weights, not the original's.
    module.forward = functools.partial(_checkpointed, module.forward, context_fn)
    module.forward.checkpointed = True


def _checkpointed(forward: Callable, context_fn: Callable, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint_in_place` made `module` recompute its activations."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module) is not None or hasattr(module.__dict__.get("forward"), "checkpointed")


def reduced_output_ops() -> tuple:
    """The functional collectives whose outputs a tensor-parallel layer reduces its row-parallel matmuls into
    (sequence-parallel reduce-scatter, all-reduce): ops selective recompute keeps rather than reruns."""
    ops = torch.ops._c10d_functional
    return ops.reduce_scatter_tensor.default, ops.all_reduce.default


def enable_inductor_async_tp() -> None:
    """Inductor's micro-pipelined TP pass (async TP). Symmetric memory needs no set-up any more (torch deprecated
    `enable_symm_mem_for_group`: "there is no need to call this function anymore")."""
    from torch._inductor import config as inductor_config

    inductor_config._micro_pipeline_tp = True


def in_backward_pass() -> bool:
    """Whether autograd is executing a graph now: a forward run inside backward is a recomputation."""
    return torch._C._current_graph_task_id() != -1


def reduce_accumulated_gradients(module: FSDPModule, reshard: bool) -> None:
    """Reduce-scatters the gradients `module` accumulated unsharded, now (outside autograd's hooks).

    What torch's pipeline stage does once per step (`perform_reduce_grad`) minus the gradient scaling, for a
    split backward whose weight part ends outside FSDP's post-backward hooks.
    """
    from torch.distributed.fsdp import fully_shard

    module.set_requires_gradient_sync(True)
    module.set_reshard_after_backward(reshard)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in fsdp_param_groups(each):
            group.post_backward()
    if hasattr(state._state_ctx, "manual_backward_finalization_active"):  # torch 2.15: the callback asks which mode
        state._state_ctx.manual_backward_finalization_active = False  # the backward ran in (set when it was queued)
    state._root_post_backward_final_callback()


@contextmanager
def fsdp_ends_backward(module: FSDPModule) -> Iterator[None]:
    """A backward whose end FSDP's final callback handles, as before torch 2.15: it reduces the groups its hooks
    did not reach (the root's embedding) and ends the iteration inside backward. From 2.15 on a pipeline stage's
    forward turns on manual finalization (one reduction at the step's end), under which ZeRO-2/3's per-microbatch
    reductions left the root's unsharded gradients and the reduce-scatters' buffers alive across microbatches."""
    from torch.distributed.fsdp import fully_shard

    manual = getattr(fully_shard.state(module)._state_ctx, "manual_backward_finalization", False)
    if manual:
        module.set_manual_backward_finalization(False)
    try:
        yield
    finally:
        if manual:  # the stage's step-end reduction (`finalize_backward`) asks for it
            module.set_manual_backward_finalization(True)


def pipeline_keeps_receive_buffers() -> bool:
    """Whether torch's pipeline stage allocates every microbatch's receive buffers up front and keeps them across
    steps (torch 2.11-2.14). From 2.15 on (`pipelining._recv_buffers`) a receive allocates its buffer and hands it
    to the computation, which frees it with the microbatch's activations."""
    return importlib.util.find_spec("torch.distributed.pipelining._recv_buffers") is None


def fsdp_param_groups(state) -> list:
    """An FSDP state's parameter groups: a list since torch 2.13, at most one group (or None) on 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


# torch 2.11's PipelineStage (2.13 rewrote these parts): it decides once, when the first schedule call builds its
# receive buffers, whether they require grad; it checks every stage's outputs against the static shapes at every
# forward (2.13: only at TORCH_DISTRIBUTED_DEBUG=DETAIL); its first call's warm-up exchange sends to every
# neighbour stage, on this rank too.
_STAGE_OF_TORCH_2_11 = hasattr(PipelineStage, "_validate_fwd_outputs")


class PortablePipelineStage(PipelineStage):
    """torch's PipelineStage, run alike on torch 2.11 and 2.13 (on 2.13 it is PipelineStage unchanged)."""

    if _STAGE_OF_TORCH_2_11:

        def _prepare_forward_infra(self, *args, **kwargs):
            """Every activation buffer requires grad: torch 2.11 sets that only when the call that builds them has
            a backward, and the first call may be an evaluation (the one before step 1). Under evaluation's
            no_grad that records nothing."""
            built = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                for info in infos:
                    buffer = getattr(info, "buffer", None)  # stage 0's placeholders for the root inputs have none
                    if isinstance(buffer, torch.Tensor):
                        buffer.requires_grad_(True)
            return built

        def _get_init_p2p_neighbors_ops(self) -> list:
            """The warm-up exchange without the neighbours on this rank (a V schedule's adjacent stages): gloo
            cannot send to its own rank."""
            me = dist.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

        def _validate_fwd_outputs(self, outputs: tuple) -> None:
            """Only the outputs sent to a peer are checked: the last stage's go to the loss, and in evaluation a
            model with multi-token prediction returns its main logits alone."""
            if not self.is_last:
                super()._validate_fwd_outputs(outputs)


def scale_in_place(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiplies every tensor by the 0-dim `factor` in place, in one foreach kernel per device and dtype (what
    torch's clip_grads_with_norm_ runs; public torch has no foreach op)."""
    torch._foreach_mul_(tensors, factor)


def stage_backward(stage_output, output_grads, input_values) -> list[torch.Tensor | None]:
    """A pipeline stage's full backward, returning its input gradients (the step torch's stage runs itself)."""
    from torch.distributed.pipelining._backward import stage_backward as backward

    return backward(stage_output, output_grads, input_values)


def flight_recorder_trace() -> dict:
    """torch's flight recorders (the last collectives of every process group) as one trace: "entries" and
    "pg_status". gloo's groups record into one recorder (`_dump_fr_trace`), NCCL's into another that only a CUDA
    build has (`_dump_nccl_trace`); a GPU run's collectives are all in the second."""
    c10d = torch._C._distributed_c10d
    dumps = [c10d._dump_fr_trace(includeStackTraces=False)]
    if hasattr(c10d, "_dump_nccl_trace"):
        dumps.append(c10d._dump_nccl_trace(includeStackTraces=False))
    return merge_traces([pickle.loads(dump) for dump in dumps])


def merge_traces(traces: list[dict]) -> dict:
    """One flight-recorder trace of several recorders' (their entries, and each group's status)."""
    return {
        "entries": [entry for trace in traces for entry in trace.get("entries", [])],
        "pg_status": {name: status for trace in traces for name, status in trace.get("pg_status", {}).items()},
    }


def fake_process_group(rank: int, world_size: int) -> None:
    """A process group that plays `rank` of `world_size` without peers (collectives are no-ops), so one process
    can build any rank of any layout (`nanotron plan --check`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def attention_with_lse(q, k, v, causal: bool, mask, scale: float, kernel: str = "cpu_flash"):
    """Fused attention that also returns the log-sum-exp of each query row, [batch, heads, q] in fp32 (context
    parallelism merges blocks with it); public SDPA returns only the output. `mask` is additive in q's dtype (or
    None); `kernel` (see `context.choose_block_kernel`):
    - "cpu_flash": the CPU kernel, any float dtype, masks too;
    - "flash": CUDA FlashAttention-2 (sm80+, bf16/fp16, head dim <= 256, no mask);
    - "efficient": CUDA memory-efficient attention (bf16/fp16/fp32, additive mask; its log-sum-exp comes padded
      to a multiple of 32 rows, cut here).
    Rows with every key masked come back with an undefined output and log-sum-exp (zeros and 0 on CPU): callers
    must fix those."""
    if kernel == "cpu_flash":
        aten = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return aten(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    if kernel == "efficient":
        aten = torch.ops.aten._scaled_dot_product_efficient_attention
        out, lse, _, _ = aten(q, k, v, mask, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]]
    raise ValueError(f"no fused attention kernel {kernel!r}")


def attention_with_lse_backward(dout, q, k, v, out, lse, causal: bool, mask, scale: float, kernel: str = "cpu_flash"):
    """The gradients (dq, dk, dv) of `attention_with_lse` given the *final* output and log-sum-exp of each row
    (a block's share of the full attention's gradient when those come from the merged result). Dropout is off, so
    the kernels' random-state arguments are placeholders they never read."""
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    seeds = dict(dtype=torch.uint64 if kernel == "flash" else torch.int64, device=q.device)
    if kernel == "flash":
        rows = q.shape[2]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, rows, k.shape[2], 0.0, causal,
            torch.empty(2, **seeds), torch.empty((), **seeds), scale=scale,
        )  # fmt: skip
    if kernel == "efficient":  # the kernel reads the log-sum-exp with its forward's padded row stride
        padded = lse.new_zeros(*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32)
        padded[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, mask, out, padded, torch.empty((), **seeds), torch.empty((), **seeds), 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    raise ValueError(f"no fused attention kernel {kernel!r}")


def pytree_logger() -> logging.Logger:
    """torch.utils._pytree's logger: torchao's import registers enums with pytree, which logs a deprecation warning
    on every rank (torch 2.13; 2.11 neither warns nor has the module attribute); the float8 import quiets it (no
    public switch for one module's log)."""
    return logging.getLogger("torch.utils._pytree")
