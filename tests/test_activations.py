"""Activation statistics in one process: each `act/*` value is the mean |x| of what it names over the step's
microbatches, hooks exist only during a stats step, and a layer recomputed in backward is counted once.
(Every layout against one process: tests/test_mup.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, TINY_MUP

from nanotron.config import load_config, parse_overrides
from nanotron.metrics.activations import ActivationStats, activation_names
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.init import init_weights
from nanotron.parallel.recompute import apply_recompute

MUP = TINY_MUP


def tiny(*extra: str):
    cfg = load_config(*parse_overrides([*TINY_MODEL, *MUP, "--logging.activation_stats_interval=2", *extra]))
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, cfg.job.seed)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.training.global_batch_size, cfg.training.seq_len + 1))
    return cfg, model, batch.chunk(cfg.training.grad_accum_steps)


def train_microbatches(model: LlamaForCausalLM, microbatches: list[torch.Tensor]) -> None:
    for batch in microbatches:
        F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()


@torch.no_grad()
def expected_means(model: LlamaForCausalLM, microbatches: list[torch.Tensor]) -> dict[str, float]:
    """The same forward written out by hand, with the model's own µP multipliers: mean |x| of each part."""
    parts: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, x: torch.Tensor) -> None:
        parts.setdefault(name, []).append(x.abs().flatten())

    m = model.model
    for batch in microbatches:
        h = m.embed_tokens(batch[:, :-1])
        keep("act/embed", h)
        for i, layer in m.layers.items():
            attn = layer.self_attn(layer.input_layernorm(h), m.rope)
            h = h + layer.residual_multiplier * attn
            mlp = layer.mlp(layer.post_attention_layernorm(h))
            h = h + layer.residual_multiplier * mlp
            keep(f"act/layers.{i}.attn", attn)
            keep(f"act/layers.{i}.mlp", mlp)
            keep(f"act/layers.{i}.residual", h)
        h = m.norm(h)
        keep("act/norm", h)
        keep("act/logits", model.lm_head(h) * model.logit_multiplier)
    return {name: torch.cat(values).double().mean().item() for name, values in parts.items()}


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_stats_step_logs_mean_abs_of_every_tracked_output_and_leaves_no_hook():
    cfg, model, microbatches = tiny()
    assert model.logit_multiplier == 0.5 and model.model.layers["0"].residual_multiplier == 0.5
    stats = ActivationStats(cfg, [model], tp_rank=0, device=torch.device("cpu"), sequence_sharded=False)
    before = hook_count(model)
    with stats.step(1):  # not a stats step: nothing registered, nothing to report
        assert hook_count(model) == before
        train_microbatches(model, microbatches)
    assert stats.result() is None
    with stats.step(2):
        assert hook_count(model) == before + len(activation_names(cfg.model.num_layers))
        train_microbatches(model, microbatches)
    assert hook_count(model) == before
    result = stats.result()
    expected = expected_means(model, microbatches)
    assert list(result) == activation_names(cfg.model.num_layers) and result.keys() == expected.keys()
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=1e-6, abs=0), name
    assert stats.result() is None  # reported once


def test_a_recomputed_layer_is_counted_once():
    """Recompute runs each layer's forward again in backward; the step's element counts (checked against the
    global batch inside `result`) and values are those of the run without recompute."""
    cfg, model, microbatches = tiny()
    plain = ActivationStats(cfg, [model], tp_rank=0, device=torch.device("cpu"), sequence_sharded=False)
    with plain.step(2):
        train_microbatches(model, microbatches)
    apply_recompute(model)
    recomputed = ActivationStats(cfg, [model], tp_rank=0, device=torch.device("cpu"), sequence_sharded=False)
    with recomputed.step(2):
        train_microbatches(model, microbatches)
    assert recomputed.result() == pytest.approx(plain.result(), rel=1e-6, abs=0)


def test_a_step_that_missed_a_microbatch_is_an_error_not_a_biased_mean():
    cfg, model, microbatches = tiny()
    stats = ActivationStats(cfg, [model], tp_rank=0, device=torch.device("cpu"), sequence_sharded=False)
    with stats.step(4):
        train_microbatches(model, microbatches[:-1])
    with pytest.raises(RuntimeError, match=r"act/embed: counted 3072 elements, the step has 4096"):
        stats.result()


def test_activation_stats_with_compile_is_a_config_error():
    from nanotron.errors import ConfigError

    with pytest.raises(ConfigError, match="logging.activation_stats_interval needs training.compile=false"):
        load_config(*parse_overrides([*TINY_MODEL, "--logging.activation_stats_interval=5", "--training.compile=true"]))


def test_the_every_other_matmul_policy_answers_the_rerun_as_it_answered_the_forward():
    """Selective recompute keeping every other matmul: torch 2.11 asks the policy again for each op of the rerun
    (2.13 replays the forward's answers), and a kept output is matched to its op by order, so the rerun must get
    the forward's answers in the forward's order, or q's rerun is handed gate's output (a shape error on 2.11)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from nanotron.parallel.recompute import every_other_matmul_policy

    aten = torch.ops.aten
    ops = [aten.mm.default, aten.mul.Tensor, aten.mm.default, aten.addmm.default, aten.silu.default, aten.mm.default]
    policy = every_other_matmul_policy()
    forward = [policy(SimpleNamespace(is_recompute=False, op_output=None), op) for op in ops]
    rerun = [policy(SimpleNamespace(is_recompute=True, op_output=None), op) for op in ops]
    keep, rerun_it = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == [keep, rerun_it, rerun_it, keep, rerun_it, rerun_it]  # matmuls 1 and 3 kept, 2 and 4 rerun
    assert rerun == forward
