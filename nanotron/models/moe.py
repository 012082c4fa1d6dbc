"""Mixture-of-experts MLP in plain PyTorch: a token-choice router, experts as stacked weights, shared experts.

Parameter names follow `transformers`' Mixtral (v5): `mlp.gate.weight` [E, H] (the router),
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. Each layer routes its tokens once:
the (token, choice) pairs are sorted by expert (one stable argsort, no loop over tokens), every expert runs on its
contiguous slice, and the outputs are weighted by their gates and summed back per token.

Two parameterless seams let the parallel layer change how, never what, is computed (no parameter name changes):
`dispatcher` moves the grouped tokens to the experts and back (expert parallelism swaps it for all-to-all, and
computes the shared experts while the tokens travel), and
`GroupedExperts.mlp` runs each group through its expert (a loop over experts here; expert parallelism takes the
local experts' weights, CUDA swaps in torch's grouped GEMM over padded groups).

Load balancing: the router adds a per-expert bias to the scores it chooses by (never to the gates), which the
trainer moves towards the mean load after each step (DeepSeek-V3's auxiliary-loss-free balancing, arXiv:2412.19437
section 2.1.2); and an optional sequence-wise balance loss (the same paper's eq. 17-20) whose gradient is added in
backward (no change to the loss the model returns). Each layer counts the tokens each expert received, the dropped
ones and its balance loss in buffers that the trainer reads and clears once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import ModelConfig, MoEConfig


def loop_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] rows for expert e, in order) times their expert's weight
    [E, in, out]: one matmul per expert (not per token); an expert without rows costs nothing."""
    pieces = [rows @ weight[e] for e, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
    # No rows at all: an empty product that still depends on x and the weight, so that backward runs through
    # here on every rank (expert parallelism's all-to-alls in backward need every rank) and the weight gets a
    # (zero) gradient like its peers' (FSDP reduces the same tensors everywhere).
    return torch.cat(pieces) if pieces else x[:0] @ weight[0]


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs as stacked weights (the local ones under expert parallelism)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.mlp: Callable[..., torch.Tensor] = expert_mlp  # (x, counts, gate_up, down) -> out

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.mlp(x, counts, self.gate_up_proj, self.down_proj)


def expert_mlp(x, counts, gate_up: torch.Tensor, down: torch.Tensor, matmul=loop_matmul) -> torch.Tensor:
    """SwiGLU of each group of rows with its expert's weights (gate_up [E, 2I, H], down [E, H, I])."""
    gate, up = matmul(x, gate_up.transpose(1, 2), counts).chunk(2, dim=-1)
    return matmul(F.silu(gate) * up, down.transpose(1, 2), counts)


class LocalDispatch(nn.Module):
    """All experts on this rank: the grouped tokens go straight to them. A dispatcher returns the experts' output
    and, if it ran `during` (work to hide a transfer behind), its result; nothing travels here, so it doesn't."""

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts, during: Callable[[], torch.Tensor] | None
    ) -> tuple[torch.Tensor, None]:
        return experts(x, counts), None


class Router(nn.Module):
    """Scores every expert per token and picks top_k by score + bias; returns the gates and expert ids [T, K]."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.sigmoid = moe.router == "sigmoid"
        self.top_k = moe.top_k
        self.renormalize = self.sigmoid or moe.renormalize
        self.scaling = moe.routed_scaling_factor
        self.groups = moe.num_expert_groups
        self.top_groups = moe.top_expert_groups or moe.num_expert_groups
        # Chooses experts only (DeepSeek-V3's b_i); moved by the trainer from the step's global load; checkpointed.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 routes in fp32, as in HF
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.expert_bias
        if self.top_groups < self.groups:
            choice = self._best_groups_only(choice)
        index = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, index)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            gates = gates * self.scaling
        return scores, gates, index

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's top_groups groups at -inf (DeepSeek-V3's node-limited
        routing): a group scores the sum of its two best experts' choice scores."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.top_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a decoder layer's MLP; input [batch, seq, hidden]."""

    def __init__(self, cfg: ModelConfig, shared_experts: nn.Module | None = None):
        super().__init__()
        moe = cfg.moe
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coef = moe.aux_loss_coef
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size)
        self.dispatcher: nn.Module = LocalDispatch()
        self.shared_experts = shared_experts  # an MLP every token passes through (DeepSeek's shared experts)
        # The gradient weight of the balance loss relative to the model's loss: 1 / microbatches when each
        # microbatch's loss is divided by their number (the parallel runner sets it), 1 for a single batch.
        self.aux_loss_scale = 1.0
        # Per step, cleared by whoever reads them: tokens per expert, dropped (token, choice) pairs, balance loss.
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        # Whether this forward's counts are new: False for a forward recomputed in backward (activation
        # checkpointing sets it), which would count the same tokens twice.
        self.counting: Callable[[], bool] = lambda: True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        scores, gates, index = self.gate(flat)
        choices = index.flatten()
        keep = self._within_capacity(index, batch, seq) if self.capacity_factor else None
        if keep is not None:
            choices = torch.where(keep, choices, self.num_experts)  # past the last expert: sorted out of the way
        order = choices.argsort(stable=True)
        # Counted by scatter_add, not bincount: bincount reads the largest id back to the host on CUDA.
        counts = choices.new_zeros(self.num_experts + 1).scatter_add_(0, choices, torch.ones_like(choices))
        counting = self.training and self.counting()  # evaluation and recomputation don't count
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += counts[: self.num_experts]
                self.dropped_tokens += counts[self.num_experts]
        # Dropping sizes the routed rows by the kept count: a host sync per layer and microbatch (capacity only).
        routed = order[: choices.numel() - counts[self.num_experts]] if keep is not None else order
        token = routed // self.top_k
        shared = partial(self.shared_experts, flat) if self.shared_experts is not None else None
        out, shared_out = self.dispatcher(flat[token], counts[: self.num_experts], self.experts, shared)
        out = out * gates.flatten()[routed].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(flat).index_add_(0, token, out)
        if shared is not None:
            combined = combined + (shared() if shared_out is None else shared_out)
        if self.aux_loss_coef and torch.is_grad_enabled():
            combined = _AddLossGradient.apply(combined, self._balance_loss(scores, index, batch, seq, counting))
        return combined.view(batch, seq, hidden)

    def _within_capacity(self, index: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Per (token, choice), whether it is among the first `capacity` of its sequence routed to its expert
        (in token order): capacity = ceil(capacity_factor x seq x top_k / num_experts) per sequence, so the
        dropped set depends on the sequence alone, not on how sequences are batched across ranks."""
        capacity = math.ceil(self.capacity_factor * seq * self.top_k / self.num_experts)
        one_hot = F.one_hot(index.view(batch, seq * self.top_k), self.num_experts)
        position = one_hot.cumsum(dim=1).gather(-1, index.view(batch, seq * self.top_k, 1)).squeeze(-1)
        return (position <= capacity).flatten()

    def _balance_loss(self, scores: torch.Tensor, index: torch.Tensor, batch: int, seq: int, counting: bool):
        """alpha x mean over sequences of sum_i f_i P_i: f_i = E/(K S) x tokens choosing expert i, P_i = the
        mean normalised score of expert i over the sequence (DeepSeek-V3 eq. 17-20)."""
        e, k = self.num_experts, self.top_k
        chosen = F.one_hot(index.view(batch, seq * k), e).sum(dim=1).float()
        fraction = chosen * e / (k * seq)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        mean_prob = probs.view(batch, seq, e).mean(dim=1)
        loss = self.aux_loss_coef * (fraction * mean_prob).sum(dim=-1).mean()
        if counting:
            with torch.no_grad():
                self.aux_loss += loss.detach()
        return loss * self.aux_loss_scale


class _AddLossGradient(torch.autograd.Function):
    """Returns `x` unchanged; backward also sends gradient 1 into `loss`: the loss is minimised as if it had been
    added to the model's loss, without passing through pipeline stages or the loss function."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)
