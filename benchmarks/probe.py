"""What one rank really holds during a training step, measured on any device (CPU included).

- gradient bytes held: the local gradient shards plus every unsharded gradient FSDP keeps between
  backward passes (its accumulation buffers), sampled after each microbatch's backward;
- activation bytes: the storages autograd saves for backward (parameters and buffers excluded, each
  storage once), plus what activation checkpointing keeps instead: each recomputed layer's input, and
  under selective recompute the outputs its policy keeps (reported by the policy); inside the blocks whose
  gathered sequence-parallel input is kept as a shard, what those hooks keep (they report it),
  counted from the moment they are saved until they are freed; the peak over the step is what the
  pipeline's in-flight microbatches really cost;
- working-copy bytes: the unsharded (gathered, bf16 under mixed precision) parameters FSDP holds,
  sampled at the same moments as gradients and before and after each FSDP module's forward.

CPU has no allocator statistics, so these are counted from the tensors themselves; the same counters
run on GPU, where they can be checked against `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from nanotron.parallel import recompute as recompute_policy
from nanotron.parallel import regather
from nanotron.parallel.fsdp import ZeroPipelineStage
from nanotron.parallel.regather import local_tensor as local
from nanotron.parallel.torch_private import fsdp_param_groups, in_backward_pass


def nbytes(tensor: torch.Tensor) -> int:
    t = local(tensor)
    return t.numel() * t.element_size()


def storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor; a wrapper subclass (DTensor) is unwrapped without running an op, which
    a saved-tensor hook must not do."""
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    else:
        yield tensor.untyped_storage()


def fsdp_params(modules: list[nn.Module]) -> Iterator[object]:
    """FSDP's per-parameter records (torch internals: fully_shard and replicate keep them alike)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                for group in fsdp_param_groups(sub._get_fsdp_state()):
                    yield from group.fsdp_params


def held_gradient_bytes(modules: list[nn.Module]) -> int:
    """Gradient shards plus FSDP's unsharded gradients (accumulated across microbatches or not yet reduced).

    Read from FSDP's records, not `module.parameters()`: while parameters are gathered the module holds the
    unsharded ones, and the shards' gradients are then reachable only through the records."""
    storages: dict[int, int] = {}

    def add(grad: torch.Tensor | None) -> None:
        if grad is not None:
            storage = local(grad).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for module in modules:
        for param in module.parameters():
            add(param.grad)
    for record in fsdp_params(modules):
        unsharded = getattr(record, "_unsharded_param", None)
        add(record.sharded_param.grad)
        add(record.unsharded_accumulated_grad)
        add(None if unsharded is None else unsharded.grad)
    return sum(storages.values())


def working_copy_bytes(modules: list[nn.Module]) -> int:
    """Bytes of unsharded parameter storage FSDP has allocated (zero while resharded)."""
    total, seen = 0, set()
    for record in fsdp_params(modules):
        unsharded = getattr(record, "_unsharded_param", None)
        if unsharded is None:
            continue
        storage = local(unsharded).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class StepProbe:
    """Peaks of held gradients, saved activations and working copies over the steps run inside `active()`.
    `recompute(layer index)`: the layer's parallelism.recompute mode."""

    def __init__(self, modules: list[nn.Module], recompute=lambda layer: "none"):
        self.modules, self.recompute = modules, recompute
        self.grad_peak = self.activation_peak = self.working_peak = 0
        self.live: dict[int, int] = {}  # storage data_ptr -> bytes, for saved activations still alive
        self.excluded: set[int] = set()  # the running module's parameter and buffer storages
        self.handles: list = []

    # ---- activations ----------------------------------------------------------------------------

    def _remember_weights(self, module: nn.Module, *_: object) -> None:
        """The weights the module about to run may save. Runs after FSDP's pre-forward (hooks run in
        registration order), so gathered params are in place; reset per module because FSDP frees gathered
        copies and their addresses are reused by activations."""
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        self.excluded = {storage.data_ptr() for t in tensors for storage in storages(t)}

    def _track(self, tensor: torch.Tensor) -> None:
        for storage in storages(tensor):
            key = storage.data_ptr()
            if key in self.excluded or key in self.live or not storage.nbytes():
                continue
            self.live[key] = storage.nbytes()
            weakref.finalize(storage, self.live.pop, key, None)
        self.activation_peak = max(self.activation_peak, sum(self.live.values()))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter):
            self._track(tensor)
        return tensor

    def _checkpointed_input(self, module: nn.Module, args: tuple) -> None:
        """Activation checkpointing keeps each layer's input for the recompute in backward."""
        self._track(args[0])

    def _selective_input(self, module: nn.Module, args: tuple) -> None:
        """Selective recompute keeps the layer's input too (not again in its recompute)."""
        if not in_backward_pass():
            self._track(args[0])

    def _kept(self, output: object) -> None:
        """An output the selective policy keeps (`recompute.on_keep`)."""
        for tensor in output if isinstance(output, tuple | list) else (output,):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)

    # ---- gradients and working copies -------------------------------------------------------------

    def sample(self) -> None:
        self.grad_peak = max(self.grad_peak, held_gradient_bytes(self.modules))
        self.working_peak = max(self.working_peak, working_copy_bytes(self.modules))

    def _after(self, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.sample()
            return result

        return wrapped

    @contextlib.contextmanager
    def active(self) -> Iterator[StepProbe]:
        """Hooks every module and samples after every backward: `torch.autograd.backward` (plain, and a pipeline
        stage's full backward) and each pipeline stage's backward part, which for a split (zero-bubble) backward
        ends after its weight gradients are reduced."""
        for module in self.modules:
            for sub in module.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    self.handles.append(sub.register_forward_pre_hook(self._remember_weights))
                if isinstance(sub, FSDPModule):  # after FSDP's own pre-forward: this layer (and a prefetch) gathered
                    self.handles.append(sub.register_forward_pre_hook(lambda *_: self.sample()))
            for name, layer in module.model.layers.items():
                if self.recompute(int(name)) == "full":
                    self.handles.append(layer.register_forward_pre_hook(self._checkpointed_input))
                elif self.recompute(int(name)) == "selective":
                    self.handles.append(layer.register_forward_pre_hook(self._selective_input))
            self.handles.append(module.register_forward_hook(lambda *_: self.sample()))
        saved_backward, saved_stage_backward = torch.autograd.backward, ZeroPipelineStage.backward_maybe_with_nosync
        torch.autograd.backward = self._after(saved_backward)
        ZeroPipelineStage.backward_maybe_with_nosync = self._after(saved_stage_backward)
        selective = any(self.recompute(int(name)) == "selective" for m in self.modules for name in m.model.layers)
        if selective and not recompute_policy.POLICY_SEES_OUTPUTS:
            raise RuntimeError(
                f"measuring selective recompute needs torch >= 2.13: torch {torch.__version__}'s checkpoint policy "
                "is not shown the outputs it keeps"
            )
        recompute_policy.on_keep.append(self._kept)
        regather.on_save.append(self._pack)  # inside attention/MLP blocks under SP its hooks replace this one's
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            recompute_policy.on_keep.remove(self._kept)
            regather.on_save.remove(self._pack)
            torch.autograd.backward, ZeroPipelineStage.backward_maybe_with_nosync = saved_backward, saved_stage_backward
            for handle in self.handles:
                handle.remove()
            self.handles.clear()


def pipeline_buffer_bytes(schedule: object | None) -> int:
    """The receive buffers torch's pipeline stages allocated on this rank (activations from the previous stage and
    gradients from the next, one per microbatch), after a step has run."""
    if schedule is None:
        return 0
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    total = 0
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            total += sum(nbytes(i.buffer) for i in infos if torch.is_tensor(getattr(i, "buffer", None)))
    return total
