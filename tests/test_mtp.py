"""Multi-token prediction (`model.mtp_depth`, DeepSeek-V3 section 2.2): each depth predicts the token after the one
it embeds, the MTP modules live on the last pipeline stage with the embeddings carried to it, the loss weight acts,
and a run resumes exactly. The layout rows (tp, pp, dp + ep, cp held to one process) are in test_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, read_metrics, run_train, train_losses
from matrix import MLA_MODEL, weights

from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.init import init_weights
from nanotron.parallel.pipeline import split_model, stage_shapes
from nanotron.parallel.runner import mtp_depth_loss, mtp_tokens_and_targets


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


@pytest.mark.slow  # four 1-process training runs (~45 s on 2 busy cores)
def test_the_loss_weight_acts_zero_trains_the_model_as_without_mtp_and_a_resume_is_exact(tiny_data, tmp_path):
    """lambda = 0: the MTP module learns nothing and the model trains exactly as without it (its parameters have
    their own init seeds); lambda > 0 changes the model's second step. The MTP loss is logged beside the loss; a
    run resumed from its step-1 checkpoint ends bit-identical (MTP weights and optimizer state included)."""
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=2"]
    common += ["--logging.log_interval=1", "--checkpoint.save_final=false", "--checkpoint.interval=1"]
    mtp = ["--model.mtp_depth=1"]
    runs = {
        "off": [],
        "zero": [*mtp, "--training.mtp_loss_weight=0"],
        "on": [*mtp, "--training.mtp_loss_weight=1"],
        "resumed": [*mtp, "--training.mtp_loss_weight=1", f"--checkpoint.resume_from={tmp_path}/on/checkpoints/step-1"],
    }
    for name, extra in runs.items():
        run_train([*common, f"--job.name={name}", *extra])
    off, on = train_losses(tmp_path / "off"), train_losses(tmp_path / "on")
    assert train_losses(tmp_path / "zero") == off
    assert on[0] == off[0] and on[1] != off[1]
    logged = [r["mtp_loss"] for r in read_metrics(tmp_path / "on") if "mtp_loss" in r]
    assert len(logged) == 2 and all(value > 0 for value in logged)
    assert not any("mtp_loss" in r for r in read_metrics(tmp_path / "off"))
    resumed = [r for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    assert [(r["loss"], r["mtp_loss"]) for r in resumed] == [(on[1], logged[1])]
    want, got = weights(tmp_path / "on", 2), weights(tmp_path / "resumed", 2)
    assert "mtp.0.eh_proj.weight" in want and all(torch.equal(got[name], w) for name, w in want.items())


def test_document_masking_with_mtp_is_a_one_line_refusal():
    with pytest.raises(ConfigError, match=r"model.mtp_depth > 0 needs model.attention='causal'"):
        config("--model.mtp_depth=1", "--model.attention=document")
