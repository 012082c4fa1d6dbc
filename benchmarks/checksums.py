"""What checkpoint checksums cost: save and load of the small model with its AdamW state, and the hashing part.

    python -m benchmarks.checksums [--size small] [--rounds 3] [--quick]

One process (a world of one, like `python -m nanotron.train`) builds `configs/<size>.toml`'s model in fp32 with
AdamW state, then saves it with the checkpoint manager (DCP shards + an XXH3 checksum of every file) and loads it back
(checksums verified before the read). Each round times the whole save and load and, separately, the hashing
alone over the same files (hot in the page cache, as right after a save). Best of the rounds.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS_DIR, bench_parser, write_table
from nanotron.checkpoint import integrity
from nanotron.checkpoint.manager import CheckpointManager
from nanotron.checkpoint.state import ModelState, OptimizerState
from nanotron.config import CheckpointConfig, load_config
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.shapes import num_params
from nanotron.optim import build_optimizer
from nanotron.parallel.init import init_weights

COLUMNS = ("size", "params_m", "checkpoint_mib", "save_s", "hash_s", "load_s", "verify_s", "save_overhead")
COLUMNS += ("load_overhead",)


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def measure(size: str, rounds: int, overrides: list[tuple[str, str]]) -> dict:
    cfg = load_config(f"configs/{size}.toml", overrides)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, seed=0)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer])}
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="nanotron-checksums-") as work:
        folder = Path(work)
        for round_ in range(rounds):
            manager = CheckpointManager(folder, CheckpointConfig(), states, Progress(), log=lambda message: None)
            started = time.perf_counter()
            manager.save(round_ + 1)
            timings = {"save_s": time.perf_counter() - started}
            step_dir = folder / f"step-{round_ + 1}"
            started = time.perf_counter()
            integrity.shard_checksums(step_dir)
            timings["hash_s"] = time.perf_counter() - started
            started = time.perf_counter()
            manager.load(step_dir)
            timings["load_s"] = time.perf_counter() - started
            started = time.perf_counter()
            integrity.verify(step_dir, integrity.saved(step_dir))
            timings["verify_s"] = time.perf_counter() - started
            for key, value in timings.items():
                best[key] = min(best.get(key, float("inf")), value)
            checkpoint_bytes = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
            shutil.rmtree(step_dir)
    return {
        "size": size,
        "params_m": round(num_params(cfg.model) / 1e6, 1),
        "checkpoint_mib": round(checkpoint_bytes / 2**20),  # noqa: F821 - set in the last round
        **{key: round(value, 3) for key, value in best.items()},
        "save_overhead": f"{best['hash_s'] / (best['save_s'] - best['hash_s']):.1%}",
        "load_overhead": f"{best['verify_s'] / (best['load_s'] - best['verify_s']):.1%}",
    }


def main() -> None:
    parser = bench_parser("checksums", __doc__)
    parser.add_argument("--size", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    size, rounds = ("tiny", 1) if args.quick else (args.size, args.rounds)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        row = measure(size, rounds, [])
    finally:
        dist.destroy_process_group()
    print(write_table([row], COLUMNS, args.out / ("checksums_quick" if args.quick else "checksums")))


if __name__ == "__main__":
    main()
