"""`nanotron plan` against published GPU runs: the calibration set and the planner's ratio to it.

    python -m benchmarks.plan_calibration [--efficiency E]
    python -m benchmarks.plan_calibration --search [CASE ...]   # the published layouts' ranks in --search

Reads `benchmarks/calibration/published.csv` (one row per published run whose layout nanotron can express:
source, GPU, model, FSDP/TP/PP/CP degrees, sequence length, local batch (sequences per data-parallel rank per
step), pipeline microbatches and schedule, global batch, activation checkpointing, compile, precision, published
tokens/s per GPU and peak memory, the capacity of the GPUs it ran on, and `zero_stage`: the nanotron ZeRO stage
that does what the run's FSDP did — 3 (parameters freed after forward: torchtitan's default) or 1 (parameters
kept gathered and gradients reduced once per step: torchtitan's FSDP under pipeline parallelism)). Each row is
planned with `nanotron plan`'s step estimate (`estimate_step`) at each GPU's default efficiency (`nanotron plan`'s,
itself the median this script reports: re-derive it when rows are added) or at `--efficiency`. Writes
`benchmarks/results/plan-calibration.{csv,md}`: planned / published tokens/s per GPU and the efficiency that would
make the plan equal the published figure (solved, since communication does not scale with it) for the 16-bit
runs, with the median per GPU type; the plan's memory of the worst rank against the published peak for every run that
gives one (Float8 runs too: Table 1 of torchtitan's December 2024 page shows Float8 moving the peak by 0.2 GiB),
its median overall and per activation-checkpointing mode, and whether the plan would refuse a run that ran.

Rows with `tp_comm_overlap = true` (Megatron-LM's weak-scaling runs, whose tensor-parallel communication
overlaps compute; tokens/s derived from the published TFLOP/s with Megatron's FLOP count) are a cross-check:
planned and reported with their published MFU, but not in the per-GPU efficiency, which comes from the runs
whose TP traffic is exposed, as nanotron's is: torchtitan's on H100, Megatron-LM's April 2021 runs on A100
(`mlm21-gpt-*`: before TP overlap; tokens/s from the published TFLOP/s with the paper's formula, which counts the
recomputed forward). `--search` runs `nanotron plan --search` on every published cell
(model, GPUs, sequence, global batch) and reports where the published layout ranks:
`benchmarks/results/plan-search-cells.{csv,md}` (minutes per 512-GPU cell).

Float8 rows are a check of the plan's float8 model, never part of the fit: torchtitan's December 2024 runs with
Float8 (torchao's tensorwise recipe, the one it had then) are planned with `training.float8 = "tensorwise"` at the
H100's bf16-derived efficiency, and reported as planned / published beside the speed-up over their bf16 twin
(Tables 1 and 3: the same layout with compile, without Float8). Table 2's cp > 1 rows are not planned in float8
(nanotron refuses float8 with cp > 1) and Tables 5 and 6 ran async TP (a cross-check, as Megatron-LM's runs).

Selective activation checkpointing (torchtitan's default, its op-level policy: every other matmul output kept)
is planned as nanotron's `parallelism.recompute = "selective"` with `selective_matmuls = "every_other"`, the same
policy. Approximations, printed in the table: torch.compile is not modelled (the compiled and eager rows of one
setup share a plan; their ratio is the compile speed-up); the published peaks are torchtitan's reserved memory
(the caching allocator's), the plan counts allocated bytes.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
import time

from benchmarks.common import REPO, RESULTS_DIR, bench_parser, write_table
from nanotron.config import load_config
from nanotron.models.shapes import flops_per_token
from nanotron.plan.memory import GIB, worst_stage
from nanotron.plan.report import recompute_label
from nanotron.plan.search import search
from nanotron.plan.timing import estimate_step, parse_gpu

CASES = REPO / "benchmarks" / "calibration" / "published.csv"
MODELS = {  # Llama 3.1 shapes (Meta's params.json: vocabulary 128256), untied embeddings
    name: dict(
        hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads, num_kv_heads=8, vocab_size=128256
    )
    for name, (h, i, layers, heads) in {
        "llama3.1-8b": (4096, 14336, 32, 32),
        "llama3.1-70b": (8192, 28672, 80, 64),
        "llama3.1-405b": (16384, 53248, 126, 128),
    }.items()
}


def megatron_gpt(hidden: int, layers: int, heads: int, vocab: int) -> dict:
    """A Megatron-LM GPT model (a 4h GeLU MLP, untied embeddings) as nanotron plans it: the GeLU MLP's two 4h
    matrices as a SwiGLU of intermediate 8h/3 (to a multiple of 64), the same FLOPs and parameters within 0.5 %."""
    return dict(hidden_size=hidden, intermediate_size=round(8 * hidden / 3 / 64) * 64, num_layers=layers,
                num_heads=heads, num_kv_heads=heads, vocab_size=vocab)  # fmt: skip


# Megatron-LM's weak-scaling GPT models (README table at commit f2e5db4, July 2024: vocab 131072, sequence 4096,
# heads of 128; the parameter counts are the untied ones).
GPT = {"1.7b": (2048, 24), "7.1b": (4096, 30), "16b": (6144, 32), "32b": (7168, 48), "70b": (8192, 84),
       "119b": (10240, 92), "177b": (12288, 96), "314b": (16384, 96), "462b": (18432, 112)}  # fmt: skip
MODELS |= {f"megatron-gpt-{size}": megatron_gpt(h, layers, h // 128, 131072) for size, (h, layers) in GPT.items()}
# Megatron-LM's April 2021 A100 weak-scaling GPT models (README table, images/cases_april2021.png, at commit 2120e31:
# vocab 51200, sequence 2048; the head counts, not in the table, are the paper's: Narayanan et al. 2021, Table 1 —
# they change no FLOPs and only the attention's memory).
GPT_2021 = {"1.7b": (2304, 24, 24), "3.6b": (3072, 30, 32), "7.5b": (4096, 36, 32), "18b": (6144, 40, 48),
            "39b": (8192, 48, 64), "76b": (10240, 60, 80), "145b": (12288, 80, 96), "310b": (16384, 96, 128),
            "530b": (20480, 105, 128), "1t": (25600, 128, 160)}  # fmt: skip
MODELS |= {f"megatron2021-gpt-{size}": megatron_gpt(*shape, 51200) for size, shape in GPT_2021.items()}
COLUMNS = (
    "case",
    "gpu",
    "layout",
    "published tok/s/GPU",
    "planned",
    "planned / published",
    "efficiency to match",
    "published MFU",
    "float8 speed-up planned / published",
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
    pairs += [("model.max_seq_len", case["seq_len"])]
    pairs += [("parallelism.dp", str(dp)), ("parallelism.tp", str(tp)), ("parallelism.pp", str(pp))]
    pairs += [("parallelism.cp", str(cp)), ("parallelism.zero_stage", case["zero_stage"])]
    pairs += [("parallelism.dp_shard", str(fsdp if fsdp < dp and case["zero_stage"] != "0" else 0))]  # 0: DDP
    pairs += [("parallelism.recompute", case["recompute"])]
    # torchtitan's selective AC is its op-level policy: every other matmul output kept.
    pairs += [("parallelism.selective_matmuls", "every_other")] if case["recompute"] == "selective" else []
    pairs += [("parallelism.pp_engine", case["pp_schedule"])] if case["pp_schedule"] else []
    pairs += [("training.seq_len", case["seq_len"]), ("training.micro_batch_size", str(micro_batch))]
    pairs += [("training.global_batch_size", case["global_batch"]), ("training.grad_accum_steps", "0")]
    pairs += [("training.dtype", "bfloat16")]
    pairs += [("training.float8", FLOAT8_RECIPE)] if runs_float8(case) else []
    return load_config(None, pairs, world_size=world)


FLOAT8_RECIPE = "tensorwise"  # torchtitan's December 2024 Float8: torchao's tensorwise scaling, its only recipe then


def runs_float8(case: dict) -> bool:
    """A Float8 run that nanotron can plan in float8 (not with cp > 1, which it refuses)."""
    return case["precision"] == "float8" and case["cp"] == "1"


def float8_cases(cases: list[dict]) -> list[dict]:
    """The Float8 runs with a published tokens/s planned in float8: the check of the float8 plan, out of the fit
    (those with async TP included; `tp_comm_overlap` tells them apart)."""
    return [c for c in cases if runs_float8(c) and c["tokens_per_s_per_gpu"]]


def bf16_twin(case: dict, cases: list[dict]) -> dict | None:
    """The bf16 run of the same source table and layout as a Float8 run (its speed-up's baseline), if published."""
    keys = ("source", "model", "world", "fsdp", "tp", "pp", "cp", "seq_len", "local_batch", "recompute", "compile")
    twins = [c for c in cases if c["precision"] == "bf16" and all(c[k] == case[k] for k in keys)]
    return twins[0] if twins else None


def speed_cases(cases: list[dict]) -> list[dict]:
    """The rows whose speed nanotron's plan is held to (and its per-GPU efficiency derived from): 16-bit runs with a
    published tokens/s whose tensor-parallel communication was exposed, as nanotron's is."""
    return [c for c in timed_cases(cases) if c["tp_comm_overlap"] != "true"]


def timed_cases(cases: list[dict]) -> list[dict]:
    """Every 16-bit run with a published tokens/s, Megatron-LM's H100 runs (TP communication overlapped) included."""
    return [c for c in cases if is_timed(c)]


def is_timed(case: dict) -> bool:
    """A 16-bit run (bf16, or fp16 on an A100: the same peak) with a published tokens/s."""
    return case["precision"] in ("bf16", "fp16") and bool(case["tokens_per_s_per_gpu"])


def published_mfu(case: dict) -> float:
    """The run's model FLOPs per second per GPU over the GPU's bf16 peak, FLOPs counted as `nanotron plan` counts
    them (Megatron's convention: 6 per parameter a token meets and the full seq_len^2 attention)."""
    cfg = config(case)
    flops = float(case["tokens_per_s_per_gpu"]) * flops_per_token(cfg.model, cfg.training.seq_len)
    return flops / (parse_gpu(case["gpu"]).device.bf16 * 1e12)


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


def degrees(case: dict) -> tuple[int, int, int, int]:
    tp, pp, cp = (int(case[k]) for k in ("tp", "pp", "cp"))
    return int(case["world"]) // (tp * pp * cp), tp, pp, cp


def search_cells(cases: list[dict], only: list[str]) -> list[dict]:
    """`nanotron plan --search` on each published cell (model, GPUs, sequence, global batch): where the best
    published layout (dp, tp, pp, cp; the fastest published one where a cell has several) ranks among the rows
    the search lists (its best variant: ZeRO stage, shard group, recompute, micro batch) and among the distinct
    dp x tp x pp x cp, its planned speed against the search's best, and the best's layout."""
    cells: dict[tuple, list[dict]] = {}
    for case in cases:
        key = (case["model"], case["world"], case["seq_len"], case["global_batch"], case["gpu"])
        cells.setdefault(key, []).append(case)
    rows = []
    for (model, world, seq, batch, gpu_name), members in cells.items():
        if only and not {c["case"] for c in members} & set(only):
            continue
        best = max(members, key=lambda c: float(c["tokens_per_s_per_gpu"] or 0))
        gpu = parse_gpu(gpu_name)
        gpu = dataclasses.replace(gpu, device=dataclasses.replace(gpu.device, memory_gib=float(best["gpu_memory_gib"])))
        started = time.perf_counter()
        found, considered = search(config(best), int(world), 8, gpu, gpu.efficiency.default)
        ranks = [i for i, c in enumerate(found, 1) if layout_degrees(c.cfg) == degrees(best)]
        distinct = list(dict.fromkeys(layout_degrees(c.cfg) for c in found))  # each dp x tp x pp x cp once
        top, mine = found[0].step, found[ranks[0] - 1].step if ranks else None
        p = found[0].cfg.parallelism
        rows.append(
            {
                "cell": f"{model} on {world} {gpu_name}, {batch} x {seq}",
                "published layout": "dp {} tp {} pp {} cp {}".format(*degrees(best)),
                "rank": f"{ranks[0]} of {len(found)}" if ranks else f"not listed (of {len(found)})",
                "rank of its dp x tp x pp x cp": f"{distinct.index(degrees(best)) + 1} of {len(distinct)}"
                if ranks
                else "",
                "planned / best": round(top.step_s / mine.step_s, 3) if mine else "",
                "within error": ("yes" if mine.step_s <= top.step_s * (1 + gpu.efficiency.error) else "no")
                if mine
                else "",
                "search's best": f"dp {p.dp} tp {p.tp} pp {p.pp} cp {p.cp}, {recompute_label(p)}, "
                f"mb {found[0].cfg.training.micro_batch_size}, limit {top.limit}",
                "target (top 3)": "met" if ranks and ranks[0] <= 3 else "MISSED",
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
        print(rows[-1], flush=True)
    return rows


def layout_degrees(cfg) -> tuple[int, int, int, int]:
    p = cfg.parallelism
    return p.dp, p.tp, p.pp, p.cp


def float8_rows(cases: list[dict], efficiency: float | None) -> dict[str, dict]:
    """By case: each Float8 run's planned tokens/s per GPU against the published, the efficiency that would match
    it, and where a bf16 twin was published the planned against the published speed-up."""
    out = {}
    for case in float8_cases(cases):
        published, planned = float(case["tokens_per_s_per_gpu"]), planned_per_gpu(case, efficiency)
        row = {"published tok/s/GPU": published, "planned": round(planned)}
        row |= {"planned / published": round(planned / published, 2)}
        row |= {"efficiency to match": round(matching_efficiency(case, published), 3)}
        row |= {"exposed": case["tp_comm_overlap"] != "true"}
        twin = bf16_twin(case, cases)
        if twin:
            planned_up = planned / planned_per_gpu(twin, efficiency)
            published_up = published / float(twin["tokens_per_s_per_gpu"])
            row["float8 speed-up planned / published"] = f"{planned_up:.2f} / {published_up:.2f}"
        out[case["case"]] = row
    return out


def main() -> None:
    parser = bench_parser("plan_calibration", __doc__)
    parser.add_argument("--efficiency", type=float, default=None, help="default: each GPU's, as nanotron plan")
    parser.add_argument(
        "--search",
        nargs="*",
        metavar="CASE",
        help="instead: `nanotron plan --search` on each published cell (or the cells of these cases) and the rank "
        "of the published layout in it: benchmarks/results/plan-search-cells.{csv,md}",
    )
    args = parser.parse_args()
    if args.search is not None:
        with open(CASES, newline="") as f:
            rows = search_cells(list(csv.DictReader(f)), args.search)
        print(write_table(rows, list(rows[0]), RESULTS_DIR / "plan-search-cells"))
        return
    rows, speed, memory_ratios = [], {}, {}
    with open(CASES, newline="") as f:
        cases = list(csv.DictReader(f))
    timed, overlapped = {c["case"] for c in speed_cases(cases)}, {}
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
        if is_timed(case):
            row["published MFU"] = round(published_mfu(case), 3)
        if is_timed(case) and case["case"] not in timed:  # TP overlapped: a cross-check, not the fit
            published, planned = float(case["tokens_per_s_per_gpu"]), planned_per_gpu(case, args.efficiency)
            overlapped.setdefault(case["gpu"], []).append((planned / published, published_mfu(case)))
            row |= {"published tok/s/GPU": published, "planned": round(planned)}
            row |= {"planned / published": round(planned / published, 2)}
        memory = worst_stage(config(case))[1]["total"] / GIB
        fits = memory <= float(case["gpu_memory_gib"])
        row |= {"planned GiB": round(memory, 1), "plan fits": "yes" if fits else "NO"}
        if case["memory_gib"]:
            ratio = memory / float(case["memory_gib"])
            memory_ratios.setdefault(case["recompute"], []).append(ratio)
            row |= {"published GiB": case["memory_gib"], "memory planned / published": round(ratio, 2)}
        rows.append(row)
    float8 = float8_rows(cases, args.efficiency)
    for row in rows:
        row |= float8.get(row["case"], {})
    for gpu, values in speed.items():
        rows.append(
            {
                "case": f"median ({len(values)} 16-bit runs)",
                "gpu": gpu,
                "planned / published": round(statistics.median(v[0] for v in values), 2),
                "efficiency to match": round(statistics.median(v[1] for v in values), 3),
            }
        )
    for gpu, values in overlapped.items():
        ratios, mfus = [v[0] for v in values], [v[1] for v in values]
        rows.append(
            {
                "case": f"median ({len(values)} runs, TP overlapped)",
                "gpu": gpu,
                "layout": f"planned / published {min(ratios):.2f}-{max(ratios):.2f}, "
                f"MFU {min(mfus):.2f}-{max(mfus):.2f}",
                "planned / published": round(statistics.median(ratios), 2),
                "published MFU": round(statistics.median(mfus), 3),
            }
        )
    for exposed in (True, False):
        ratios = [r["planned / published"] for r in float8.values() if r["exposed"] == exposed]
        rows.append(
            {
                "case": f"median ({len(ratios)} float8 runs{'' if exposed else ', async TP'}: a check, not in the fit)",
                "gpu": "h100",
                "layout": f"planned / published {min(ratios):.2f}-{max(ratios):.2f}",
                "planned / published": round(statistics.median(ratios), 2),
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
