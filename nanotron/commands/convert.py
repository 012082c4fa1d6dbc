"""Hugging Face interop: export a checkpoint to `transformers` Llama (Mixtral for a mixture of experts, see
`nanotron.hf.mixtral`; Qwen3 or Qwen3-MoE with QK-norm, `nanotron.hf.qwen3`; SmolLM3 with NoPE layers,
`nanotron.hf.smollm3`; DeepSeek-V3 with multi-head latent attention, `nanotron.hf.deepseek_v3`), import HF Llama,
Mixtral, Qwen3, Qwen3-MoE, SmolLM3 or DeepSeek-V3 weights for training.

    nanotron convert to-hf   CHECKPOINT OUT_DIR [--dtype bfloat16] [--max_shard_size 5GB]
    nanotron convert from-hf HF_DIR CKPT_DIR

to-hf reads a step-N dir (or a checkpoint/run dir: its latest) in one process, whatever layout saved it,
and writes config.json, model.safetensors (or shards plus model.safetensors.index.json) and the
tokenizer saved with the checkpoint: `LlamaForCausalLM.from_pretrained(OUT_DIR)` loads it unchanged.
A µP checkpoint's multipliers are folded into its weights (HF's Llama has none); a tied embedding whose
logits have a multiplier is exported untied. from-hf always imports standard parametrization.
from-hf writes a DCP checkpoint holding only model weights, its [model] config and the tokenizer (when the
folder has a tokenizer.json; a warning says when not); every config.json field it reads is checked. Start
training from it with `--checkpoint.init_from=CKPT_DIR` and the [model] settings of CKPT_DIR/config.toml,
at any dp/tp/pp. Parameter names are the same on both sides (nanotron's model uses HF's names).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanotron.commands.args import UNVERIFIED_HELP, Parser
from nanotron.errors import run_command
from nanotron.hf.export import DTYPES, to_hf
from nanotron.hf.importer import from_hf


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="nanotron convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("to-hf", help="nanotron checkpoint -> Hugging Face folder")
    export.add_argument("checkpoint", type=Path, help="step-N dir, or a checkpoint/run dir (its latest)")
    export.add_argument("out_dir", type=Path, help="new folder for config.json, safetensors and tokenizer")
    export.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights")
    export.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    export.add_argument("--tokenizer", type=Path, help="tokenizer dir/file to ship instead of the checkpoint's")
    export.add_argument("--allow_unverified", action="store_true", help=UNVERIFIED_HELP)
    imp = commands.add_parser(
        "from-hf",
        help="Hugging Face Llama, Mixtral, Qwen3(-MoE) or DeepSeek-V3 folder -> checkpoint for init_from",
    )
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
    if not tokenizer.is_dir():
        print(
            f"warning: '{args.hf_dir}' has no tokenizer.json, so the import has no tokenizer: train with "
            "--data.tokenizer=<this model's tokenizer.json>, and pass --tokenizer to generate and to-hf",
            file=sys.stderr,
        )
    print(
        f"imported {args.hf_dir} -> {args.ckpt_dir} (standard parametrization); train with "
        f"--checkpoint.init_from={args.ckpt_dir} and the [model] settings of {args.ckpt_dir / 'config.toml'}"
        + (f" (tokenizer: --data.tokenizer={tokenizer})" if tokenizer.is_dir() else "")
    )
    return 0
