"""Text from a checkpoint, to see what it learned:

    python -m nanotron.generate --checkpoint runs/tiny [--prompt "To be"] [--max_new_tokens 50]
                                [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0]

--checkpoint is a step-N dir, a checkpoint dir or a run dir (their latest). Greedy decoding unless
--temperature > 0, which samples (optionally restricted by --top_k / --top_p). Generation stops at
--max_new_tokens or at the EOS token. One process, any layout the checkpoint was saved with.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from nanotron.checkpoint import read_model_weights, verified_checkpoint
from nanotron.config import read_model_config
from nanotron.convert import UNVERIFIED_HELP, expected_shapes, tokenizer_source
from nanotron.errors import CheckpointError, UserError, run_command
from nanotron.models.llama import LlamaForCausalLM
from nanotron.tokenizer import Tokenizer, load_tokenizer


def load_model(
    checkpoint: Path, device: torch.device | str = "cpu", allow_unverified: bool = False
) -> tuple[LlamaForCausalLM, Path]:
    """The full model of a checkpoint in eval mode, and the step dir it came from."""
    step_dir = verified_checkpoint(checkpoint, allow_unverified)
    config = read_model_config(step_dir / "config.toml")
    weights = read_model_weights(step_dir, expected_shapes(config))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    model.init_buffers(device)  # first: the state dict then sets the buffers it holds (MoE routing biases)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"'{step_dir}' does not match its config.toml ({str(error).splitlines()[0]})") from None
    return model.eval(), step_dir


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """Greedy at temperature 0; otherwise a draw from the softmax restricted to the top-k / nucleus."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is already full
        logits = logits.scatter(0, order[outside], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt_ids`; the context is cut to the model's max_seq_len (no KV cache)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    window = model.config.max_seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        next_id = sample_next(model(context)[0, -1], temperature, top_k, top_p, generator)
        ids.append(next_id)
        if next_id == eos_id:
            break
    return ids[len(prompt_ids) :]


def check_sampling(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens: expected a positive integer, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature: expected a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top_k: expected >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p: expected a value in (0, 1], got {args.top_p}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise UserError("--top_k/--top_p only apply when sampling: add --temperature (e.g. 0.8)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanotron.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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


if __name__ == "__main__":
    sys.exit(main())
