"""Text from a checkpoint, to see what it learned:

    nanotron generate --checkpoint runs/tiny [--prompt "To be"] [--max_new_tokens 50]
                                [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0]

--checkpoint is a step-N dir, a checkpoint dir or a run dir (their latest). Greedy decoding unless
--temperature > 0, which samples (optionally restricted by --top_k / --top_p). Generation stops at
--max_new_tokens or at the EOS token. One process, any layout the checkpoint was saved with.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from nanotron.checkpoint.full_model import check_tokenizer_flag, load_model, tokenizer_source
from nanotron.commands.args import UNVERIFIED_HELP, Parser
from nanotron.errors import CheckpointError, UserError, run_command
from nanotron.models.generate import generate
from nanotron.tokenize.tokenizer import Tokenizer, load_tokenizer


def check_sampling(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens: expected a positive integer, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature: expected a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top_k: expected >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p: expected a value in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**64:  # what torch.Generator.manual_seed takes, without its wrap of negatives
        raise UserError(f"--seed: expected an integer in [0, 2**64), got {args.seed}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise UserError("--top_k/--top_p only apply when sampling: add --temperature (e.g. 0.8)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="nanotron generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="step-N dir, or a checkpoint/run dir")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start after an EOS token)")
    parser.add_argument("--max_new_tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sample within this probability mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer to use instead of the checkpoint's copy")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--allow_unverified", action="store_true", help=UNVERIFIED_HELP)
    return parser


def load_checkpoint_tokenizer(step_dir: Path, override: Path | None) -> Tokenizer:
    path = override or step_dir / "tokenizer"
    if not path.exists():
        raise CheckpointError(f"'{path}' not found: the checkpoint has no tokenizer copy; pass --tokenizer")
    return load_tokenizer(str(path), what=tokenizer_source(step_dir, override))


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_sampling(args)
    check_tokenizer_flag(args.tokenizer)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu")
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    model, step_dir = load_model(args.checkpoint, device, args.allow_unverified)
    tokenizer = load_checkpoint_tokenizer(step_dir, args.tokenizer)
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eos_id]
    new_ids = generate(
        model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, tokenizer.eos_id
    )
    print(args.prompt + tokenizer.decode(new_ids), flush=True)
    return 0
