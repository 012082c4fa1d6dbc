"""`nanotron plan` against published GPU runs: the calibration set and the planner's ratio to it.

    python -m benchmarks.plan_calibration [--efficiency E]

Reads `benchmarks/calibration/published.csv` (one row per published run whose layout nanotron can express:
source, GPU, model, FSDP/TP/PP/CP degrees, sequence length, local batch (sequences per data-parallel rank per
step), pipeline microbatches and schedule, global batch, activation checkpointing, compile, precision, published
tokens/s per GPU and peak memory, the capacity of the GPUs it ran on, and `zero_stage`: the nanotron ZeRO stage
that does what the run's FSDP did — 3 (parameters freed after forward: torchtitan's default) or 1 (parameters
kept gathered and gradients reduced once per step: torchtitan's FSDP under pipeline parallelism)). Each row is
planned with `nanotron plan`'s step estimate (`estimate_step`) at each GPU's default efficiency (`nanotron plan`'s,
itself the median this script reports: re-derive it when rows are added) or at `--efficiency`. Writes
`benchmarks/results/plan-calibration.{csv,md}`: planned / published tokens/s per GPU and the efficiency that would
make the plan equal the published figure (solved, since communication does not scale with it) for the bf16 runs,
with the median per GPU type; the plan's memory of the worst rank against the published peak for every run that
gives one (Float8 runs too: Table 1 of torchtitan's December 2024 page shows Float8 moving the peak by 0.2 GiB),
its median overall and per activation-checkpointing mode, and whether the plan would refuse a run that ran.

Selective activation checkpointing (torchtitan's default, its op-level policy: every other matmul output kept)
is planned as nanotron's `parallelism.recompute = "selective"` with `selective_matmuls = "every_other"`, the same
policy. Approximations, printed in the table: torch.compile is not modelled (the compiled and eager rows of one
setup share a plan; their ratio is the compile speed-up); the published peaks are torchtitan's reserved memory
(the caching allocator's), the plan counts allocated bytes.
"""

from __future__ import annotations

import argparse
import csv
import statistics

from benchmarks.common import REPO, RESULTS_DIR, write_table
from nanotron.config import load_config
from nanotron.plan.memory import GIB, worst_stage
from nanotron.plan.timing import estimate_step, parse_gpu

CASES = REPO / "benchmarks" / "calibration" / "published.csv"
MODELS = {  # Llama 3.1 shapes (Meta's params.json), untied embeddings
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8),
    "llama3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128, num_kv_heads=8),
}
COLUMNS = (
    "case",
    "gpu",
    "layout",
    "published tok/s/GPU",
    "planned",
    "planned / published",
    "efficiency to match",
    "published GiB",
    "planned GiB",
    "memory planned / published",
    "plan fits",
)


def config(case: dict):
    world, fsdp, tp, pp, cp = (int(case[k]) for k in ("world", "fsdp", "tp", "pp", "cp"))
    dp = world // (tp * pp * cp)
    micro_batch = int(case["local_batch"]) // int(case["microbatches"])
    pairs = [(f"model.{k}", str(v)) for k, v in MODELS[case["model"]].items()]
    pairs += [("model.vocab_size", "128256"), ("model.max_seq_len", case["seq_len"])]
    pairs += [("parallelism.dp", str(dp)), ("parallelism.tp", str(tp)), ("parallelism.pp", str(pp))]
    pairs += [("parallelism.cp", str(cp)), ("parallelism.zero_stage", case["zero_stage"])]
    pairs += [("parallelism.dp_shard", str(fsdp if fsdp < dp else 0))]
    pairs += [("parallelism.recompute", case["recompute"])]
    # torchtitan's selective AC is its op-level policy: every other matmul output kept.
    pairs += [("parallelism.selective_matmuls", "every_other")] if case["recompute"] == "selective" else []
    pairs += [("parallelism.pp_engine", case["pp_schedule"])] if case["pp_schedule"] else []
    pairs += [("training.seq_len", case["seq_len"]), ("training.micro_batch_size", str(micro_batch))]
    pairs += [("training.global_batch_size", case["global_batch"]), ("training.grad_accum_steps", "0")]
    pairs += [("training.dtype", "bfloat16")]
    return load_config(None, pairs, world_size=world)


def speed_cases(cases: list[dict]) -> list[dict]:
    """The rows whose speed nanotron can be held to: bf16 runs with a published tokens/s."""
    return [c for c in cases if c["precision"] == "bf16" and c["tokens_per_s_per_gpu"]]


def planned_per_gpu(case: dict, efficiency: float | None = None) -> float:
    """The plan's tokens/s per GPU at `efficiency` (default: the GPU's, as `nanotron plan` uses)."""
    cfg = config(case)
    efficiency = efficiency or parse_gpu(case["gpu"]).efficiency.default
    step = estimate_step(cfg, parse_gpu(case["gpu"]), gpus_per_node=8, efficiency=efficiency)
    return step.tokens_per_s / cfg.world_size


def matching_efficiency(case: dict, published: float) -> float:
    """The efficiency at which the plan equals the published tokens/s per GPU (bisection: monotone in it)."""
    lo, hi = 0.01, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if planned_per_gpu(case, mid) < published else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--efficiency", type=float, default=None, help="default: each GPU's, as nanotron plan")
    args = parser.parse_args()
    rows, speed, memory_ratios = [], {}, {}
    with open(CASES, newline="") as f:
        cases = list(csv.DictReader(f))
    timed = {c["case"] for c in speed_cases(cases)}
    for case in cases:
        row = {"case": case["case"], "gpu": case["gpu"]}
        layout = f"fsdp {case['fsdp']} tp {case['tp']} pp {case['pp']} cp {case['cp']}, lbs {case['local_batch']}"
        layout += f" in {case['microbatches']} {case['pp_schedule']} microbatches" if case["pp_schedule"] else ""
        layout += f", seq {case['seq_len']}, AC {case['recompute']}, zero {case['zero_stage']}"
        layout += ", compile" if case["compile"] == "true" else ""
        layout += f", {case['precision']}" if case["precision"] != "bf16" else ""
        row["layout"] = layout
        if case["case"] in timed:
            published = float(case["tokens_per_s_per_gpu"])
            planned = planned_per_gpu(case, args.efficiency)
            efficiency = matching_efficiency(case, published)
            speed.setdefault(case["gpu"], []).append((planned / published, efficiency))
            row |= {"published tok/s/GPU": published, "planned": round(planned)}
            row |= {"planned / published": round(planned / published, 2), "efficiency to match": round(efficiency, 3)}
        memory = worst_stage(config(case))[1]["total"] / GIB
        fits = memory <= float(case["gpu_memory_gib"])
        row |= {"planned GiB": round(memory, 1), "plan fits": "yes" if fits else "NO"}
        if case["memory_gib"]:
            ratio = memory / float(case["memory_gib"])
            memory_ratios.setdefault(case["recompute"], []).append(ratio)
            row |= {"published GiB": case["memory_gib"], "memory planned / published": round(ratio, 2)}
        rows.append(row)
    for gpu, values in speed.items():
        rows.append(
            {
                "case": f"median ({len(values)} bf16 runs)",
                "gpu": gpu,
                "planned / published": round(statistics.median(v[0] for v in values), 2),
                "efficiency to match": round(statistics.median(v[1] for v in values), 3),
            }
        )
    groups = {f"AC {mode}": values for mode, values in memory_ratios.items()}
    groups["all"] = [ratio for values in memory_ratios.values() for ratio in values]
    for name, values in groups.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        rows.append(
            {
                "case": f"memory median ({len(values)} runs, {name})",
                "layout": f"range {spread}",
                "memory planned / published": round(statistics.median(values), 2),
            }
        )
    print(f"planned at --efficiency {args.efficiency or 'of each GPU (nanotron plan default)'}")
    print(write_table(rows, COLUMNS, RESULTS_DIR / "plan-calibration"))


if __name__ == "__main__":
    main()
