"""A nanotron checkpoint -> a Hugging Face folder (`nanotron convert to-hf`): config.json, safetensors (sharded
by size) and the tokenizer, which `transformers` loads unchanged."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanotron.checkpoint.full_model import check_tokenizer_flag, expected_shapes, tokenizer_source
from nanotron.checkpoint.layout import find_checkpoint
from nanotron.checkpoint.safe_io import read_model_weights, verified_checkpoint
from nanotron.config import read_model_config
from nanotron.errors import CheckpointError, UserError
from nanotron.hf import deepseek_v3, mixtral, qwen3, smollm3
from nanotron.hf.llama import hf_config
from nanotron.io import check_new_folder, check_not_input
from nanotron.models.parametrization import fold_multipliers, is_mup
from nanotron.tokenize.tokenizer import copy_tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*$", re.IGNORECASE)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--max_shard_size: expected a size like 5GB, 500MB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, split into files of at most max_bytes (a bigger tensor gets a file to itself)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def to_hf(
    checkpoint: Path,
    out: Path,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    tokenizer: Path | None = None,
    allow_unverified: bool = False,
) -> Path:
    """Writes the HF folder `out` from a nanotron checkpoint; returns the step dir that was exported."""
    max_bytes = parse_size(max_shard_size)
    check_tokenizer_flag(tokenizer)
    step_dir = find_checkpoint(checkpoint)
    check_not_input("OUT_DIR", out, [step_dir, *([tokenizer] if tokenizer else [])])
    check_new_folder(out)  # before the weights are read (minutes at 70B); again before writing
    step_dir = verified_checkpoint(step_dir, allow_unverified)
    model = read_model_config(step_dir / "config.toml")
    expected = expected_shapes(model)
    weights = read_model_weights(step_dir, expected)
    weights, tied = fold_multipliers(model, weights)
    if is_mup(model):
        untied = tied != model.tie_word_embeddings
        note = "; lm_head exported untied (a weight shared with the embedding can't take the logit multiplier)"
        print(f"µP: attention, residual and logit multipliers folded into the weights{note if untied else ''}")
    names = [n for n in expected if not (tied and n == "lm_head.weight")]
    tensors = {name: weights[name] for name in names}
    if model.mtp_depth and not model.mla:
        raise CheckpointError(
            f"model.mtp_depth={model.mtp_depth}: multi-token prediction exports only in DeepSeek-V3's format (a model "
            "with multi-head latent attention, model.kv_lora_rank > 0); Llama, Qwen3 and Mixtral files have no place "
            "for it"
        )
    smollm3.check_exportable(model)
    if model.mla:  # DeepSeek-V3, with or without its MoE
        deepseek_v3.check_exportable(model)
        tensors = deepseek_v3.to_hf(model, tensors)
    elif model.moe.enabled:  # Qwen3-MoE with QK-norm, else Mixtral
        names = qwen3.EXPERT_FILES if model.qk_norm else mixtral.MIXTRAL
        mixtral.check_exportable(model, tensors, names)
        tensors = mixtral.to_hf(tensors, model.moe.num_experts, names)
    tensors = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in tensors.items()}
    check_new_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    source_tokenizer = tokenizer or (step_dir / "tokenizer")
    eos_id = _export_tokenizer(source_tokenizer, out, tokenizer_source(step_dir, tokenizer))
    config = hf_config(model, DTYPES[dtype], eos_id, tied)
    if model.mla:
        config |= deepseek_v3.hf_config(model)
    elif model.qk_norm:
        config |= qwen3.hf_config(model)
    elif model.nope_layers:
        config |= smollm3.hf_config(model)
    elif model.moe.enabled:
        config |= mixtral.hf_config(model)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = shard(tensors, max_bytes)
    if len(shards) == 1:
        _save_safetensors(tensors, out / "model.safetensors")
        return step_dir
    weight_map = {}
    for index, part in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(part, out / file)
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return step_dir


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """save_file, with the permissions of any new file (0644 under the usual umask; safetensors makes it 0600),
    so others on a shared cluster can read the export."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _export_tokenizer(source: Path, out: Path, what: str) -> int | None:
    """Copies the tokenizer; adds a tokenizer_config.json naming EOS when it lacks one (AutoTokenizer needs it)."""
    if not source.exists():
        print(f"warning: no tokenizer at '{source}'; the export has none (pass --tokenizer)", file=sys.stderr)
        return None
    try:
        tok = load_tokenizer(str(source), what=what)
    except UserError as error:
        raise CheckpointError(str(error)) from None
    copy_tokenizer(source, out)
    if not (out / "tokenizer_config.json").is_file():
        eos = tok.backend.id_to_token(tok.eos_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.eos_id
