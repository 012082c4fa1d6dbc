"""Activation statistics: the mean |x| (L1 norm per element) of the embedding output, each layer's attention
output, MLP (or mixture-of-experts) output, router scores (MoE layers) and residual stream (the layer's output),
the final norm and the logits, as `act/*` metrics.

They show whether activations keep their scale as a model grows (µP's coordinate check) or drift during
training. On a stats step (`logging.activation_stats_interval`) forward hooks are added to this rank's modules
and removed after the step, so other steps run exactly the code they run without the feature. Each hook adds
the L1 sum and the element count of what this rank holds, over every microbatch; one all-reduce over the whole
world then combines data-parallel ranks (their own samples), pipeline stages (their own layers) and tensor-
parallel shards: sequence shards (tp_mode reduce_scatter) and vocab shards of the logits add up, while a tensor
every tp rank holds whole (the residual stream under tp_mode all_reduce) is counted on tp rank 0 alone. The
mean is the sum over the global batch divided by its count, so it is the same at every layout and nothing is
gathered. A layer recomputed in backward (parallelism.recompute full or selective) runs its hooks again inside autograd:
those calls are skipped.

Cost at scale (512 GPUs, a 70B model of 80 layers): per stats step one extra read of each tracked activation
(a reduction per hook, ~1% of the step's memory traffic; the logits' vocab shard is the largest) and one
all-reduce of 2 x 243 float64 values (4 KB, latency-bound: tens of microseconds), then one host sync per rank.
Nothing at all on other steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from nanotron.config import Config
from nanotron.models.moe import MoE
from nanotron.models.shapes import is_moe_layer
from nanotron.parallel.torch_private import in_backward_pass
from nanotron.step_end import StepInfo, StepReport


def activation_names(num_layers: int, moe_layers: frozenset[int] = frozenset()) -> list[str]:
    """The metric names, in the fixed order every rank fills its vector in (a MoE layer's router scores too)."""
    layers = [
        f"act/layers.{i}.{part}"
        for i in range(num_layers)
        for part in ("attn", *(("router",) if i in moe_layers else ()), "mlp", "residual")
    ]
    return ["act/embed", *layers, "act/norm", "act/logits"]


class ActivationStats:
    """Collects the statistics of chosen steps on every rank; `result()` combines them (a collective)."""

    def __init__(
        self, cfg: Config, modules: list[nn.Module], tp_rank: int, device: torch.device, sequence_sharded: bool
    ):
        """`sequence_sharded`: plain (non-DTensor) activations are this tp rank's sequence shard, not the whole
        (`MicrobatchRunner.sequence_sharded`)."""
        self.interval = cfg.logging.activation_stats_interval
        self.modules, self.tp_rank, self.device = modules, tp_rank, device
        self.plain_sharded = sequence_sharded
        m, t = cfg.model, cfg.training
        self.mtp_depth = m.mtp_depth  # the MTP modules' calls of the embedding and head are not the model's
        moe_layers = frozenset(i for i in range(m.num_layers) if is_moe_layer(m, i))
        self.names = activation_names(m.num_layers, moe_layers)
        # What one step's hooks must count in all: each activation of every sample of the global batch, once.
        tokens = t.global_batch_size * t.seq_len
        widths = [m.moe.num_experts if n.endswith(".router") else m.hidden_size for n in self.names[:-1]]
        self.expected_counts = [tokens * w for w in widths] + [tokens * m.vocab_size]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.pending = False

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around training step `step` (1-based): hooks in place during it if it is a stats step."""
        if not self.interval or step % self.interval:
            yield
            return
        self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        self.counts = [0] * len(self.names)
        handles = self._register()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.pending = True

    def restart(self) -> None:
        """The step is recomputed (a stability replay): what its first pass recorded is dropped."""
        if self.interval and hasattr(self, "sums"):
            self.sums.zero_()
            self.counts = [0] * len(self.names)

    def discard(self) -> None:
        """The step was not kept (a rollback): nothing to report, on every rank alike."""
        self.pending = False

    def step_end(self, info: StepInfo) -> StepReport | None:
        """The kept step's `act/*` means, after a stats step (a collective: every rank calls it)."""
        if (activations := self.result()) is None:
            return None
        return StepReport([({"step": info.step} | activations, None)])

    def result(self) -> dict[str, float] | None:
        """The step's `act/*` means on every rank (None after a step without stats). Every rank calls it."""
        if not self.pending:
            return None
        self.pending = False
        counts = torch.tensor(self.counts, dtype=torch.float64, device=self.device)
        values = torch.cat([self.sums, counts])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)
        sums, counts = values.tolist()[: len(self.names)], values.tolist()[len(self.names) :]
        if counts != self.expected_counts:  # a microbatch missed, or a tensor counted twice (recompute, tp)
            wrong = next(i for i, (c, e) in enumerate(zip(counts, self.expected_counts)) if c != e)
            raise RuntimeError(
                f"{self.names[wrong]}: counted {counts[wrong]:.0f} elements, the step has {self.expected_counts[wrong]}"
            )
        return {name: s / c for name, s, c in zip(self.names, sums, counts)}

    def _register(self) -> list[RemovableHandle]:
        handles = []
        for module in self.modules:
            model = module.model
            tracked: list[tuple[nn.Module, str]] = []
            if model.embed_tokens is not None:
                tracked.append((model.embed_tokens, "act/embed"))
            for i, layer in model.layers.items():
                tracked += [(layer.self_attn, f"act/layers.{i}.attn"), (layer.mlp, f"act/layers.{i}.mlp")]
                tracked.append((layer, f"act/layers.{i}.residual"))
                if isinstance(layer.mlp, MoE):  # its router's scores [tokens, experts], whole on every tp rank
                    hook = self._hook(self.index[f"act/layers.{i}.router"], router=True)
                    handles.append(layer.mlp.gate.register_forward_hook(hook))
            if model.norm is not None:
                tracked.append((model.norm, "act/norm"))
            if module.lm_head is not None:
                tracked.append((module, "act/logits"))
            handles += [m.register_forward_hook(self._hook(self.index[name])) for m, name in tracked]
        return handles

    def _hook(self, index: int, router: bool = False):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if in_backward_pass():  # a forward run again by backward: recomputation
                return
            if self.mtp_depth and isinstance(module, nn.Embedding) and args[0].dim() == 3:
                return  # the MTP tokens' embedding ([batch, seq, depth] ids)
            if self.mtp_depth and self.names[index] == "act/logits" and module.training:
                output = output[:, : output.shape[1] // (1 + self.mtp_depth)]  # the main logits, then the MTP's
            self._add(index, output[0], whole=True) if router else self._add(index, output)

        return hook

    @torch.no_grad()
    def _add(self, index: int, output: torch.Tensor, whole: bool = False) -> None:
        if isinstance(output, DTensor):
            if any(p.is_partial() for p in output.placements):
                raise RuntimeError(f"{self.names[index]}: a partial-sum DTensor has no per-element |x| to take")
            local, sharded = output.to_local(), any(p.is_shard() for p in output.placements)
        else:
            local, sharded = output, self.plain_sharded and not whole
        if not sharded and self.tp_rank != 0:
            return  # every tp rank holds this tensor whole: tp rank 0 counts it for them
        # fp32 sums per row (no full-size copy), added in fp64: the total is then the same at every layout.
        rows = torch.linalg.vector_norm(local.detach(), ord=1, dim=-1, dtype=torch.float32)
        self.sums[index] += rows.sum(dtype=torch.float64)
        self.counts[index] += local.numel()
