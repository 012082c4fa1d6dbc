"""Multi-token prediction (`model.mtp_depth`, DeepSeek-V3 section 2.2): each depth predicts the token after the one
it embeds, the MTP modules live on the last pipeline stage with the embeddings carried to it, the loss weight acts,
the MTP loss is logged and a run resumes exactly. The layout rows (tp, pp, dp + ep, cp held to one process) are in
test_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, read_metrics, run_train
from matrix import MLA_MODEL, weights

from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.init import init_weights
from nanotron.parallel.pipeline import split_model, stage_shapes
from nanotron.parallel.runner import mtp_depth_loss, mtp_tokens_and_targets, training_loss


def config(*overrides: str):
    return load_config(*parse_overrides(["--config", "configs/tiny.toml", *TINY_MODEL, *MLA_MODEL, *overrides]))


def test_each_depth_predicts_the_token_after_the_one_it_embeds():
    """Depth k at position t reads the previous depth's hidden state and the embedding of token t+k and is scored on
    token t+k+1: the reference runs each depth on the sequence cut to its valid positions (the paper's form),
    causal attention making the padded tail irrelevant to them."""
    cfg = config("--model.mtp_depth=2")
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, seed=0)
    seq = cfg.training.seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = mtp_tokens_and_targets(batch, 2)
    logits = model(batch[:, :-1], mtp_tokens=tokens)
    assert logits.shape[1] == 3 * seq
    h, embed = model.model(batch[:, :-1]), model.model.embed_tokens
    for k, module in enumerate(model.mtp.values(), start=1):
        valid = seq - k
        h = module(h[:, :valid], embed(batch[:, k : k + valid]), model.model.rope, None)
        want = F.cross_entropy(model.lm_head(module.norm(h)).flatten(0, 1), batch[:, k + 1 :].flatten())
        got = mtp_depth_loss(logits[:, k * seq : (k + 1) * seq], targets[..., k - 1], seq, k)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_the_mtp_modules_live_on_the_last_stage_and_the_embeddings_travel_beside_the_hidden_states():
    cfg = config("--model.mtp_depth=1", "--parallelism.pp=2", "--parallelism.pp_engine=1f1b")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    stages = {rank: split_model(model, cfg, rank)[0][1] for rank in (0, 1)}
    names = {rank: {name for name, _ in stage.named_parameters()} for rank, stage in stages.items()}
    assert not any(name.startswith("mtp.") for name in names[0])
    assert {"mtp.0.eh_proj.weight", "mtp.0.block.self_attn.kv_b_proj.weight"} <= names[1]
    assert "model.embed_tokens.weight" in names[0] and "model.embed_tokens.weight" not in names[1]
    sent = stage_shapes(cfg, 0, None)["output_args"][0]
    assert sent.shape[-1] == 2 * cfg.model.hidden_size  # hidden states, then the MTP tokens' embeddings


@pytest.mark.parametrize(
    "recompute, compiled", [("full", False), ("selective", False), ("none", False), ("full", True)]
)
def test_the_mtp_block_is_checkpointed_regathered_and_compiled_as_the_model_layers_are(recompute, compiled):
    """The MTP module's decoder layer (global index num_layers) gets what each model layer gets in `parallelize`:
    activation checkpointing as parallelism.recompute says for its index (every other layer here), the
    sequence-parallel re-gather where it is not recomputed (eager only), and torch.compile."""
    import torch.distributed as dist

    from nanotron.models.llama import decoder_layers
    from nanotron.parallel.mesh import ParallelContext, build_mesh
    from nanotron.parallel.parallelize import parallelize
    from nanotron.parallel.recompute import recompute_mode
    from nanotron.parallel.regather import _Regather
    from nanotron.parallel.torch_private import fake_process_group, is_checkpointed

    layout = ["--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter", "--parallelism.sp_regather=on"]
    layout += [f"--parallelism.recompute={recompute}", "--parallelism.recompute_every=2"]
    cfg = config("--model.mtp_depth=1", f"--training.compile={str(compiled).lower()}", *layout)
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        ctx = ParallelContext(build_mesh(cfg, "cpu"), torch.device("cpu"), 0, cfg.world_size, 0, 0, 0)
        ((_, model),) = parallelize(cfg, ctx)
    finally:
        dist.destroy_process_group()
    layers = decoder_layers(model)
    assert [index for index, _ in layers] == [0, 1, 2]  # MLA_MODEL's 2 layers, then the MTP block
    for index, layer in layers:
        checkpointed = is_checkpointed(layer)
        regathered = any(isinstance(getattr(hook, "__self__", None), _Regather) for hook in
                         layer.self_attn._forward_pre_hooks.values())  # fmt: skip
        assert checkpointed == (recompute_mode(cfg, index) != "none") == (recompute != "none" and index % 2 == 0)
        assert regathered == (not checkpointed and not compiled), index
        assert (layer._compiled_call_impl is not None) == compiled, index


def test_a_recomputed_mtp_moe_block_counts_each_routed_token_once():
    """The MTP module's MoE block under full recompute: its rerun in backward does not add the step's tokens to the
    expert loads again (which the routing bias learns from), as for the model's MoE layers."""
    from matrix import MOE

    from nanotron.models.llama import decoder_layers
    from nanotron.parallel.recompute import apply_recompute

    cfg = config("--model.mtp_depth=1", *MOE)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, seed=0)
    apply_recompute(model, lambda index: "full")
    batch = torch.randint(0, cfg.model.vocab_size, (2, cfg.training.seq_len + 1))
    tokens, _ = mtp_tokens_and_targets(batch, 1)
    model(batch[:, :-1], mtp_tokens=tokens).float().mean().backward()
    routed = batch[:, :-1].numel() * cfg.model.moe.top_k
    loads = {index: layer.mlp.tokens_per_expert.sum().item() for index, layer in decoder_layers(model) if index}
    assert loads == {1: routed, 2: routed}  # layer 0 is dense (first_dense_layers), 2 is the MTP block


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_the_training_loss_is_main_plus_the_weight_times_the_mean_of_the_depths_losses(weight):
    """loss = main + lambda / D x sum_k L_k, each L_k over the positions that have a target (at lambda = 0 the main
    loss alone: the model trains as without MTP, the modules learn nothing)."""
    seq, depth, vocab = 8, 2, 11
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (2, seq + 1), generator=gen)
    _, extra = mtp_tokens_and_targets(batch, depth)
    targets = torch.cat([batch[:, 1:], *extra.unbind(-1)], dim=1)
    logits = torch.randn(2, (1 + depth) * seq, vocab, generator=gen)
    total, parts = training_loss(logits, targets, None, depth, weight, seq)
    main, mtp = parts["loss"], parts["mtp_loss"]
    want_main = F.cross_entropy(logits[:, :seq].flatten(0, 1), batch[:, 1:].flatten())
    depths = [
        F.cross_entropy(logits[:, k * seq : (k + 1) * seq - k].flatten(0, 1), batch[:, k + 1 :].flatten())
        for k in range(1, depth + 1)
    ]
    torch.testing.assert_close(main, want_main, rtol=1e-6, atol=0)
    torch.testing.assert_close(mtp, sum(depths) / depth, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, want_main + weight * sum(depths) / depth, rtol=1e-6, atol=0)


@pytest.mark.slow  # two 1-process training runs (~25 s on 2 busy cores)
def test_a_run_with_mtp_logs_its_loss_and_resumes_bit_identical(tiny_data, tmp_path):
    """The MTP loss is logged beside the loss every step; a run resumed from its step-1 checkpoint ends
    bit-identical (the MTP module's weights and optimizer state travel with the checkpoint)."""
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=2"]
    common += ["--logging.log_interval=1", "--checkpoint.save_final=false", "--checkpoint.interval=1"]
    common += ["--model.mtp_depth=1"]
    run_train([*common, "--job.name=run"])
    run_train([*common, "--job.name=resumed", f"--checkpoint.resume_from={tmp_path}/run/checkpoints/step-1"])
    logged = [(r["loss"], r["mtp_loss"]) for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(logged) == 2 and all(mtp > 0 for _, mtp in logged)
    assert [(r["loss"], r["mtp_loss"]) for r in read_metrics(tmp_path / "resumed") if "loss" in r] == logged[1:]
    want, got = weights(tmp_path / "run", 2), weights(tmp_path / "resumed", 2)
    assert "mtp.0.eh_proj.weight" in want and all(torch.equal(got[name], w) for name, w in want.items())


def test_document_masking_with_mtp_is_a_one_line_refusal():
    with pytest.raises(ConfigError, match=r"model.mtp_depth > 0 needs model.attention='causal'"):
        config("--model.mtp_depth=1", "--model.attention=document")
