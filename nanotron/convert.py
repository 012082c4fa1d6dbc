"""Hugging Face interop: export a checkpoint to `transformers` Llama (Mixtral for a mixture of experts, see
`nanotron.hf_mixtral`), import HF Llama or Mixtral weights for training.

    python -m nanotron.convert to-hf   CHECKPOINT OUT_DIR [--dtype bfloat16] [--max_shard_size 5GB]
    python -m nanotron.convert from-hf HF_DIR CKPT_DIR

to-hf reads a step-N dir (or a checkpoint/run dir: its latest) in one process, whatever layout saved it,
and writes config.json, model.safetensors (or shards plus model.safetensors.index.json) and the
tokenizer saved with the checkpoint: `LlamaForCausalLM.from_pretrained(OUT_DIR)` loads it unchanged.
A µP checkpoint's multipliers are folded into its weights (HF's Llama has none); a tied embedding whose
logits have a multiplier is exported untied. from-hf always imports standard parametrization.
from-hf writes a DCP checkpoint holding only model weights, its [model] config and the tokenizer; start
training from it with `--checkpoint.init_from=CKPT_DIR` and the [model] settings of CKPT_DIR/config.toml,
at any dp/tp/pp. Parameter names are the same on both sides (nanotron's model uses HF's names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanotron import hf_mixtral
from nanotron.checkpoint import integrity, read_model_weights, verified_checkpoint
from nanotron.config import ModelConfig, read_model_config, toml_text
from nanotron.config.validate import resolve_model
from nanotron.errors import CheckpointError, ConfigError, UserError, run_command
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.parametrization import fold_multipliers, is_mup
from nanotron.tokenizer import copy_tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def expected_shapes(model: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter name and shape of the model (built on the meta device: no memory)."""
    with torch.device("meta"):
        module = LlamaForCausalLM(model)
    return {name: tensor.shape for name, tensor in module.state_dict().items()}


# ---- export ----------------------------------------------------------------------------------------


def hf_config(model: ModelConfig, dtype: torch.dtype, eos_id: int | None, tied: bool) -> dict:
    """config.json of transformers' LlamaConfig (keys of 4.x and 5.x, so either version loads it)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


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


def _empty_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output '{out}' already exists and is not an empty folder; choose a new path")


UNVERIFIED_HELP = "read a checkpoint that has no checksums.json (its files are then not checked for corruption)"


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
    step_dir = verified_checkpoint(checkpoint, allow_unverified)
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
    if model.moe.enabled:
        hf_mixtral.check_exportable(model, tensors)
        tensors = hf_mixtral.to_hf(tensors, model.moe.num_experts)
    tensors = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in tensors.items()}
    _empty_output(out)
    out.mkdir(parents=True, exist_ok=True)
    source_tokenizer = tokenizer or (step_dir / "tokenizer")
    eos_id = _export_tokenizer(source_tokenizer, out, tokenizer_source(step_dir, tokenizer))
    config = hf_config(model, DTYPES[dtype], eos_id, tied)
    config |= hf_mixtral.hf_config(model) if model.moe.enabled else {}
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


def tokenizer_source(step_dir: Path, override: Path | None) -> str:
    """How errors name the tokenizer a checkpoint reader uses (export, generate): the command's own --tokenizer,
    or the checkpoint's copy; never train's data.tokenizer, an option these commands don't have."""
    return "--tokenizer" if override else f"the tokenizer saved in {step_dir}"


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


# ---- import ----------------------------------------------------------------------------------------


def model_config_from_hf(config: dict, where: Path) -> ModelConfig:
    """The nanotron [model] of an HF Llama config.json; anything our Llama can't express is an error."""

    def unsupported(what: str) -> CheckpointError:
        return CheckpointError(
            f"'{where}': {what}; only plain Llama or Mixtral (no biases, SiLU, default RoPE) imports"
        )

    if config.get("model_type") not in ("llama", "mixtral"):
        raise unsupported(f"model_type is {config.get('model_type')!r}, not 'llama' or 'mixtral'")
    moe = hf_mixtral.model_fields(config) if config["model_type"] == "mixtral" else {}
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise unsupported("attention_bias/mlp_bias are set")
    if config.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act is {config.get('hidden_act')!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise unsupported(f"rope settings {rope!r} are not a table")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise unsupported(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is set")
    try:
        heads = int(config["num_attention_heads"])
        model = ModelConfig(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)),
        )
        for key, value in moe.items():
            setattr(model.moe, key, value)
        resolve_model(model)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"'{where}' lacks a usable Llama field ({type(error).__name__}: {error})") from None
    except ConfigError as error:
        raise CheckpointError(f"'{where}' describes no valid Llama: {error}") from None
    if config.get("head_dim") not in (None, model.head_dim):
        raise unsupported(f"head_dim={config['head_dim']} differs from hidden_size/num_attention_heads")
    return model


def read_hf_weights(hf_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from model.safetensors or its shards (via the index)."""
    index = hf_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(
                f"'{hf_dir}' has no model.safetensors or model.safetensors.index.json (only safetensors weights import)"
            )
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"'{index}' is not a safetensors index ({error})") from None
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
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"'{config_file}' not found: '{hf_dir}' is not a Hugging Face model dir")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise CheckpointError(f"'{config_file}' is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{config_file}' is not a JSON object (found a {type(config).__name__})")
    model = model_config_from_hf(config, config_file)
    expected = expected_shapes(model)
    stored = [n for n in expected if not (model.tie_word_embeddings and n == "lm_head.weight")]
    if model.moe.enabled:
        stacked = "model.layers.0.mlp.experts.down_proj" in stored_names(hf_dir)
        files = read_hf_weights(hf_dir, hf_mixtral.file_names(expected, model.moe.num_experts, stacked))
        weights = hf_mixtral.from_hf(files, {n: expected[n] for n in stored}, model.moe.num_experts)
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
    _empty_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # ours alone to remove
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / "config.toml").write_text(toml_text({"model": asdict(model)}))
        copy_tokenizer(hf_dir, tmp / "tokenizer")
        integrity.write(tmp, integrity.shard_checksums(tmp))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


# ---- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanotron.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("to-hf", help="nanotron checkpoint -> Hugging Face folder")
    export.add_argument("checkpoint", type=Path, help="step-N dir, or a checkpoint/run dir (its latest)")
    export.add_argument("out_dir", type=Path, help="new folder for config.json, safetensors and tokenizer")
    export.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights")
    export.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    export.add_argument("--tokenizer", type=Path, help="tokenizer dir/file to ship instead of the checkpoint's")
    export.add_argument("--allow_unverified", action="store_true", help=UNVERIFIED_HELP)
    imp = commands.add_parser("from-hf", help="Hugging Face Llama folder -> checkpoint for checkpoint.init_from")
    imp.add_argument("hf_dir", type=Path, help="local folder with config.json and safetensors weights")
    imp.add_argument("ckpt_dir", type=Path, help="new folder for the DCP checkpoint")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "to-hf":
        step_dir = to_hf(
            args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.tokenizer, args.allow_unverified
        )
        print(f"exported {step_dir} -> {args.out_dir} (load with AutoModelForCausalLM.from_pretrained)")
        return 0
    from_hf(args.hf_dir, args.ckpt_dir)
    tokenizer = args.ckpt_dir / "tokenizer"
    print(
        f"imported {args.hf_dir} -> {args.ckpt_dir} (standard parametrization); train with "
        f"--checkpoint.init_from={args.ckpt_dir} and the [model] settings of {args.ckpt_dir / 'config.toml'}"
        + (f" (tokenizer: --data.tokenizer={tokenizer})" if tokenizer.is_dir() else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
