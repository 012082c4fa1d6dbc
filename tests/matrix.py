"""The layout matrix, one harness for every model family.

A family is a model with its run settings and the data it trains on. Its 1-process reference run is made once per
session, on first use (the `references` fixture), and shared by every layout and every test that compares against
it. A layout is data: the mesh sizes and the flags that choose engines, ZeRO stages and recompute.
`assert_matches` holds a run to its reference in everything the family logs: losses, evaluation losses and
downstream log-likelihoods, gradient norms, activation statistics, MoE statistics and the final weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, TINY_MUP, activation_stats, item_log_likelihoods, read_metrics, run_train, train_losses
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nanotron.config import Config, load_config, parse_overrides

RTOL = 1e-5
STATS = "--logging.activation_stats_interval=2"  # act/* every other step (not with compile: a config error)
COMPILE = "--training.compile=true"
SIZES = ("dp", "cp", "tp", "pp", "ep")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # experts split over ep ranks of dp x cp: not a factor of the world size
    flags: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def args(self) -> list[str]:
        return [f"--parallelism.{size}={getattr(self, size)}" for size in SIZES] + list(self.flags)

    def __str__(self) -> str:  # the test id: dp2-tp2-pp1-zero_stage=3
        shown = [size for size in SIZES if getattr(self, size) > 1 or size in ("dp", "tp", "pp")]
        sizes = [f"{size}{getattr(self, size)}" for size in shown]
        return "-".join(sizes) + "".join("-" + flag.split(".")[-1] for flag in self.flags)


@dataclass(frozen=True)
class Family:
    name: str
    data: str  # the session fixture of tests/conftest.py it trains on
    flags: tuple[str, ...]
    steps: int = 5
    tasks: bool = False  # downstream scores at the first and last step, every item's log-likelihood written
    tensor_rtol: float | None = None  # also bound each weight tensor alone (not only all of them together)
    flips: bool = False  # float8: held to RTOL in what step 1 computes, within the flip bounds after (FLIPS below)

    def train(self, data, out: Path, name: str, layout: Layout = Layout(), *extra: str, steps: int = 0) -> Path:
        flags = [flag for flag in self.flags if not (COMPILE in extra and flag == STATS)]
        tasks = [f"--evaluation.tasks={data.task}", "--evaluation.write_items=true"] if self.tasks else []
        run_train(
            [
                *TINY_MODEL,
                *data.overrides(),
                f"--job.out_dir={out}",
                f"--job.name={name}",
                f"--training.steps={steps or self.steps}",
                "--checkpoint.save_final=true",
                *flags,
                *tasks,
                *layout.args(),
                *extra,
            ],
            nproc=layout.world,
        )
        return out / name

    def run(self, data, out: Path, name: str, layout: Layout = Layout(), *extra: str) -> Run:
        return Run(self.train(data, out, name, layout, *extra), self.steps)


EVALUATE = ("--training.eval_interval=5", "--training.eval_steps=1")  # before the first step and after the last
# Two layers where a family's layouts need no more (a pipeline stage each at pp 2): under TP each layer costs ~20
# collectives per microbatch, whose latency on 2 shared cores is most of a tiny run's time.
TWO_LAYERS = ("--model.num_layers=2",)
DENSE = Family("dense", "tiny_data", (*EVALUATE, STATS), tasks=True, tensor_rtol=10 * RTOL)
# The same model at two layers, for the layouts of at most two pipeline stages (dense_family).
SHALLOW = replace(DENSE, name="shallow", flags=(*DENSE.flags, *TWO_LAYERS))
# Document masking: several EOS tokens in most samples, documents crossing the cp chunks.
DOCUMENTS = Family("documents", "short_docs_data", (*EVALUATE, "--model.attention=document", STATS, *TWO_LAYERS))
# Shared experts, a dense first layer, DeepSeek-V3's sigmoid router with bias balancing and the sequence-wise
# balance loss: every MoE feature at once, on the tiny model.
MOE = (
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.moe_intermediate_size=32",
    "--model.moe.num_shared_experts=1",
    "--model.moe.first_dense_layers=1",
    "--model.moe.router=sigmoid",
    "--model.moe.bias_update_rate=0.01",
    "--model.moe.aux_loss_coef=0.01",
)
EXPERTS = Family("experts", "tiny_data", (*MOE, *EVALUATE, "--logging.log_interval=1", STATS))
# Muon (with AdamW for the rest) on the experts' model: dense matrices, each expert's gate/up/down and the router
# (AdamW) in one family, so one reference serves the FSDP, TP, PP and EP rows; its step-2 checkpoint is resumed at
# another layout.
MUON = Family(
    "muon", "tiny_data", (*MOE, "--optimizer.name=muon", "--logging.log_interval=1", "--checkpoint.interval=2"), steps=3
)
# Qwen3's attention on the tiny model: QK-norm, and 4 heads of 12 (48 != hidden 32).
QWEN3_ATTENTION = ("--model.qk_norm=true", "--model.head_dim=12")
QWEN3 = Family("qwen3", "tiny_data", (*EVALUATE, STATS, *QWEN3_ATTENTION, *TWO_LAYERS))
# Qwen3-MoE: that attention and its routing (a softmax over the experts, the top k renormalised, no shared expert,
# every layer routed), with the balance loss; checkpoints at step 2 and 4, resumed at another layout.
QWEN3_MOE = Family(
    "qwen3_moe",
    "tiny_data",
    (
        *QWEN3_ATTENTION,
        "--model.moe.num_experts=8",
        "--model.moe.top_k=2",
        "--model.moe.moe_intermediate_size=32",
        "--model.moe.router=softmax_topk",
        "--model.moe.renormalize=true",
        "--model.moe.aux_loss_coef=0.01",
        *EVALUATE,
        "--logging.log_interval=1",
        "--checkpoint.interval=2",
        STATS,
        *TWO_LAYERS,
    ),
)
# DeepSeek-V3's multi-head latent attention on the tiny model at 2 layers: latents of 16 (queries and keys/values),
# heads of 8 + 4 (nope + rope) for queries/keys and 6 for values (narrower: the ring pads them), 4 K/V heads.
MLA_MODEL = (
    "--model.q_lora_rank=16",
    "--model.kv_lora_rank=16",
    "--model.qk_nope_head_dim=8",
    "--model.qk_rope_head_dim=4",
    "--model.v_head_dim=6",
    "--model.num_kv_heads=4",
    "--model.num_layers=2",
)
MLA = Family("mla", "tiny_data", (*MLA_MODEL, *EVALUATE, STATS))
# DeepSeek-V3's multi-token prediction (depth 1) on that model with the MoE (no sequence-wise balance loss: it
# refuses cp), so the MTP module's block is a MoE layer whose experts ep splits; its loss logged every step.
MTP = Family(
    "mtp",
    "tiny_data",
    (
        *MLA_MODEL,
        *MOE[:-1],
        "--model.mtp_depth=1",
        *EVALUATE,
        "--logging.log_interval=1",
        "--checkpoint.interval=2",
        STATS,
    ),  # fmt: skip
    tasks=True,  # downstream scoring runs the main model only, its pipeline stages still carrying the MTP tokens
)
# SmolLM3's attention (RoPE skipped in layer 1 of 2: the second stage's at pp 2) with the z-loss, its mean
# log(Z)^2 logged every step: the weight (1e-3 x ~81) moves the loss by 1e-2, three orders above RTOL, so a z-loss
# summed over the wrong tokens or reduced over a vocab shard shows.
NOPE_Z_LOSS = Family(
    "nope_z_loss",
    "tiny_data",
    ("--model.nope_layers=1", "--training.z_loss=1e-3", *EVALUATE, "--logging.log_interval=1", STATS, *TWO_LAYERS),
)
# TINY_MODEL (hidden 32, 4 layers, 4 heads of 8) as 2x the width, 2x the depth and 2x the head dim of its base.
MUP = Family(
    "mup",
    "tiny_data",
    (*TINY_MUP, "--optimizer.decay_steps=4", STATS),  # decay_steps: the schedule is a resume leg's too
    steps=6,
)

# Float8 (torchao, emulated on CPU) on TINY_MODEL at twice its width, so every converted linear keeps dimensions of
# 16 or more per rank at tp=2 (k_proj [32, 64] -> 16 rows). Every amax is the 1-process one (max is exact: FSDP's
# float8 all-gather precomputes the scale from the all-reduced shard maxima, DTensor reduces a tp-sharded weight's
# or activation's amax), so a layout differs from one process in reduction order, as without float8, but float8
# turns an ulp into more: a value an ulp from an e4m3 (e5m2) rounding boundary moves a whole fp8 step, 1/16-1/8
# (1/8-1/4) of itself, when a row-parallel sum or a sharded norm weight's gradient rounds the other way. Such a flip
# is one element of many in the step it happens in; from step 2 Adam carries it (m / sqrt(v) makes a changed
# near-zero gradient entry a full-size update) and the runs part. Measured over 30 seeds x the 4 float8 rows (120
# runs, 2026-12-07, on the Xeon where seed 42's tp2 row first failed RTOL; on the EPYCs of earlier sessions it
# passed by chance), largest relative difference to the 1-process run:
# - step 1's loss and the evaluation before it: 1.8e-6 (114 runs at 0 or one ulp);
# - step 1's gradient norm: 3.1e-4 (5 runs over RTOL, all with tp; e5m2's steps are a quarter of a value);
# - after step 1: losses 2.1e-4, gradient norms 3e-2, activation statistics 1e-2, final weights 8e-3; 41 runs over
#   RTOL somewhere.
# A scale computed from each rank's own shard instead (the tp amax not reduced) moved step 1's loss by 3.8e-5 to
# 1e-4 (5 seeds), the evaluation before it by 6e-5 to 1e-4 and step 1's gradient norm by 8e-4 to 3e-3 (4 of them).
# So a float8 row holds step 1's forward at RTOL (5x the flips, under a third of that bug), step 1's gradient norm
# within 1e-3 (3x the flips: a gross error in backward only) and the rest within 5x (losses) and 3x the flips
# measured: the same run, give or take flips. A scale gone stale after an optimizer step shows only after step 1,
# within those bounds: the trainer's refresh is test_float8's to hold.
FLIPS = {"step 1 grad_norm": 1e-3, "losses": 1e-3, "the rest": 1e-1}
FLOAT8_MODEL = ("--model.hidden_size=64", "--model.intermediate_size=128")
FLOAT8 = Family(
    "float8", "tiny_data", (*FLOAT8_MODEL, *TWO_LAYERS, "--training.float8=tensorwise", *EVALUATE, STATS), flips=True
)
FLOAT8_ROWWISE = Family(
    "float8_rowwise", "tiny_data", (*FLOAT8_MODEL, *TWO_LAYERS, "--training.float8=rowwise", STATS), flips=True
)


def dense_family(layout: Layout) -> Family:
    """SHALLOW where the layout has at most two pipeline stages, DENSE (TINY_MODEL's four layers) for more: pp 4, or
    pp 2 with the multi-stage engines' two virtual stages per rank (interleaved 1F1B, zero bubble, ZBV)."""
    return DENSE if config(layout.args()).num_stages > 2 else SHALLOW


def config(flags) -> Config:
    """TINY_MODEL's config with these flags (a family's, a layout's)."""
    return load_config(*parse_overrides([*TINY_MODEL, *flags]))


class Run:
    """What a run dir logged, read once."""

    def __init__(self, run_dir: Path, step: int):
        self.dir, self.step = run_dir, step

    @cached_property
    def metrics(self) -> list[dict]:
        return read_metrics(self.dir)

    @cached_property
    def losses(self) -> list[float]:
        return train_losses(self.dir)

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.metrics if key in r]

    @cached_property
    def stats(self) -> dict[int, dict[str, float]]:
        return activation_stats(self.dir)

    @cached_property
    def moe(self) -> list[dict[str, float]]:
        records = [r for r in self.metrics if "moe/load_max_over_mean" in r]
        return [{k: v for k, v in r.items() if k.startswith("moe/")} for r in records]

    @cached_property
    def items(self) -> list[float]:
        return item_log_likelihoods(self.dir, self.step) if (self.dir / "evaluation").is_dir() else []

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        return weights(self.dir, self.step)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model's full tensors in a checkpoint (DCP shards of any layout joined)."""
    target = run_dir / f"weights-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step}", target)
    return torch.load(target, weights_only=True)["model"]


class References:
    """Each family's 1-process run, trained on first use and kept for the session."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
        self.request = request
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict[str, Run] = {}

    def __getitem__(self, family: Family) -> Run:
        if family.name not in self.runs:
            data = self.request.getfixturevalue(family.data)
            out = self.tmp_path_factory.mktemp(f"{family.name}_reference")
            self.runs[family.name] = family.run(data, out, "ref")
        return self.runs[family.name]


def relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[name] - tensor).flatten() for name, tensor in want.items()])
    return (diff.norm() / torch.cat([tensor.flatten() for tensor in want.values()]).norm()).item()


def assert_matches(run: Run, ref: Run, family: Family) -> str:
    """Every quantity the reference logged, within RTOL (a float8 family's after step 1 within FLIPS); returns a line
    of the measured differences."""
    assert len(run.losses) == len(ref.losses) == family.steps
    flips = FLIPS if family.flips else {}

    def close(key: str, got: list[float], want: list[float], first: float = RTOL, later: str = "losses") -> None:
        """`first` for step 1's value (or the evaluation before it), the family's bound for the later ones."""
        assert len(got) == len(want), key
        assert got[:1] == pytest.approx(want[:1], rel=first, abs=0), (key, got, want)
        assert got[1:] == pytest.approx(want[1:], rel=flips.get(later, RTOL), abs=0), (key, got, want)

    close("losses", run.losses, ref.losses)
    # grad_norm: the global norm over every shard, before clipping
    for key in ("eval_loss", "grad_norm", "mtp_loss", "z_loss"):
        if key == "grad_norm":
            close(key, run.series(key), ref.series(key), flips.get("step 1 grad_norm", RTOL), "the rest")
        else:
            close(key, run.series(key), ref.series(key))
    # Downstream evaluation on the layout: every (item, choice) log-likelihood, items split over dp unevenly.
    assert not (family.flips and family.tasks), "a float8 family's items would need the flip bound after step 1"
    assert run.items == pytest.approx(ref.items, rel=RTOL, abs=0)
    # The activation statistics, reduced from each rank's shards (logged from step 2 on).
    assert sorted(run.stats) == sorted(ref.stats)
    for step, stats in ref.stats.items():
        assert run.stats[step] == pytest.approx(stats, rel=flips.get("the rest", RTOL), abs=0), step
    assert len(run.moe) == len(ref.moe)
    for got, want in zip(run.moe, ref.moe):
        assert got == pytest.approx(want, rel=RTOL, abs=1e-12)
    assert run.weights.keys() == ref.weights.keys()
    balanced = any(flag.startswith("--model.moe.bias_update_rate=") for flag in family.flags)
    for name, bias in ref.weights.items():  # the routers' balancing bias: integer loads, the same decisions
        if name.endswith("expert_bias"):
            assert torch.equal(run.weights[name], bias), name
            assert bias.abs().sum() > 0 or not balanced, f"{name}: the reference's bias never moved"
    together = relative_difference(run.weights, ref.weights)
    losses = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses))
    line = f"max loss rel diff {losses:.2e}, weights rel diff {together:.2e}"
    assert together <= flips.get("the rest", RTOL), line
    if family.tensor_rtol is not None:
        # One tensor alone may drift more: Adam turns reduction-order noise in near-zero gradient entries into
        # full-size updates (m / sqrt(v) ~ +-1).
        each = {name: relative_difference({name: run.weights[name]}, {name: w}) for name, w in ref.weights.items()}
        worst = max(each, key=each.get)
        line += f" (worst tensor {worst}: {each[worst]:.2e})"
        assert each[worst] <= family.tensor_rtol, line
    return line
