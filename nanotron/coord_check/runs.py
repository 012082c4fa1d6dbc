"""The coordinate check's runs: the config's model family, one `nanotron train` per (size, parametrization,
seed) at the config's layout, and what is measured from each (its metrics and its step-0/step-T checkpoints)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import Config, MupBase
from nanotron.errors import ConfigError, UserError

ACTIVATIONS = ("embed", "attn", "mlp", "residual", "norm", "logits")
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed")


@dataclass(frozen=True)
class Member:
    """One model of the family: its shape overrides."""

    width: int
    depth: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def overrides(self) -> list[str]:
        return [
            f"--model.hidden_size={self.width}",
            f"--model.intermediate_size={self.intermediate}",
            f"--model.num_layers={self.depth}",
            f"--model.num_heads={self.heads}",
            f"--model.num_kv_heads={self.kv_heads}",
            f"--model.head_dim={self.head_dim}",  # a resolved config states the base's
        ]

    def as_base(self) -> list[str]:
        shape = dict(hidden=self.width, intermediate=self.intermediate, heads=self.heads, kv_heads=self.kv_heads)
        shape |= dict(head_dim=self.head_dim, layers=self.depth)
        return [f"--model.mup_base.{key}={value}" for key, value in shape.items()]


def family(cfg: Config, width: int, depth: int, fixed_head_dim: bool, kv_heads: int = 0) -> Member:
    """The member of the config's family at (width, depth); a shape the family cannot take is one line.
    `kv_heads` > 0 fixes the K/V head count (with a fixed head dim: a fixed K/V width, grouped-query attention
    whose K/V projections only gain fan-in); 0 keeps the config's query heads per K/V head."""
    m = cfg.model
    if (m.intermediate_size * width) % m.hidden_size:
        raise ConfigError(
            f"--widths: {width} x the config's MLP ratio {m.intermediate_size}/{m.hidden_size} is not a whole "
            "intermediate_size; pick widths that keep it whole"
        )
    group = m.num_heads // m.num_kv_heads
    heads = width // m.head_dim if fixed_head_dim else m.num_heads
    if width % heads or (width // heads) % 2 or heads % group or heads == 0:
        raise ConfigError(
            f"--widths: width {width} cannot hold {'heads of ' + str(m.head_dim) if fixed_head_dim else heads} "
            f"(an even head dim, {group} query heads per K/V head); pick widths that are multiples of "
            f"{m.head_dim * group if fixed_head_dim else 2 * m.num_heads}"
        )
    if kv_heads and heads % kv_heads:
        raise ConfigError(f"--kv-heads={kv_heads} does not divide the {heads} query heads at width {width}")
    intermediate = m.intermediate_size * width // m.hidden_size
    return Member(width, depth, heads, kv_heads or heads // group, intermediate)


def probe_batch(cfg: Config, tokens: int) -> torch.Tensor:
    """The fixed probe batch: the first validation sequences of the config's data (held out, the training
    distribution), at least `tokens` tokens."""
    from nanotron.data.corpus import open_corpus
    from nanotron.data.loader import eval_batches

    rows, count = [], 0
    for batch in eval_batches(open_corpus(cfg), cfg.training, 1, 0):
        rows.append(batch[:, :-1])
        count += batch[:, :-1].numel()
        if count >= tokens:
            break
    return torch.cat(rows)[: -(-tokens // cfg.training.seq_len)]


def run_overrides(cfg: Config, steps: int, out_dir: Path, name: str, seed: int) -> list[str]:
    """A short run at a constant LR, statistics every step, checkpoints at steps 0 and `steps` only."""
    lr = cfg.optimizer.lr
    return [
        f"--training.steps={steps}",
        f"--optimizer.lr={lr}",
        f"--optimizer.min_lr={lr}",
        "--optimizer.warmup_steps=0",
        "--optimizer.decay_style=constant",
        "--training.eval_interval=0",
        "--logging.activation_stats_interval=1",
        "--logging.log_interval=1",
        "--logging.tensorboard=false",
        "--logging.wandb=false",
        "--checkpoint.save_initial_state=true",
        f"--checkpoint.interval={steps}",
        "--checkpoint.keep_last=0",
        "--checkpoint.save_final=true",
        "--checkpoint.async_mode=sync",
        "--checkpoint.dir=",
        "--checkpoint.resume_from=none",
        "--checkpoint.init_from=",
        "--stability.enabled=false",
        f"--job.out_dir={out_dir}",
        f"--job.name={name}",
        f"--job.seed={seed}",
    ]


def parametrization_overrides(parametrization: str, base: Member) -> list[str]:
    """µP with `base` as its base model, or standard (whatever µP keys the config has, cleared)."""
    if parametrization == "mup":
        return ["--model.parametrization=mup", *base.as_base()]
    zero = [f"--model.mup_base.{f.name}=0" for f in fields(MupBase)]
    return ["--model.parametrization=standard", "--model.mup_depth_exponent=1.0", *zero]


def train(config: Path | None, args: list[str], nproc: int, run_dir: Path) -> None:
    """One `nanotron train` in its own process(es); its console output in <run dir>.log beside the run dir."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "nanotron.train", *(["--config", str(config)] if config else []), *args]
    if nproc > 1:
        command += ["--nproc_per_node", str(nproc)]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode:
        last = (log_path.read_text().strip().splitlines() or [""])[-1]
        raise UserError(
            f"coord-check: the run {run_dir.name} failed (exit {result.returncode}): {last} (see {log_path})"
        )


def sizes(run_dir: Path, depth: int) -> dict[int, dict[str, float]]:
    """`size/*` per step from the run's metrics: the statistics the trainer logged at its own layout."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "act/embed" not in record:
            continue
        by_step[record["step"]] = {
            "size/embed": record["act/embed"],
            "size/attn": statistics.fmean(record[f"act/layers.{i}.attn"] for i in range(depth)),
            "size/mlp": statistics.fmean(record[f"act/layers.{i}.mlp"] for i in range(depth)),
            "size/residual": record[f"act/layers.{depth - 1}.residual"],
            "size/norm": record["act/norm"],
            "size/logits": record["act/logits"],
        }
    return by_step


def _outputs(model: nn.Module, tokens: torch.Tensor) -> tuple[dict[str, list[torch.Tensor]], dict[str, list]]:
    """Each tracked activation of a forward on `tokens` (lists over layers), and each matrix's input."""
    acts: dict[str, list[torch.Tensor]] = {kind: [] for kind in ACTIVATIONS}
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []

    def keep(kind):
        return lambda module, args, out: acts[kind].append(out.detach())

    inner = model.model
    hooks.append(inner.embed_tokens.register_forward_hook(keep("embed")))
    for layer in inner.layers.values():
        hooks += [layer.self_attn.register_forward_hook(keep("attn")), layer.mlp.register_forward_hook(keep("mlp"))]
        hooks.append(layer.register_forward_hook(keep("residual")))
    hooks.append(inner.norm.register_forward_hook(keep("norm")))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: inputs.setdefault(n, []).append(a[0])))
    try:
        with torch.no_grad():
            acts["logits"].append(model(tokens).detach())
    finally:
        for hook in hooks:
            hook.remove()
    acts["residual"] = acts["residual"][-1:]  # the last layer's residual stream
    return acts, inputs


def changes(initial: nn.Module, trained: nn.Module, tokens: torch.Tensor) -> dict[str, float]:
    """`change/*` (mean |h_T - h_0|, attention and MLP over layers) and `update/*` (mean |(W_T - W_0) x| with
    x the trained model's input to that matrix; the head's with its logit multiplier, the embedding's rows)."""
    before, _ = _outputs(initial, tokens)
    after, inputs = _outputs(trained, tokens)
    stats = {
        f"change/{kind}": statistics.fmean((a - b).abs().mean().item() for a, b in zip(after[kind], before[kind]))
        for kind in ACTIVATIONS
    }
    old = dict(initial.named_parameters())
    per_kind: dict[str, list[float]] = {kind: [] for kind in MATRICES}
    for name, param in trained.named_parameters():
        delta = (param - old[name]).detach()
        module = name.removesuffix(".weight")
        if name.endswith("embed_tokens.weight"):
            per_kind["embed"].append(delta[tokens].abs().mean().item())
        elif module in inputs:
            kind = module.rsplit(".", 1)[-1]
            scale = trained.logit_multiplier if kind == "lm_head" else 1.0
            per_kind[kind].append(scale * F.linear(inputs[module][0], delta).abs().mean().item())
    return stats | {f"update/{kind}": statistics.fmean(v) for kind, v in per_kind.items() if v}


def load(step_dir: Path) -> nn.Module:
    from nanotron.checkpoint.full_model import load_model

    return load_model(step_dir, allow_unverified=True)[0].float()


def measure(run_dir: Path, member: Member, steps: int, probe: torch.Tensor) -> dict[int, dict[str, float]]:
    per_step = sizes(run_dir, member.depth)
    folder = run_dir / "checkpoints"
    per_step[steps] |= changes(load(folder / "step-0"), load(folder / f"step-{steps}"), probe)
    return per_step
