"""Running a step's microbatches on this rank's stages: the trainer's one call for training and for evaluation.

Everything a layout changes about running a microbatch is here: the pipeline schedule or the plain loop, the
ZeRO stage's gradient-sync rule (one `GradientSync`, shared with the pipeline stages), `loss_parallel` for
vocab-sharded logits, this cp rank's part of each sequence, and plain losses out of DTensors; and what the
trainer and the evaluation ask of the layout: which rank holds and logs the loss, its mean over dp x cp, the
step's shares of the global loss and gradient norm, the evaluation's row split and batch shapes. A new parallel
dimension changes this file and `parallelize.py`, not the training loop. Multi-token prediction's tokens and
targets are cut here from the whole sequences (before the cp split), and its loss joins the main one in training.

The loss is the mean over every token of the global batch that carries a loss, at every layout. Under causal
attention every token does, and each rank holds as many, so the mean of each microbatch (this rank's tokens)
averaged over microbatches and dp x cp ranks (as gradients are) is that mean. Under document masking the
token after an EOS carries none and ranks hold different counts: each microbatch's loss is then its sum
times microbatches x dp x cp / (the global batch's count), which one all-reduce of one number over dp gives
per step (the cp ranks of a dp rank hold the same samples). Cost at 512 GPUs: 8 bytes, latency-bound, no
host sync.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from nanotron.config import Config
from nanotron.models.attention import document_ids
from nanotron.parallel.context import shard_sequence
from nanotron.parallel.expert import expert_layers
from nanotron.parallel.fsdp import GradientSync
from nanotron.parallel.mesh import ParallelContext, submesh
from nanotron.parallel.pipeline import build_schedule, forward_only

IGNORE_INDEX = -100  # targets that carry no loss (the token after an EOS under document masking, evaluation padding)
Window = tuple[int, int] | None  # (lo, hi): the positions a scoring batch's targets lie in


def mtp_depth_loss(logits: torch.Tensor, targets: torch.Tensor, seq_len: int, depth: int) -> torch.Tensor:
    """One MTP depth's loss on one microbatch: its targets' summed loss over the positions that have one (the
    last `depth` of each sequence have none) divided by this rank's positions x (seq_len - depth) / seq_len, so
    that microbatches and dp x cp ranks average to the mean over every predicted token of the global batch
    whichever cp rank holds the sequence's end."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total * (seq_len / ((seq_len - depth) * targets.numel()))


def training_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor | None,
    mtp_depth: int = 0,
    mtp_weight: float = 0.0,
    seq_len: int = 0,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss to differentiate, its logged parts) of one training microbatch: the main cross-entropy ("loss"),
    plus mtp_weight x the MTP loss ("mtp_loss", the mean over the depths: logits and targets then hold the main
    positions, then each depth's, llama.py's order), plus z_loss x the main positions' mean log(Z)^2 ("z_loss")."""
    main_logits, main_targets = logits, targets
    if mtp_depth:
        width = targets.shape[1] // (1 + mtp_depth)
        parts = [slice(k * width, (k + 1) * width) for k in range(1 + mtp_depth)]
        main_logits, main_targets = logits[:, parts[0]], targets[:, parts[0]]
    main = microbatch_loss(main_logits, main_targets, scale)
    total, logged = main, {"loss": main}
    if mtp_depth:
        depths = range(1, mtp_depth + 1)
        mtp = sum(mtp_depth_loss(logits[:, parts[k]], targets[:, parts[k]], seq_len, k) for k in depths) / mtp_depth
        total, logged["mtp_loss"] = total + mtp_weight * mtp, mtp
    if z_loss:
        z = log_partition_squared(main_logits, main_targets, scale)
        total, logged["z_loss"] = total + z_loss * z, z
    return total, logged


class _LogPartition(torch.autograd.Function):
    """log Z of each row of [tokens, vocab] logits (logsumexp over the vocabulary); with a tp group, of the rows of
    this rank's vocabulary shard, the maximum and the sum of exponentials all-reduced over the group (two
    [tokens] all-reduces). The gradient is the softmax of this shard's columns times the upstream gradient:
    every tp rank holds the same loss, so nothing is summed in backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        peak = logits.amax(dim=-1)
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        total = (logits - peak[:, None]).exp().sum(dim=-1)
        if group is not None:
            dist.all_reduce(total, group=group)
        log_z = total.log() + peak
        ctx.save_for_backward(logits, log_z)
        return log_z

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, log_z = ctx.saved_tensors
        return grad[:, None] * (logits - log_z[:, None]).exp(), None


def log_partition_squared(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The z-loss of one microbatch (PaLM, arXiv:2204.02311 section 5; OLMo; nanotron's z_loss): log(Z)^2, Z the
    softmax's normaliser, averaged over the tokens that carry a loss as `microbatch_loss` averages them (with
    `scale`: the sum times `scale`). Vocab-sharded logits (a DTensor under loss_parallel) are reduced over their
    tp group and the result is a replicated DTensor, as the cross-entropy's. It keeps the float logits until
    backward: one [tokens, vocab / tp] fp32 tensor per microbatch in flight."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    mesh = logits.device_mesh if isinstance(logits, DTensor) else None
    if mesh is not None:
        if logits.placements != (Shard(1),):  # loss_parallel's contract: logits sharded over the vocabulary only
            raise AssertionError(f"z-loss expects vocab-sharded logits, got placements {logits.placements}")
        log_z = _LogPartition.apply(logits.to_local(), mesh.get_group())
    else:
        log_z = _LogPartition.apply(logits, None)
    kept = targets != IGNORE_INDEX
    squares = (log_z.square() * kept).sum()
    value = squares * scale if scale is not None else squares / kept.sum()
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False) if mesh is not None else value


def mtp_tokens_and_targets(batch: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From whole sequences [batch, seq_len + 1]: per position t of the inputs, the tokens t+1..t+depth the MTP
    modules embed ([batch, seq_len, depth]; 0 past the end) and the tokens t+2..t+depth+1 they predict ([batch,
    seq_len, depth]; IGNORE_INDEX past the end). Built before the sequence is split over cp, so a shift that
    crosses a cp rank's chunk boundary reads the right token."""
    tokens, targets = [], []
    for k in range(1, depth + 1):
        tokens.append(F.pad(batch[:, k:], (0, k - 1), value=0))
        targets.append(F.pad(batch[:, k + 1 :], (0, k), value=IGNORE_INDEX))
    return torch.stack(tokens, dim=-1), torch.stack(targets, dim=-1)


def microbatch_loss(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mean token loss of one microbatch; microbatches and dp x cp ranks average to the global-batch mean.
    With `scale`, the sum over the tokens that carry a loss times `scale` instead (see the module's doc)."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    if scale is None:
        return F.cross_entropy(logits, targets)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") * scale


class MicrobatchRunner:
    """Runs `grad_accum_steps` microbatches of a batch [microbatches x micro_batch_size, seq_len + 1] through
    this rank's stages. Losses come back as device tensors on ranks with the last stage, None elsewhere."""

    def __init__(
        self,
        stages: list[tuple[int, nn.Module]],
        cfg: Config,
        ctx: ParallelContext,
        on_phase: Callable[[str], None] = lambda phase: None,
        eos_id: int | None = None,
    ):
        self.on_phase = on_phase  # told "forward" and "backward" (a pipeline's interleaved step counts as forward)
        self.modules = [module for _, module in stages]
        self.device = ctx.device
        self.n_micro = cfg.training.grad_accum_steps
        self.sync = GradientSync(cfg.parallelism.zero_stage)
        self.loss_parallel = cfg.parallelism.tp > 1  # the logits are vocab-sharded DTensors
        p = cfg.parallelism
        self.cp = p.cp
        self.cp_rank = ctx.cp_rank
        self.dp = p.dp
        self.dp_group = submesh(ctx.mesh, "dp").get_group() if p.dp > 1 else None
        self.document = cfg.model.attention == "document"
        # Multi-token prediction: its tokens travel with every microbatch; its loss is added in training only.
        self.mtp_depth, self.mtp_weight = cfg.model.mtp_depth, cfg.training.mtp_loss_weight
        self.seq_len = cfg.training.seq_len
        self.z_loss = cfg.training.z_loss
        # Inside forward_backward with MTP or the z-loss: the loss to differentiate is more than the logged loss, and
        # each microbatch's parts are kept (detached) for the step's means; with MTP, logits and targets carry the
        # MTP depths.
        self.training_parts = False
        self.step_losses: list[dict[str, torch.Tensor]] = []
        # The last step's means of the parts beyond the loss ({"mtp_loss": ..., "z_loss": ...}), on the last stage.
        self.extra_losses: dict[str, torch.Tensor] = {}
        if self.document and eos_id is None:
            raise ValueError("model.attention='document' needs the tokenizer's EOS id")
        self.eos_id = eos_id
        self.scale: torch.Tensor | None = None  # this batch's loss scale under document masking
        self.scoring = False  # `loss` returns each row's summed target log-likelihood (downstream evaluation)
        self.cp_group = ctx.mesh["cp"].get_group() if p.cp > 1 else None
        indices = [index for index, _ in stages]
        self.has_first, self.has_last = 0 in indices, cfg.num_stages - 1 in indices
        # The loss lives on the last pipeline stage (rank 0's second stage under zbv): its first dp/cp/tp rank logs.
        self.rank = ctx.rank
        self.dp_rank = ctx.dp_rank
        self.tp_rank = ctx.tp_rank
        self.is_logging_rank = self.has_last and ctx.dp_rank == 0 and ctx.cp_rank == 0 and ctx.tp_rank == 0
        self.loss_group = ctx.loss_group()
        self.pp_group = ctx.mesh["pp"].get_group() if p.pp > 1 else None  # gradient norms add up over the stages
        # Plain (non-DTensor) activations are sequence shards under sequence parallelism, else whole on each tp rank.
        self.sequence_sharded = p.tp > 1 and p.tp_mode == "reduce_scatter"
        # Without a pipeline (whose stages are built for seq_len) or cp (whose RoPE positions are set once, for
        # seq_len's zigzag chunks: cut rows got wrong positions, 6e-5 off one process in the layout matrix) a scoring
        # batch may be cut to its longest row, rounded up to what tp's sequence sharding divides: short items cost less.
        self.width_multiple = None if p.pp > 1 or p.cp > 1 else p.tp
        # The head may run on the positions that hold a scoring batch's continuations only, except under cp (where a
        # rank holds chunks of the sequence).
        self.windowed = p.cp == 1
        # A MoE balance loss's gradient follows the model loss's normalisation: the plain loop divides each
        # microbatch's loss by their number, the pipeline scales the summed gradients once at the end.
        for module in self.modules:
            for moe in expert_layers(module):
                moe.aux_loss_scale = 1.0 if cfg.parallelism.pp > 1 else 1.0 / self.n_micro
        self.schedule = None
        if cfg.parallelism.pp > 1:
            self.schedule = build_schedule(stages, cfg, ctx.mesh, ctx.device, self.loss, self.sync)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every microbatch, gradients accumulated as the mean over them and reduced as
        the ZeRO stage says; returns the mean loss, detached."""
        inputs, targets, doc = self._split(batch)
        mtp = self._mtp(batch, targets)
        if mtp is not None:
            targets = mtp.pop("targets")
        self.training_parts, self.step_losses = mtp is not None or self.z_loss > 0, []
        try:
            with self._loss_context():
                if self.schedule is not None:
                    self.on_phase("forward")
                    loss = self._pipelined(self.schedule.step, inputs, targets, doc, **(mtp or {}))
                else:
                    loss = self._plain_loop(inputs, targets, doc, mtp)
        finally:
            training_parts, self.training_parts = self.training_parts, False
        if not training_parts or not self.has_last:
            return loss
        means = {name: torch.stack([parts[name] for parts in self.step_losses]).mean() for name in self.step_losses[0]}
        self.extra_losses = {name: value for name, value in means.items() if name != "loss"}
        return means["loss"]  # the logged loss is the main model's; the gradients are of the whole training_loss

    def _plain_loop(self, inputs, targets, doc, mtp: dict | None) -> torch.Tensor:
        model = self.modules[0]
        total = torch.zeros((), device=self.device)
        tokens = mtp["mtp_tokens"].chunk(self.n_micro) if mtp else [None] * self.n_micro
        for index, ((inp, tgt, d), extra) in enumerate(zip(self._microbatches(inputs, targets, doc), tokens)):
            self.sync.before_backward(model, last_microbatch=index == self.n_micro - 1)
            self.on_phase("forward")
            loss = self.loss(model(inp, d, **({"mtp_tokens": extra} if extra is not None else {})), tgt)
            loss = loss / self.n_micro
            self.on_phase("backward")
            loss.backward()
            total += _plain(loss).detach()
        return total

    def _mtp(self, batch: torch.Tensor, targets: torch.Tensor) -> dict | None:
        """With multi-token prediction: this cp rank's MTP tokens ({"mtp_tokens": [batch, tokens, depth]}) and the
        targets, main ones then each depth's, concatenated on the sequence dimension ("targets")."""
        if not self.mtp_depth:
            return None
        tokens, extra = mtp_tokens_and_targets(batch.to(self.device, non_blocking=True), self.mtp_depth)
        tokens = shard_sequence(tokens, self.cp, self.cp_rank)
        extra = shard_sequence(extra, self.cp, self.cp_rank)
        return {"mtp_tokens": tokens, "targets": torch.cat([targets, *extra.unbind(-1)], dim=1)}

    def _eval_kwargs(self, batch: torch.Tensor) -> dict:
        """What a pipeline stage needs in evaluation beyond the inputs: with multi-token prediction the MTP tokens,
        whose embeddings the stages hand on whatever the mode (the stages' shapes are fixed); the last stage
        computes no MTP logits in eval mode. Without a pipeline nothing."""
        if not self.mtp_depth or self.schedule is None:
            return {}
        tokens, _ = mtp_tokens_and_targets(batch.to(self.device, non_blocking=True), self.mtp_depth)
        return {"mtp_tokens": shard_sequence(tokens, self.cp, self.cp_rank)}

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
        inputs, targets, doc = self._split(batch)
        with self._loss_context():
            if self.schedule is not None:
                with forward_only(self.schedule):
                    return self._pipelined(self.schedule.eval, inputs, targets, doc, **self._eval_kwargs(batch))
            chunks = self._microbatches(inputs, targets, doc)
            return torch.stack([_plain(self.loss(self.modules[0](i, d), t)) for i, t, d in chunks]).mean()

    @torch.no_grad()
    def score(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, Window]]) -> torch.Tensor | None:
        """Forward only, in eval mode: for each row of each (tokens [B, seq_len + 1], targets [B, seq_len],
        window) batch, the sum of the log-probabilities of its targets (IGNORE_INDEX where nothing is scored),
        over the whole sequence (cp ranks' parts summed). A window (lo, hi) holds every target of the batch
        (not under cp): the head runs on those positions only. Rows in order, float64; None without the last
        stage."""
        for module in self.modules:
            module.eval()
        self.scoring = True
        rows = []
        try:
            for tokens, targets, window in batches:
                inputs, _, doc = self._split(tokens)
                targets = shard_sequence(targets.to(self.device), self.cp, self.cp_rank)
                kwargs = self._eval_kwargs(tokens)
                if window is not None:
                    targets = targets[:, window[0] : window[1]]
                    kwargs["window"] = window
                with self._loss_context():
                    if self.schedule is not None:
                        with forward_only(self.schedule):
                            rows.extend(self._pipelined_losses(self.schedule.eval, inputs, targets, doc, **kwargs))
                    else:
                        chunks = self._microbatches(inputs, targets, doc)
                        rows.extend(self.loss(self.modules[0](i, d, **kwargs), t) for i, t, d in chunks)
        finally:
            self.scoring = False
            for module in self.modules:
                module.train()
        if not self.has_last:
            return None
        scores = torch.cat(rows).double()
        if self.cp_group is not None:
            dist.all_reduce(scores, group=self.cp_group)
        return scores

    def mean_loss(self, loss: torch.Tensor | None) -> float | None:
        """The dp x cp mean of a per-rank loss, on the host (a collective and a sync: logging and evaluation steps
        only); None on ranks without the last stage."""
        if loss is None:
            return None
        if self.loss_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.loss_group)
        return loss.item()

    def step_shares(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> list[torch.Tensor | float]:
        """This rank's terms of the step's global loss (the dp x cp mean of the last stage's losses, once per tp
        group) and gradient norm (already global: rank 0's), for the step's all-reduce to sum."""
        loss_share = loss.double() / (self.dp * self.cp) if loss is not None and self.tp_rank == 0 else 0.0
        return [loss_share, grad_norm if self.rank == 0 else 0.0]

    def row_share(self, total: int) -> tuple[int, int]:
        """(first row, rows per dp rank) of `total` scoring rows dealt out to the dp ranks in equal contiguous shares:
        the last share is padded (rows that score nothing), so every rank runs as many batches."""
        share = math.ceil(total / self.dp)
        return self.dp_rank * share, share

    def gather_rows(self, share: torch.Tensor) -> torch.Tensor:
        """Every dp rank's equal share of row scores, in dp order: one all-gather over dp."""
        if self.dp_group is None:
            return share
        gathered = share.new_empty(self.dp * len(share))
        dist.all_gather(list(gathered.chunk(self.dp)), share.contiguous(), group=self.dp_group)
        return gathered

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.scoring:
            return row_log_likelihoods(logits, targets)
        if not self.training_parts:
            return microbatch_loss(logits, targets, self.scale)
        # in training with MTP the logits and targets always carry its depths (forward_backward's `_mtp`)
        total, parts = training_loss(
            logits, targets, self.scale, self.mtp_depth, self.mtp_weight, self.seq_len, self.z_loss
        )
        self.step_losses.append({name: _plain(value).detach().float() for name, value in parts.items()})
        return total

    def _split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inputs and targets of this cp rank's part of each sequence, and (document masking) the document
        ids of the whole sequences; sets the batch's loss scale."""
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        doc = None
        if self.document:
            doc = document_ids(inputs, self.eos_id)
            targets = targets.masked_fill(inputs == self.eos_id, IGNORE_INDEX)
            count = (targets != IGNORE_INDEX).sum().to(torch.float64)
            if self.dp_group is not None:
                dist.all_reduce(count, group=self.dp_group)
            self.scale = (self.n_micro * self.dp * self.cp / count.clamp(min=1)).float()
        return shard_sequence(inputs, self.cp, self.cp_rank), shard_sequence(targets, self.cp, self.cp_rank), doc

    def _microbatches(self, inputs, targets, doc) -> zip:
        docs = doc.chunk(self.n_micro) if doc is not None else [None] * self.n_micro
        return zip(inputs.chunk(self.n_micro), targets.chunk(self.n_micro), docs)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _pipelined(self, run: Callable, inputs, targets, doc, **kwargs) -> torch.Tensor | None:
        """The mean loss of one schedule call (`step` or `eval`)."""
        losses = self._pipelined_losses(run, inputs, targets, doc, **kwargs)
        return torch.stack([loss.float() for loss in losses]).mean() if self.has_last else None

    def _pipelined_losses(self, run: Callable, inputs, targets, doc, **kwargs) -> list[torch.Tensor]:
        """One schedule call: stage 0 feeds the inputs, the last stage takes the targets, every stage the
        document ids and `kwargs`; the last stage's losses, plain and detached, in microbatch order (none
        elsewhere)."""
        losses: list[torch.Tensor] = []
        run(
            # contiguous: torch 2.11 checks stage 0's inputs' strides against the static ones (2.13 does not), and
            # the inputs are a view of the batch (it holds one token more); a copy of B x T token ids
            *([inputs.contiguous()] if self.has_first else []),
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
            **({"doc": doc} if doc is not None else {}),
            **kwargs,
        )
        return [_plain(loss).detach() for loss in losses]


def row_log_likelihoods(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row [B] of a microbatch, the summed log-probability of its targets that are not IGNORE_INDEX."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -_plain(nll).view(targets.shape).sum(-1).detach()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; logging wants the plain value."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
