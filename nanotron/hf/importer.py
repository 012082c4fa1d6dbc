"""A Hugging Face Llama, Mixtral, Qwen3, Qwen3-MoE, SmolLM3 or DeepSeek-V3 folder -> a weights-only nanotron checkpoint
(`nanotron convert from-hf`), to start training from with `checkpoint.init_from` at any layout."""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open

from nanotron import records
from nanotron.checkpoint import integrity
from nanotron.checkpoint.full_model import expected_shapes
from nanotron.checkpoint.layout import publish
from nanotron.config import ModelConfig, toml_text
from nanotron.errors import CheckpointError
from nanotron.hf import deepseek_v3, mixtral, qwen3
from nanotron.hf.llama import model_config_from_hf
from nanotron.io import check_new_folder, check_not_input
from nanotron.tokenize.tokenizer import copy_tokenizer


@dataclass(frozen=True)
class _WeightMap(records.Check):
    """An index's weight_map: tensor name -> the shard's file name."""

    expected: str = "an object mapping tensor names to shard file names"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict) and all(isinstance(file, str) for file in value.values())


SAFETENSORS_INDEX = {"weight_map": _WeightMap()}


def read_hf_weights(hf_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from model.safetensors or its shards (via the index)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        hint = "save the model again (transformers' save_pretrained writes a valid one)"
        weight_map = records.read(index, SAFETENSORS_INDEX, CheckpointError, hint)["weight_map"]
    elif (hf_dir / "model.safetensors").is_file():
        weight_map = None
    else:
        raise CheckpointError(
            f"'{hf_dir}' has no model.safetensors or model.safetensors.index.json (only safetensors weights import)"
        )
    by_file: dict[str, list[str]] = {}
    for name in names:
        file = "model.safetensors" if weight_map is None else weight_map.get(name)
        if file is None:
            raise CheckpointError(f"'{index}' has no entry for {name}")
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, wanted in by_file.items():
        path = hf_dir / file
        if Path(file).name != file or not path.is_file():  # a FIFO or device would block or never end
            raise CheckpointError(f"'{index}' names '{file}', which is not a regular file in '{hf_dir}'")
        try:
            with safe_open(path, framework="pt") as f:
                present = set(f.keys())
                for name in wanted:
                    if name not in present:
                        raise CheckpointError(f"'{path}' has no tensor {name}")
                    tensors[name] = f.get_tensor(name)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"'{path}' is missing or not a safetensors file ({error})") from None
    return tensors


def stored_names(hf_dir: Path) -> set[str]:
    """The tensor names of an HF folder (from its index, or its one safetensors file); empty if unreadable (the
    read that follows names the problem)."""
    try:
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
            return set(f.keys())
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return set()


def from_hf(hf_dir: Path, out: Path) -> ModelConfig:
    """Writes a weights-only DCP checkpoint (fp32, for training) plus config.toml and the tokenizer."""
    check_not_input("CKPT_DIR", out, [hf_dir])
    check_new_folder(out)  # before the weights are read (minutes at 70B); again before writing
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"'{config_file}' not found: '{hf_dir}' is not a Hugging Face model dir")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"'{config_file}' is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{config_file}' is not a JSON object (found a {type(config).__name__})")
    model = model_config_from_hf(config, config_file)
    if model.mtp_depth and not deepseek_v3.mtp_layers_stored(model, stored_names(hf_dir)):
        print(
            f"num_nextn_predict_layers={model.mtp_depth} but '{hf_dir}' holds no multi-token prediction layers "
            "(transformers saves none): imported without them (model.mtp_depth = 0)"
        )
        model.mtp_depth = 0
    expected = expected_shapes(model)
    stored = [n for n in expected if not (model.tie_word_embeddings and n == "lm_head.weight")]
    if model.mla:  # DeepSeek-V3 (its MoE too)
        wanted = {n: expected[n] for n in stored}
        stacked = f"model.layers.{model.moe.first_dense_layers}.mlp.experts.down_proj" in stored_names(hf_dir)
        files = read_hf_weights(hf_dir, deepseek_v3.file_names(model, wanted, stacked))
        weights = deepseek_v3.from_hf(model, files, wanted, config.get("rope_interleave", True))
    elif model.moe.enabled:
        names = qwen3.EXPERT_FILES if model.qk_norm else mixtral.MIXTRAL
        stacked = f"model.layers.{model.moe.first_dense_layers}.mlp.experts.down_proj" in stored_names(hf_dir)
        files = read_hf_weights(hf_dir, mixtral.file_names(expected, model.moe.num_experts, stacked, names))
        weights = mixtral.from_hf(files, {n: expected[n] for n in stored}, model.moe.num_experts, names)
    else:
        weights = read_hf_weights(hf_dir, stored)
    for name in stored:
        if weights[name].shape != expected[name]:
            raise CheckpointError(
                f"'{hf_dir}': {name} has shape {list(weights[name].shape)}, but config.json "
                f"implies {list(expected[name])}"
            )
    state = {name: weights[name].to(torch.float32) for name in stored}
    if model.tie_word_embeddings:  # a trainer's state dict lists the tied head too: keep the keys the same
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # ours alone to remove
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / "config.toml").write_text(toml_text({"model": asdict(model)}))
        if (hf_dir / "tokenizer.json").is_file():  # its settings alone are no tokenizer here (see convert's note)
            copy_tokenizer(hf_dir, tmp / "tokenizer")
        integrity.write(tmp, integrity.shard_checksums(tmp))
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model
