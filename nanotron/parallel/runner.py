"""Running a step's microbatches on this rank's stages: the trainer's one call for training and for evaluation.

Everything a layout changes about running a microbatch is here: the pipeline schedule or the plain loop, the
ZeRO stage's gradient-sync rule (one `GradientSync`, shared with the pipeline stages), `loss_parallel` for
vocab-sharded logits, and plain losses out of DTensors. A new parallel dimension changes this file and
`parallelize.py`, not the training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from nanotron.config import Config
from nanotron.distributed import ParallelContext
from nanotron.parallel.fsdp import GradientSync
from nanotron.parallel.pipeline import build_schedule, forward_only


def microbatch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss of one microbatch; microbatches and dp ranks average to the global-batch mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class MicrobatchRunner:
    """Runs `grad_accum_steps` microbatches of a batch [microbatches x micro_batch_size, seq_len + 1] through
    this rank's stages. Losses come back as device tensors on ranks with the last stage, None elsewhere."""

    def __init__(
        self,
        stages: list[tuple[int, nn.Module]],
        cfg: Config,
        ctx: ParallelContext,
        on_phase: Callable[[str], None] = lambda phase: None,
    ):
        self.on_phase = on_phase  # told "forward" and "backward" (a pipeline's interleaved step counts as forward)
        self.modules = [module for _, module in stages]
        self.device = ctx.device
        self.n_micro = cfg.training.grad_accum_steps
        self.sync = GradientSync(cfg.parallelism.zero_stage)
        self.loss_parallel = cfg.parallelism.tp > 1  # the logits are vocab-sharded DTensors
        indices = [index for index, _ in stages]
        self.has_first, self.has_last = 0 in indices, cfg.num_stages - 1 in indices
        self.schedule = None
        if cfg.parallelism.pp > 1:
            self.schedule = build_schedule(stages, cfg, ctx.mesh, ctx.device, microbatch_loss, self.sync)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every microbatch, gradients accumulated as the mean over them and reduced as
        the ZeRO stage says; returns the mean loss, detached."""
        inputs, targets = self._split(batch)
        with self._loss_context():
            if self.schedule is not None:
                self.on_phase("forward")
                return self._pipelined(self.schedule.step, inputs, targets)
            model, total = self.modules[0], torch.zeros((), device=self.device)
            for index, (inp, tgt) in enumerate(zip(inputs.chunk(self.n_micro), targets.chunk(self.n_micro))):
                self.sync.before_backward(model, last_microbatch=index == self.n_micro - 1)
                self.on_phase("forward")
                loss = microbatch_loss(model(inp), tgt) / self.n_micro
                self.on_phase("backward")
                loss.backward()
                total += _plain(loss).detach()
            return total

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> torch.Tensor | None:
        """Forward only, in eval mode: the mean over `batches` of each batch's mean loss."""
        for module in self.modules:
            module.eval()
        losses = [self._forward(batch) for batch in batches]
        for module in self.modules:
            module.train()
        return torch.stack(losses).mean() if self.has_last else None

    def _forward(self, batch: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = self._split(batch)
        with self._loss_context():
            if self.schedule is not None:
                with forward_only(self.schedule):
                    return self._pipelined(self.schedule.eval, inputs, targets)
            chunks = zip(inputs.chunk(self.n_micro), targets.chunk(self.n_micro))
            return torch.stack([_plain(microbatch_loss(self.modules[0](i), t)) for i, t in chunks]).mean()

    def _split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _pipelined(self, run: Callable, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule call (`step` or `eval`): stage 0 feeds the inputs, the last stage takes the targets."""
        losses: list[torch.Tensor] = []
        run(
            *([inputs] if self.has_first else []),
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
        )
        return torch.stack([_plain(loss).detach().float() for loss in losses]).mean() if self.has_last else None


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; logging wants the plain value."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
