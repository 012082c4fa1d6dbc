"""What nanotron's trainer costs over a minimal PyTorch loop, and how it compares with transformers.

    python -m benchmarks.overhead [--sizes tiny,small] [--steps 15] [--repeats 3] [--quick]

The implementations train the same model config from the same initial weights on the same batches
with the same AdamW and grad clipping, in one process with one math thread each:
  nanotron          `python -m nanotron.train` (step times from its metrics.jsonl), eager
  pytorch           a hand-written loop over nanotron's own `LlamaForCausalLM` (no Trainer)
  transformers      the same loop over `transformers.LlamaForCausalLM` with the same weights (SDPA attention)
  nanotron compile  nanotron with training.compile=true (torch.compile per decoder layer)
Each run is a fresh process; runs are interleaved round by round (rotating the order) so load drifting
on shared cores hits all alike, and each implementation's step time is the best of its per-round
medians. The step losses must agree (same math), which the table shows as max |loss - pytorch loss|.
`--profile DIR` writes a torch.profiler trace per implementation (same schedule as nanotron's
`profiler.*` keys); `python -m benchmarks.trace_summary DIR/*/*.json` compares where the time goes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_env,
    bench_parser,
    ensure_data,
    median_after_warmup,
    model_overrides,
    run_nanotron,
    write_table,
)

IMPLEMENTATIONS = ("nanotron", "pytorch", "transformers", "nanotron compile")
COLUMNS = (
    "size",
    "params_m",
    "implementation",
    "step_time_sec",
    "tokens_per_sec",
    "vs_pytorch",
    "vs_nanotron",
    "round_medians",
    "max_loss_diff",
)


def run_args(size: str, steps: int, global_batch: int, data: list[str]) -> list[str]:
    """The nanotron command-line arguments all three implementations read their setup from."""
    return [
        *QUIET_RUN,
        *data,
        *model_overrides(size),
        f"--training.steps={steps}",
        f"--training.global_batch_size={global_batch}",
        f"--training.micro_batch_size={global_batch}",
        "--training.grad_accum_steps=0",
    ]


def loop_worker(implementation: str, args: list[str], out: Path) -> None:
    """The minimal loop: batches from nanotron's loader (so the data is identical), forward, loss,
    backward, clip, AdamW step; `loss.item()` ends the step as nanotron's logging does."""
    import torch
    import torch.nn.functional as F

    from nanotron.config import load_config, parse_overrides
    from nanotron.data import open_corpus
    from nanotron.data.loader import build_train_loader
    from nanotron.metrics.profiler import Profiler
    from nanotron.models.llama import LlamaForCausalLM
    from nanotron.optim import build_optimizer
    from nanotron.parallel.init import init_weights
    from nanotron.parallel.mesh import pick_device

    cfg = load_config(*parse_overrides(args))
    t, device = cfg.training, pick_device(cfg)
    torch.manual_seed(cfg.job.seed)
    corpus = open_corpus(cfg)
    loader = iter(build_train_loader(corpus, t, seed=cfg.job.seed, dp=1, dp_rank=0))
    batches = [torch.cat([next(loader) for _ in range(t.grad_accum_steps)]) for _ in range(t.steps)]

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    model.to_empty(device=device)
    init_weights(model, cfg.job.seed)
    if implementation == "transformers":
        model = hf_model(cfg.model, model.state_dict(), device)
    optimizer = build_optimizer(model, cfg.optimizer, device, cfg.model)  # plain AdamW, no decay on norms/embeddings

    def logits(inputs: torch.Tensor) -> torch.Tensor:
        out = model(inputs)
        return out.logits if implementation == "transformers" else out

    profiler = Profiler.start(cfg.profiler, device, implementation, enabled=True)  # nanotron's: traces compare 1:1
    times, losses = [], []
    for batch in batches:
        start = time.perf_counter()
        batch = batch.to(device)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batch.chunk(t.grad_accum_steps):
            loss = F.cross_entropy(logits(micro[:, :-1]).flatten(0, 1).float(), micro[:, 1:].flatten())
            (loss / t.grad_accum_steps).backward()
            total += loss.item() / t.grad_accum_steps
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(total)
        profiler.step()
    profiler.stop()
    out.write_text(json.dumps({"step_time_sec": times, "loss": losses}))


def hf_model(model_cfg, state_dict: dict, device):
    """transformers' Llama with nanotron's weights: parameter names are identical by design."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_seq_len,
        rope_theta=model_cfg.rope_theta,
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device)
    model.load_state_dict(state_dict, strict=True)
    return model.train()


def run_once(implementation: str, args: list[str], steps: int, work_dir: Path, name: str) -> dict:
    """One fresh process of one implementation: its per-step times and losses."""
    if implementation.startswith("nanotron"):
        compile_flag = [f"--training.compile={implementation == 'nanotron compile'}"]
        records = run_nanotron(name, [*args, *compile_flag], 1, work_dir, steps)
        return {"step_time_sec": [r["step_time_sec"] for r in records], "loss": [r["loss"] for r in records]}
    out = work_dir / "runs" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.overhead", "--worker", implementation, "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{implementation} loop failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def measure(size: str, implementations: list[str], settings: argparse.Namespace) -> list[dict]:
    """Interleaved rounds for one model size (settings: the parsed command line); a row per implementation."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.models.shapes import num_params

    args = run_args(size, settings.steps, settings.global_batch, ensure_data(settings.work_dir))
    cfg = load_config(*parse_overrides(args))
    medians: dict[str, list[float]] = {impl: [] for impl in implementations}
    losses: dict[str, list[float]] = {}
    for round_index in range(settings.repeats):
        shift = round_index % len(implementations)
        for impl in implementations[shift:] + implementations[:shift]:
            name = f"overhead-{size}-{impl}".replace(" ", "_")
            traces = [f"--profiler.export_path={settings.profile / name}"] if settings.profile else []
            result = run_once(impl, [*args, *traces], settings.steps, settings.work_dir, name)
            medians[impl].append(median_after_warmup(result["step_time_sec"], settings.warmup))
            losses[impl] = result["loss"]
            print(f"  {size} round {round_index + 1}/{settings.repeats} {impl:16s} {medians[impl][-1]:.4f} s/step")
    best = {impl: min(values) for impl, values in medians.items()}
    tokens_per_step = settings.global_batch * cfg.training.seq_len
    return [
        {
            "size": size,
            "params_m": num_params(cfg.model) / 1e6,
            "implementation": impl,
            "step_time_sec": best[impl],
            "tokens_per_sec": tokens_per_step / best[impl],
            "vs_pytorch": best[impl] / best["pytorch"],
            "vs_nanotron": best[impl] / best["nanotron"],
            "round_medians": " ".join(f"{m:.4f}" for m in medians[impl]),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses[impl], losses["pytorch"])),
        }
        for impl in implementations
    ]


def ratio_lines(rows: list[dict]) -> list[str]:
    """The ratios the benchmark issue sets targets for, per model size."""
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        best = {r["implementation"]: r["step_time_sec"] for r in rows if r["size"] == size}
        overhead = best["nanotron"] / best["pytorch"]
        lines.append(
            f"{size}: nanotron / pytorch step time = {overhead:.3f} (target <= 1.05): "
            + ("met" if overhead <= 1.05 else "MISSED")
        )
        for impl in ("nanotron", "nanotron compile"):
            if impl in best:
                speedup = best["transformers"] / best[impl]
                lines.append(
                    f"{size}: transformers / {impl} step time = {speedup:.3f} (target >= 1.2): "
                    + ("met" if speedup >= 1.2 else "MISSED")
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("overhead", __doc__)
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated benchmarks.common.MODELS keys")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best round counts)")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step (one microbatch)")
    parser.add_argument(
        "--profile",
        type=Path,
        help="also write torch.profiler traces of every run to this folder (profiled timings run slower)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke-test settings: nano model, eager, 4 steps")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for overhead.csv/.md (a worker's JSON)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    parser.add_argument("--worker", choices=("pytorch", "transformers"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker:
        loop_worker(args.worker, rest, args.out)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    implementations = args.implementations.split(",")
    if args.quick:
        args.sizes, args.steps, args.warmup, args.repeats, args.global_batch = "nano", 4, 1, 1, 4
        implementations = list(IMPLEMENTATIONS[:3])
    if not {"nanotron", "pytorch", "transformers"} <= set(implementations) <= set(IMPLEMENTATIONS):
        parser.error(f"--implementations: needs nanotron, pytorch and transformers, from {', '.join(IMPLEMENTATIONS)}")
    rows = [row for size in args.sizes.split(",") for row in measure(size, implementations, args)]
    markdown = write_table(rows, COLUMNS, args.out / "overhead")
    lines = ratio_lines(rows)
    (args.out / "overhead.md").write_text(markdown + "\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    print(markdown)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
