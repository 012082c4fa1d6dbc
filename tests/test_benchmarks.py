"""Each benchmark runs end to end with its documented command (`--quick`: nano or tiny model, few steps) and
writes its table. Speed is measured in benchmarks/, never asserted here: only that rows appear."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FORKRUN, TINY_MODEL, ZYGOTE

from benchmarks.common import FORK_LAUNCHER

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """One synthetic corpus for all the benchmarks (each writes it on first use)."""
    return tmp_path_factory.mktemp("bench_work")


def run_benchmark(module: str, out: Path, work_dir: Path, timeout: float = 180, extra: tuple[str, ...] = ()) -> str:
    """`python -m MODULE --quick ...` as documented, forked from this worker's tests/zygote.py (imports done once),
    and its training runs forked from it in turn (tests/forkrun.py for several ranks: benchmarks/common.py
    FORK_LAUNCHER); the other processes it starts are fresh interpreters."""
    args = ["--quick", "--out", str(out), "--work-dir", str(work_dir), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), FORK_LAUNCHER: str(FORKRUN)}
    proc = ZYGOTE.run([sys.executable, "-m", module, *args], args, 1, REPO, env, timeout, module=module)
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# A benchmark process that launches a run under the suite's fork launcher (a fresh single-threaded interpreter: a
# pytest worker's own state, its threads and in-process tests' leftovers, is no place to fork a run from).
FORKED_LAUNCH = """
import json, sys
from pathlib import Path
from benchmarks.common import launch_nanotron
proc, run_dir = launch_nanotron("forked", json.loads(sys.argv[1]), 2, Path(sys.argv[2]))
stdout, stderr = proc.communicate(timeout=240)
metrics = run_dir / "metrics.jsonl"
steps = sum("step_time_sec" in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0
print(json.dumps({"type": type(proc).__name__, "rc": proc.returncode, "args": proc.args, "steps": steps,
                  "stdout": stdout, "stderr": stderr[-3000:]}))
"""


@pytest.mark.slow
def test_a_benchmarks_forked_training_run_is_the_command_it_stands_for(tiny_data, tmp_path):
    """Under the suite's fork launcher, `launch_nanotron` forks the run from the benchmark's process: the same Popen
    to wait on, its argv the documented torchrun command, its ranks and output those of that command."""
    args = [*TINY_MODEL, *tiny_data.overrides(), "--training.steps=2", "--parallelism.dp=2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", FORK_LAUNCHER: str(FORKRUN)}
    command = [sys.executable, "-c", FORKED_LAUNCH, json.dumps(args), str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.splitlines()[-1])
    assert run["type"] == "ForkedRun" and run["rc"] == 0, run["stderr"]
    assert run["args"][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert "dp=2 tp=1 pp=1" in run["stdout"] and "run done: steps 1-2" in run["stdout"], run
    assert run["steps"] == 2


@pytest.mark.slow
def test_throughput_quick_writes_table_and_plot(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.throughput", tmp_path, work_dir)
    rows = read_csv(tmp_path / "throughput.csv")
    assert [r["layout"] for r in rows] == ["1 process", "dp2 zero0"]
    assert all(float(r["tokens_per_sec"]) > 0 and float(r["step_time_sec"]) > 0 for r in rows)
    assert (tmp_path / "throughput.md").read_text().startswith("| size | layout |")
    assert "dp2 zero0 tokens/s" in stdout
    # The plot needs the optional `bench` extra; without it the benchmark says so instead of failing.
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "throughput.png").stat().st_size > 0
    else:
        assert "no plot written" in stdout


@pytest.mark.slow
def test_overhead_quick_compares_three_implementations_with_equal_losses(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.overhead", tmp_path, work_dir)
    rows = {r["implementation"]: r for r in read_csv(tmp_path / "overhead.csv")}
    assert set(rows) == {"nanotron", "pytorch", "transformers"}
    # Same weights, batches and optimizer: the three loss curves agree (fp32, reduction order only).
    assert all(float(r["max_loss_diff"]) < 1e-4 for r in rows.values())
    assert "nanotron / pytorch" in stdout and "transformers / nanotron" in stdout


@pytest.mark.slow
def test_memory_quick_counts_state_bytes_per_rank(tmp_path, work_dir):
    run_benchmark("benchmarks.memory", tmp_path, work_dir)
    rows = {r["layout"]: r for r in read_csv(tmp_path / "memory.csv")}
    assert float(rows["1 process"]["vs_1_process"]) == 1.0
    # AdamW keeps two fp32 moments per parameter: the optimizer state is twice the parameters.
    one = rows["1 process"]
    assert float(one["optimizer_mib"]) == pytest.approx(2 * float(one["param_mib"]), rel=1e-3)
    assert len(rows["dp2 zero3"]["rank_state_mib"].split()) == 2
    # The plan's estimate is reported against each measurement; parameter shards are exact.
    assert float(rows["dp2 zero3"]["param_err"]) == 0.0 and rows["dp2 zero3"]["activation_err"] != ""


@pytest.mark.slow
def test_startup_quick_times_fresh_and_resumed_first_steps(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.startup", tmp_path, work_dir)
    rows = {r["start"]: r for r in read_csv(tmp_path / "startup.csv")}
    assert set(rows) == {"fresh", "resume"} and all(float(r["first_step_s"]) > 0 for r in rows.values())
    assert "CPU init rate" in stdout


@pytest.mark.slow
def test_gpu_check_quick_checks_losses_of_every_kind_of_row(tmp_path, work_dir):
    """The GPU check's own smoke test on CPU, a row of each kind and every kernel: one device eager, Muon (and the
    optimizer-step line it brings), dp2 with async saves held to one device, a resume equal to the uninterrupted
    run, each kernel's child process. The other training rows are these rows' runner with other flags (each a
    valid config: test_gpu_check_every_training_row_is_a_valid_config_of_the_1b_model; their models' layouts are
    the layout matrix's)."""
    chosen = "bf16 eager,cp attention,moe grouped GEMM,muon bf16,dp2 fsdp2,dp2 resumed,moe ep2 overlap,rms norm"
    stdout = run_benchmark("benchmarks.gpu_check", tmp_path, work_dir, timeout=360, extra=("--only-rows", chosen))
    rows = {r["check"]: r for r in read_csv(tmp_path / "gpu_check.csv")}
    one = ["bf16 eager", "cp attention", "moe grouped GEMM", "muon bf16"]
    two = ["dp2 fsdp2", "dp2 resumed", "moe ep2 overlap"]
    assert list(rows) == [*one, *two, "rms norm"]  # part 4 (one GPU) after part 3
    assert all(r["verdict"] == "ok" for r in rows.values()), rows
    assert float(rows["bf16 eager"]["last_loss"]) < float(rows["bf16 eager"]["first_loss"]) - 1
    assert "device: cpu x 2" in stdout
    for kernel in ("fused", "matmul"):  # the ring's block kernels in float64 (CUDA: matmul here, its fused ones after)
        assert f"cp attention {kernel} cp4 document: max error vs full attention" in stdout
    assert "cp attention cpu_flash bfloat16 cp4 document: max error vs float64" in stdout
    assert "document masks flex ring blocks cp4 (cpu)" in stdout  # FlexAttention: forward on CPU
    assert "moe grouped GEMM (cpu, 64 experts, 512 rows): relative error vs the loop" in stdout  # CUDA: the GPU row
    assert "moe ep2 overlap (cpu): largest difference on vs off" in stdout  # two GPUs: NCCL, the DeepSeek-V3 width
    assert re.search(r"rms norm float32 \[512, 256\]: bit for bit yes; forward \+ backward", stdout)
    assert re.search(r"optimizer: muon step [\d.]+s vs adamw [\d.]+s", stdout), stdout[-2000:]
    assert re.search(
        r"optimizer step alone: muon fp32 [\d.]+s vs adamw [\d.]+s; share .* muon fp32 [\d.]+%.*fp32 only on CPU",
        stdout,
    )
    assert "FAILED" not in stdout and "doctor" not in stdout


def _gpu_rows(quick: bool = False, n_devices: int = 2) -> list:
    from benchmarks.gpu_check import checks

    return checks(argparse.Namespace(quick=quick, steps=20, work_dir=Path("work")), "cuda", [], n_devices)


def test_gpu_check_kernel_rows_name_functions_that_take_their_arguments():
    """A kernel row's child process imports its module and calls the function on its arguments written as Python
    literals: checked here for every row, the CUDA-only ones (host syncs) included, which no CPU run starts."""
    import importlib
    import inspect

    kernels = [row.kernel for row in _gpu_rows() if row.kernel is not None]
    assert len(kernels) == 5  # host syncs, cp attention, the grouped GEMM, the RMSNorm, the ep2 overlap
    for module, function, arguments in kernels:
        inspect.signature(getattr(importlib.import_module(module), function)).bind(*arguments)
        assert eval(repr(arguments)) == arguments  # what the child is given


def test_gpu_check_rows_run_in_the_priority_order_and_estimates_its_docstring_states():
    """The docstring's "Priority order" block is the order the rows run in, each with its H100 estimate and part."""
    from benchmarks import gpu_check
    from benchmarks.gpu_budget import H100_1B, estimate

    block = gpu_check.__doc__.split("Priority order")[1].split("\nPart 1 is")[0]
    stated = []
    for part, text in re.findall(r"part (\d)[^:]*: (.*?)(?=\n  part |\Z)", block, re.S):
        stated += [(int(part), n, int(sec)) for n, sec in re.findall(r"(\w[\w -]*?) ~(\d+)s", text)]
    rows = _gpu_rows()
    assert [(c.part, c.name, round(estimate(c.cost, H100_1B, 20))) for c in rows] == stated
    names = [c.name for c in rows]  # the numerics that gate the rest first
    assert names[:5] == ["bf16 eager", "bf16 compile", "host syncs", "cp attention", "moe grouped GEMM"]


def test_gpu_check_parts_each_fit_nine_minutes_on_an_h100_as_estimated():
    from benchmarks.gpu_budget import H100_1B, PART_LIMIT_SEC, estimate, with_references

    rows = _gpu_rows()
    by_name, order = {c.name: c for c in rows}, [c.name for c in rows]
    needs = {c.name: c.needs for c in rows}
    for part in (1, 2, 4):  # the one-GPU parts
        names = with_references([c.name for c in rows if c.part == part], needs, order)
        assert all(by_name[n].nproc == 1 for n in names)
        assert sum(estimate(by_name[n].cost, H100_1B, 20) for n in names) <= PART_LIMIT_SEC, part
    assert {c.part for c in rows if c.nproc > 1} == {3}


def test_gpu_budget_plan_starts_what_fits_and_skips_the_rest_and_their_dependents():
    from benchmarks.gpu_budget import plan, rerun_command

    rows = [("eager", 40.0, ()), ("compile", 90.0, ["eager"]), ("kernels", 20.0, ()), ("moe", 50.0, ["eager"])]
    assert plan(rows, None) == [(n, None) for n, _, _ in rows]
    assert plan(rows, 100.0) == [
        ("eager", None),
        ("compile", "skipped (budget: needs ~90s, 60s left)"),
        ("kernels", None),
        ("moe", "skipped (budget: needs ~50s, 40s left)"),
    ]
    assert plan(rows, 30.0)[3] == ("moe", "skipped (needs eager, which did not run)")
    assert rerun_command(["compile", "moe"]) == 'bash benchmarks/gpu_check.sh --only-rows "compile,moe"'


def test_gpu_budget_estimates_are_refined_from_the_rows_measured():
    from benchmarks.gpu_budget import Cost, Timing, estimate, refine

    timing = Timing(startup_sec=25.0, step_sec=0.75, compile_sec=50.0)
    compiled, slow, kernel = Cost(step_factor=0.5, compile=True), Cost(step_factor=2.0), Cost(False, fixed_sec=7.0)
    assert estimate(compiled, timing, 20) == 25 + 50 + 20 * 0.75 * 0.5
    assert estimate(kernel, timing, 20) == 7.0
    measured = refine(timing, Cost(), seconds=70.0, step_sec=2.0, steps=20)  # eager: start-up 30 s, 2 s steps
    assert measured == Timing(startup_sec=30.0, step_sec=2.0, compile_sec=50.0)
    assert estimate(slow, measured, 20) == 30 + 20 * 4.0
    compiled_run = refine(measured, compiled, seconds=150.0, step_sec=1.0, steps=20)  # 150 - 30 - 20
    assert compiled_run == Timing(startup_sec=30.0, step_sec=2.0, compile_sec=100.0)


def test_gpu_check_only_rows_brings_references_and_names_an_unknown_row():
    from benchmarks.gpu_check import choose

    rows = _gpu_rows()
    pick = argparse.Namespace(only_rows="moe ep2, dp2 resumed", part=None, only=None)
    assert [c.name for c in choose(rows, pick)] == ["bf16 eager", "moe bf16", "dp2 fsdp2", "dp2 resumed", "moe ep2"]
    part2 = choose(rows, argparse.Namespace(only_rows=None, part=2, only=None))
    assert part2[0].name == "bf16 eager" and all(c.part == 2 for c in part2[1:])
    with pytest.raises(ValueError, match=r"^--only-rows: no row named \['eagre'\]; expected .*bf16 eager"):
        choose(rows, argparse.Namespace(only_rows="eagre", part=None, only=None))


def test_gpu_check_mtp_row_learns_with_its_mtp_loss_logged_finite_at_every_step():
    """The mtp bf16 row (CUDA only: the MLA row's 1B shape): a valid config of the 1B model with MLA, the MoE and
    MTP depth 1, and its verdict fails a run whose mtp_loss is missing at a step or not finite."""
    from benchmarks.common import model_overrides
    from benchmarks.gpu_check import Check, verify
    from nanotron.config import load_config, parse_overrides

    (row,) = [c for c in _gpu_rows() if c.name == "mtp bf16"]
    assert row.logged == ("mtp_loss",) and row.nproc == 1 and row.part == 4
    cfg = load_config(*parse_overrides([*model_overrides("1b"), "--training.dtype=bfloat16", *row.overrides]))
    assert cfg.model.mtp_depth == 1 and cfg.model.kv_lora_rank > 0 and cfg.model.moe.num_experts > 1
    assert "mtp bf16" not in [c.name for c in _gpu_rows(quick=True)]

    losses = {1: 10.4, 2: 9.0, 3: 8.1}
    verdicts = {}
    for case, mtp in (("ok", {1: 10.5, 2: 9.2, 3: 8.3}), ("missing", {1: 10.5, 2: None, 3: 8.3}),
                      ("nan", {1: 10.5, 2: float("nan"), 3: 8.3})):  # fmt: skip
        check = Check("mtp bf16", 1, [], logged=("mtp_loss",))
        verify(check, {"losses": losses, "first_loss": 10.4, "last_loss": 8.1, "logged": {"mtp_loss": mtp}}, {})
        verdicts[case] = check.problems
    assert verdicts == {"ok": [], "missing": ["mtp_loss not logged at steps [2]"], "nan": ["non-finite mtp_loss"]}


def test_gpu_check_every_training_row_is_a_valid_config_of_the_1b_model():
    """Every training row (the CUDA-only ones too, which no CPU run starts) loads as a config of the 1B model; the
    CPU smoke test runs one row of each kind, so this is what holds the others' flags to the config's keys."""
    from benchmarks.common import model_overrides
    from nanotron.config import load_config, parse_overrides

    rows = [c for c in _gpu_rows() if c.kernel is None and c.action is None]
    assert len(rows) >= 25 and "nope z-loss tp2 sp" in [c.name for c in rows]
    for row in rows:
        cfg = load_config(*parse_overrides([*model_overrides("1b"), "--training.dtype=bfloat16", *row.overrides]))
        assert cfg.world_size in (1, row.nproc), row.name
    (nope,) = [c for c in rows if c.name == "nope z-loss bf16"]
    cfg = load_config(*parse_overrides([*model_overrides("1b"), *nope.overrides]))
    assert cfg.model.nope_layers == [3, 7, 11, 15, 19] and cfg.training.z_loss > 0 and nope.logged == ("z_loss",)


def test_gpu_check_qwen3_moe_row_is_qwen3_moe_at_the_1b_width():
    """The qwen3 moe bf16 row (CUDA only, part 4): a valid config of the 1B model with Qwen3-MoE's block, QK-norm
    at head_dim 128 and softmax top-k routing renormalised over the chosen experts, without DeepSeek's shared
    expert, sigmoid router or routing bias (what the moe bf16 row already covers)."""
    from benchmarks.common import model_overrides
    from nanotron.config import load_config, parse_overrides

    (row,) = [c for c in _gpu_rows() if c.name == "qwen3 moe bf16"]
    assert row.nproc == 1 and row.part == 4 and row.reference is None
    cfg = load_config(*parse_overrides([*model_overrides("1b"), "--training.dtype=bfloat16", *row.overrides]))
    m, moe = cfg.model, cfg.model.moe
    assert m.qk_norm and m.head_dim == 128 and moe.enabled and moe.num_experts == 8 and moe.top_k == 2
    assert moe.router == "softmax_topk" and moe.renormalize and moe.num_shared_experts == 0
    assert moe.bias_update_rate == 0 and moe.moe_intermediate_size == m.intermediate_size // 4
    assert "qwen3 moe bf16" not in [c.name for c in _gpu_rows(quick=True)]


def test_gpu_check_with_one_gpu_skips_the_two_gpu_part_in_one_line(tmp_path, capsys):
    """Rows that need two GPUs are dropped in one line with one GPU; the rest run and the summary says so."""
    from benchmarks.gpu_budget import Cost
    from benchmarks.gpu_check import Check, run_rows

    fixed = Cost(False, fixed_sec=1.0)
    rows = [Check("kernels", 1, [], cost=fixed, action=lambda: True)]
    rows += [Check(name, 2, [], cost=fixed, action=lambda: True, part=3) for name in ("ep2 layer", "hang")]
    settings = argparse.Namespace(budget_minutes=None, quick=True, steps=12, global_batch=8, out=tmp_path, timeout=60)
    settings.started = time.monotonic()
    assert run_rows(rows, settings, [], "one test GPU", None, n_devices=1) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "two-GPU" in line] == ["two-GPU part: skipped (1 GPU visible): ep2 layer, hang"]
    assert [r["check"] for r in read_csv(tmp_path / "gpu_check.csv")] == ["kernels"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("gpu_check complete: 1 of 1 rows ran (0 failed)") and "two-GPU part: skipped" in markdown


def test_gpu_check_kernel_row_is_stopped_at_its_time_limit_and_the_rows_after_it_run(tmp_path):
    """Kernel rows (cp attention, the grouped GEMM, the ep2 overlap) run in a child process: one stuck on the device
    is stopped at its limit (the budget's end) as a training row is, instead of holding the GPU slot; a kernel that
    returns False is that row's failure."""
    from benchmarks.gpu_budget import Cost
    from benchmarks.gpu_check import Check, run_rows

    fixed = Cost(False, fixed_sec=1.0)
    rows = [
        Check("stuck kernel", 1, [], cost=fixed, kernel=("time", "sleep", (600,))),
        Check("failing kernel", 1, [], cost=fixed, kernel=("operator", "truth", (0,))),
        Check("passing kernel", 1, [], cost=fixed, kernel=("operator", "truth", (1,))),
    ]
    settings = argparse.Namespace(budget_minutes=None, quick=True, steps=12, global_batch=8, out=tmp_path, timeout=3)
    settings.started = time.monotonic()
    started = time.perf_counter()
    assert run_rows(rows, settings, [], "one test GPU", None, n_devices=1) == 1
    assert time.perf_counter() - started < 30
    assert {r["check"]: r["verdict"] for r in read_csv(tmp_path / "gpu_check.csv")} == {
        "stuck kernel": "stopped after 3s (its time limit, or the budget's end)",
        "failing kernel": "failed (its lines above say which)",
        "passing kernel": "ok",
    }


@pytest.mark.slow
def test_gpu_check_quick_budget_runs_what_fits_and_names_the_skipped_rows(tmp_path, work_dir):
    """A 9 s budget: the eager row (~12 s estimated on CPU) and the cp kernels (~15 s) are skipped, the grouped GEMM
    (~5 s) runs, and the command exits 0 and prints the command that runs the skipped rows."""
    extra = ("--only-rows", "bf16 eager,cp attention,moe grouped GEMM", "--budget-minutes", "0.15")
    stdout = run_benchmark("benchmarks.gpu_check", tmp_path, work_dir, extra=extra)
    rows = {r["check"]: r["verdict"] for r in read_csv(tmp_path / "gpu_check.csv")}
    left = r"[0-9]s left"  # 9 s less the command's start-up (the budget counts it)
    assert sorted(rows) == ["bf16 eager", "cp attention", "moe grouped GEMM"], rows
    assert re.fullmatch(rf"skipped \(budget: needs ~12s, {left}\)", rows["bf16 eager"]), rows
    assert re.fullmatch(rf"skipped \(budget: needs ~15s, {left}\)", rows["cp attention"]), rows
    assert rows["moe grouped GEMM"] == "ok"
    assert 'python -m benchmarks.gpu_check --quick --only-rows "bf16 eager,cp attention"' in stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["status"].startswith("gpu_check complete: 1 of 3 rows ran (0 failed), 2 skipped")


@pytest.mark.parametrize("with_torch", [["python3"], ["python"], []])
def test_gpu_check_sh_runs_the_first_of_python3_and_python_that_has_torch(tmp_path, with_torch):
    """The lent GPU machines' image has its torch in python3's venv and may have a bare `python` ahead of it on
    PATH: gpu_check.sh takes the first of python3 and python that imports torch (then, on this CPU machine, stops
    at the CUDA check), and says in one line when neither has it."""
    for name in ("python3", "python"):
        site = "" if name in with_torch else " -S"  # -S: no site-packages, so no torch
        (tmp_path / name).write_text(f'#!/bin/sh\nexec {sys.executable}{site} "$@"\n')
        (tmp_path / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # on a GPU machine too the script must stop at its CUDA check, not run the rows
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    expected = "gpu_check: no CUDA device is visible" if with_torch else "has no torch; set PYTHON to the interpreter"
    assert proc.returncode == 1 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_gpu_check_budget_counts_the_commands_start_up(tmp_path, monkeypatch, capsys):
    """The budget runs from the command's start: the corpus's preparation (tokenizer training, tokenizing) is paid
    out of it, so a 9-minute budget plus a row's grace stays inside a 10-minute command limit. A 6 s budget of
    which the preparation took 4 s leaves no room for a ~5 s row."""
    from benchmarks import gpu_check

    def slow_data(*args, **kwargs):
        time.sleep(4)
        return []

    monkeypatch.setattr(gpu_check, "ensure_data", slow_data)
    extra = ["--only-rows", "moe grouped GEMM", "--budget-minutes", "0.1"]
    status = gpu_check.main(["--quick", "--out", str(tmp_path), "--work-dir", str(tmp_path), *extra])
    rows = {r["check"]: r["verdict"] for r in read_csv(tmp_path / "gpu_check.csv")}
    assert re.fullmatch(r"skipped \(budget: needs ~5s, [0-2]s left\)", rows["moe grouped GEMM"]), rows
    assert status == 0


@pytest.mark.slow
def test_gpu_check_sigterm_mid_run_leaves_the_summary_of_the_rows_that_ran(tmp_path, work_dir):
    """SIGTERM during the second row: the first row's summary is on disk, the second is marked stopped, the
    training run it started ends with it, and the command exits 143."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--out", str(tmp_path), "--work-dir", str(work_dir)]
    cmd += ["--only-rows", "moe grouped GEMM,muon bf16"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    summary, deadline = tmp_path / "gpu_check.json", time.monotonic() + 120
    while not summary.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the summary appears when the first row is done, not at the end
    assert summary.exists() and proc.poll() is None, proc.communicate()[0][-3000:] if proc.poll() is not None else ""
    assert json.loads(summary.read_text())["status"].startswith("gpu_check running (after moe grouped GEMM)")
    time.sleep(1.0)  # the muon row's training run is under way
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    status = json.loads(summary.read_text())["status"]
    assert status.startswith("gpu_check stopped by SIGTERM during muon bf16: 1 of 2 rows ran (0 failed)"), status
    rows = {r["check"]: r["verdict"] for r in read_csv(tmp_path / "gpu_check.csv")}
    assert rows == {"moe grouped GEMM": "ok", "muon bf16": "stopped by SIGTERM"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("gpu_check stopped by SIGTERM")
    assert 'to run the rest: python -m benchmarks.gpu_check --quick --only-rows "muon bf16"' in markdown
    run = "--job.name=gpu_check-muon_bf16"
    left = [c for c in Path("/proc").glob("[0-9]*/cmdline") if _has(c, run) and _has(c, str(work_dir))]
    assert not left, "the stopped row's training run outlived gpu_check"


def _has(cmdline: Path, text: str) -> bool:
    try:
        return text in cmdline.read_bytes().decode(errors="replace")
    except OSError:  # the process ended meanwhile
        return False


# Beside other tests: the doctor times compute in process time and measures a slow-looking rank again
# (`benchmarks.doctor`: 0 of 20 healthy runs named under 2 busy loops); the hang limit is 8 s against ms phases.
@pytest.mark.slow
def test_gpu_check_quick_runs_the_doctor_and_names_a_hang(tmp_path, work_dir):
    """The GPU check's watch half on CPU: the doctor passes the healthy devices and names a wrong matmul, and
    the watcher names a rank that hangs on the 2-device path; no training row runs."""
    stdout = run_benchmark("benchmarks.gpu_check", tmp_path, work_dir, timeout=300, extra=("--only", "watch"))
    assert "doctor healthy                          ok" in stdout
    assert "doctor rank:0,step:0,kind:bad_matmul    ok" in stdout
    assert "train rank:1,step:3,kind:sleep         ok" in stdout
    rows = {r["check"]: r["verdict"] for r in read_csv(tmp_path / "gpu_check.csv")}
    assert rows == {"doctor": "ok", "hang watch": "ok"}


@pytest.mark.slow
def test_data_quick_measures_every_target_of_issue_10(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.data", tmp_path, work_dir)
    rows = {r["measurement"]: r for r in read_csv(tmp_path / "data.csv")}
    for name in ("nanotron tokenize --workers 1", "nanotron tokenize --workers 2", "loader start-up, 1e9 samples"):
        assert rows[name]["met"] in ("yes", "NO") and rows[name]["target"], rows[name]
    assert float(rows["nanotron tokenize --workers 1"]["value"].split("M")[0]) > 0
    assert rows["loader extra RSS, 1e9 samples"]["value"].endswith(" MB")
    assert len([name for name in rows if name.startswith("blend ")]) == 3
    assert stdout.startswith("| measurement | value |")


@pytest.mark.slow
def test_coord_check_quick_writes_slopes_values_and_figures(tmp_path, work_dir):
    """The benchmark is a thin caller of `nanotron coord-check` (tests/test_coord_check.py checks its verdict)."""
    stdout = run_benchmark("benchmarks.coord_check", tmp_path, work_dir)
    rows = read_csv(tmp_path / "coord_check.csv")
    assert {(r["sweep"], r["parametrization"]) for r in rows} == {
        (s, p) for s in ("width", "depth") for p in ("standard", "mup")
    }
    assert {r["statistic"].split("/")[0] for r in rows} == {"size", "change", "update"}
    summary = (tmp_path / "coord_check.md").read_text()
    assert "| sweep | statistic | standard slope |" in summary and "| width | update/down_proj |" in summary
    assert "coord check: standard" in stdout
    if importlib.util.find_spec("matplotlib"):
        for sweep in ("width", "depth"):
            assert all(
                (tmp_path / f"coord-check-{sweep}-{s}.png").stat().st_size > 0 for s in ("size", "change", "update")
            )
    else:
        assert "no figures written" in stdout


@pytest.mark.slow
def test_mup_transfer_quick_writes_runs_best_lrs_and_figures(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.mup_transfer", tmp_path, work_dir)
    rows = read_csv(tmp_path / "mup_transfer.csv")
    # The sweep: parametrizations x (2 widths + 1 depth) x 2 lrs x 2 seeds; then the 4-step stage: the base's LR grid
    # (2 seeds), µP's seeds at width 64, standard at µP's LR and tuned around its own best LR (+ a second seed).
    sweep = [r for r in rows if r["steps"] == "3"]
    assert len(sweep) == 2 * 3 * 2 * 2 and {r["seed"] for r in sweep} == {"0", "1"}
    wider = [r for r in rows if r["steps"] == "4"]
    assert {(r["parametrization"], r["width"]) for r in wider} == {("mup", "32"), ("mup", "64"), ("standard", "64")}
    assert len({r["log2_lr"] for r in wider if r["parametrization"] == "standard"}) >= 3  # tuned per width
    summary = (tmp_path / "mup_transfer.md").read_text()
    assert "| sweep | size | standard best log2 lr (fit [95% CI]; grid) |" in summary
    assert "4 steps at the base's best lr" in summary and "base model at 4 steps: best lr" in summary
    assert "standard tuned per width (4 steps" in summary
    if importlib.util.find_spec("matplotlib"):
        assert all((tmp_path / f).stat().st_size > 0 for f in ("lr-transfer.png", "wider-is-better.png"))
    else:
        assert "no plot written" in stdout


@pytest.mark.slow
def test_mup_transfer_quick_sweeps_muon_under_mup_alone(tmp_path, work_dir):
    """--optimizer muon --parametrizations mup: µP's runs only, with Muon (the trainer's start-up line says so),
    into the _muon files."""
    extra = ("--sweep-only", "--optimizer", "muon", "--parametrizations", "mup")
    stdout = run_benchmark("benchmarks.mup_transfer", tmp_path, work_dir, extra=extra)
    rows = read_csv(tmp_path / "mup_transfer_sweep_muon.csv")
    assert len(rows) == 3 * 2 * 2 and {r["parametrization"] for r in rows} == {"mup"}  # (2 widths + 1 depth) x 2 x 2
    summary = (tmp_path / "mup_transfer_sweep_muon.md").read_text()
    assert summary.startswith("12 runs of muon:") and "standard" not in summary
    log = next(work_dir.glob("runs/transfer-mup-w64-d1-*/train.log")).read_text()
    assert "optimizer: muon on" in log
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "lr-transfer-sweep-muon.png").stat().st_size > 0
    else:
        assert "no plot written" in stdout


@pytest.mark.slow
def test_muon_quality_quick_compares_both_optimizers_at_their_best_lr(tmp_path, work_dir):
    stdout = run_benchmark("benchmarks.muon_quality", tmp_path, work_dir, extra=("--adamw-horizon", "600"))
    rows = read_csv(tmp_path / "muon_quality.csv")
    # 2 LRs each at seed 0, then seed 1 at each optimizer's best, then AdamW's 2 seeds over the longer horizon
    # (--quick: 12 steps).
    assert sorted((r["optimizer"], r["seed"], r["steps"]) for r in rows) == [("adamw", "0", "12"), ("adamw", "0", "6"),
        ("adamw", "0", "6"), ("adamw", "1", "12"), ("adamw", "1", "6"), ("muon", "0", "6"), ("muon", "0", "6"),
        ("muon", "1", "6")]  # fmt: skip
    summary = (tmp_path / "muon_quality.md").read_text()
    assert "| optimizer | log2 lr | seeds | train loss @ 1 |" in summary
    assert re.search(r"AdamW's seed-mean curve (reaches|does not reach) Muon's final loss", summary)
    assert re.search(
        r"AdamW at 2\^-\d+ over a 12-step schedule \(2 seeds.*(reaches|does not reach) Muon's final", summary
    )
    shares = re.findall(r"\| (adamw|muon) \| \d+ \| [\d.]+ \| [\d.]+ \| (0\.\d+) \|", summary)
    assert [name for name, _ in shares] == ["adamw", "muon"], summary
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "muon_quality.png").stat().st_size > 0
    else:
        assert "no plot written" in stdout


@pytest.mark.slow
def test_stability_quick_counts_detections_and_measures_the_cost(tmp_path, work_dir):
    run_benchmark("benchmarks.stability", tmp_path, work_dir)
    rows = {r["measure"]: r for r in read_csv(tmp_path / "stability.csv")}
    assert rows["detections"]["value"] == "0"
    assert 40 < int(rows["lr x30: detected at step"]["value"]) <= 50  # resumed at step 40: within 10 steps
    assert float(rows["clean: largest grad_norm_ratio"]["value"]) < 4.0
    assert float(rows["step time on / off"]["value"]) > 0 and float(rows["detector host time / step"]["value"]) > 0


def test_lr_transfer_axes_come_from_the_sweeps_own_runs():
    """The bug: the y-range of lr-transfer.png was taken over every run, the longer wider-is-better runs too,
    whose lower losses stretched every panel."""
    from benchmarks.mup_transfer import loss_axis

    rows = [dict(steps=200, loss=x) for x in (4.0, 4.5, float("inf"))] + [dict(steps=600, loss=3.2)]
    assert loss_axis(rows, 200) == (pytest.approx(3.95), pytest.approx(4.55))


def test_the_width_claim_is_what_the_seeds_support():
    """'better' only when a doubling lowers the mean loss by more than 2 standard errors; else a tie."""
    from benchmarks.mup_transfer import width_claim

    losses = {64: [4.00, 4.02, 3.98], 128: [3.90, 3.91, 3.89], 256: [3.89, 3.93, 3.86], 512: [3.95]}
    assert width_claim(losses, [64, 128, 256, 512]) == (
        "64->128: better, 128->256: tie, 256->512: higher (one seed: untested)"
    )
    assert width_claim({1: [2.0, 2.1], 2: [3.0, 3.1]}, [1, 2]) == "1->2: worse"


def test_the_best_lr_interval_comes_from_resampling_the_seeds():
    """Seeds that agree pin the fitted best LR; seeds that disagree widen its interval; one seed has none."""
    from benchmarks.mup_transfer import best_lr_interval

    def parabola(x: int, shift: float = 0.0) -> float:
        return 4.0 + 0.1 * (x + 6 + shift) ** 2

    agree = {x: [parabola(x)] * 3 for x in range(-9, -2)}
    low, high = best_lr_interval(agree)
    assert low == pytest.approx(-6.0) and high == pytest.approx(-6.0)
    disagree = {x: [parabola(x, -1.0), parabola(x), parabola(x, 1.0)] for x in range(-9, -2)}
    low, high = best_lr_interval(disagree)
    assert -8.0 <= low < -6.2 and -5.8 < high <= -4.0
    assert best_lr_interval({x: [parabola(x)] for x in range(-9, -2)}) is None


def test_a_resumed_sweep_reads_back_only_runs_of_the_same_settings_and_code(tmp_path, monkeypatch):
    """--resume keeps each finished run's row; a later invocation reads back a run only when its overrides and
    nanotron's code are unchanged (a stale row from other code would silently pass for a measurement)."""
    import argparse

    from benchmarks import mup_transfer

    args = argparse.Namespace(widths=[32, 64], depths=[4, 16], head_dim=16, kv_heads=None, work_dir=tmp_path,
                              resume=True)  # fmt: skip
    point, row = ("mup", 64, 4, -6, 0, 200), {"loss": 4.5}
    mup_transfer.run_cache(["--a=1"], args).put(point, row)
    assert mup_transfer.run_cache(["--a=1"], args).get(point) == row
    assert mup_transfer.run_cache(["--a=1"], args).get(("mup", 64, 4, -6, 1, 200)) is None  # another seed
    assert mup_transfer.run_cache(["--a=2"], args).get(point) is None  # other settings
    assert mup_transfer.run_cache(["--a=1"], argparse.Namespace(**vars(args) | {"widths": [16, 64]})).get(point) is None
    monkeypatch.setattr(mup_transfer, "source_digest", lambda: "other code")
    assert mup_transfer.run_cache(["--a=1"], args).get(point) is None
    assert mup_transfer.run_cache(["--a=1"], argparse.Namespace(**vars(args) | {"resume": False})).get(point) is None


def test_muon_quality_reads_back_only_runs_of_the_same_settings_and_code(tmp_path, monkeypatch):
    """Its cache is keyed by the run's overrides and nanotron's code, like mup_transfer's: a trainer fix since (the
    stability guard's, found by this benchmark) reruns the rows it could change instead of reading them back."""
    import argparse

    from benchmarks import muon_quality

    args = argparse.Namespace(steps=300, shape=[], data=["--data.path=x"], work_dir=tmp_path, resume=True)
    muon_quality.run_cache(args).put(("adamw", -8, 0), {"late_loss": 4.9})
    assert muon_quality.run_cache(args).get(("adamw", -8, 0)) == {"late_loss": 4.9}
    assert muon_quality.run_cache(args).get(("adamw", -8, 0, 600)) is None  # another horizon
    monkeypatch.setattr(muon_quality, "source_digest", lambda: "other code")
    assert muon_quality.run_cache(args).get(("adamw", -8, 0)) is None


def test_standard_tuned_at_the_long_horizon_brackets_its_best_lr(monkeypatch):
    """--wider-only --tune-standard: each width's LR search walks past whichever end of its LRs is lowest until
    the minimum is inside them (a tuned baseline, not the grid's edge), then runs the other seeds there."""
    import argparse

    from benchmarks import mup_transfer

    best = {64: -9, 128: -4}  # one width's optimum below the start (-7), the other above it (-8)
    runs = []

    def fake_run_all(points, common, args, workers=None):
        runs.extend(points)
        return [dict(parametrization=p, width=w, depth=d, log2_lr=lr, seed=s, steps=n,
                     loss=4.0 + 0.1 * (lr - best[w]) ** 2 + 0.01 * s) for p, w, d, lr, s, n in points]  # fmt: skip

    monkeypatch.setattr(mup_transfer, "run_all", fake_run_all)
    args = argparse.Namespace(widths=[32, 64, 128], seeds=3, bracket_rounds=6)
    base = [dict(parametrization="mup", width=32, depth=4, log2_lr=-6, seed=s, steps=1000, loss=4.2) for s in range(3)]
    rows = mup_transfer.bracket_standard(base, args, [], 4, -6, 1000)
    losses, lrs = mup_transfer.tuned_standard(rows, args, 4, -6, 1000)
    assert lrs == {32: -6, 64: -9, 128: -4}
    assert {lr for _, w, _, lr, s, _ in runs if w == 64 and s == 0} == {-10, -9, -8, -7, -6}
    assert {lr for _, w, _, lr, s, _ in runs if w == 128 and s == 0} == set(range(-9, -2))
    assert sorted((w, lr, s) for _, w, _, lr, s, _ in runs if s > 0) == [(64, -9, 1), (64, -9, 2), (128, -4, 1),
                                                                         (128, -4, 2)]  # fmt: skip
    assert len(losses[64]) == len(losses[128]) == 3


def test_the_width_stage_at_the_base_models_best_lr_at_its_own_horizon(tmp_path, monkeypatch):
    """--wider-only base: the base's LR grid runs first at --wider-steps (--lr-seeds seeds each); every width then
    trains at the grid LR nearest its fitted best — the LR that is best at that horizon, not one given by hand."""
    from benchmarks import mup_transfer

    runs = []

    def fake_run_all(points, common, args, workers=None):
        runs.extend(points)  # the base's best LR at -7 (seeds disagree a little); wider is lower
        return [dict(parametrization=p, width=w, depth=d, log2_lr=lr, lr=2.0**lr, seed=s, steps=n, seconds=1.0,
                     loss=4.0 + 0.1 * (lr + 7.2) ** 2 - 0.1 * (w // 64) + 0.01 * s)
                for p, w, d, lr, s, n in points]  # fmt: skip

    monkeypatch.setattr(mup_transfer, "run_all", fake_run_all)
    monkeypatch.setattr(mup_transfer, "corpus_overrides", lambda work_dir, quick: [])
    argv = ["--wider-only", "base", "--widths", "32,64", "--depths", "4", "--lrs=-9,-5", "--lr-seeds", "2"]
    argv += ["--seeds", "3", "--wider-steps", "1000", "--out", str(tmp_path), "--work-dir", str(tmp_path)]
    assert mup_transfer.main(argv) == 0
    base = [(lr, s) for p, w, _, lr, s, n in runs if w == 32]
    assert sorted(base) == sorted({(lr, s) for lr in range(-9, -4) for s in range(2)} | {(-7, 2)})  # + 3rd seed
    assert {lr for p, w, _, lr, s, n in runs if w == 64} == {-7} and len(runs) == len(set(runs))
    summary = (tmp_path / "mup_transfer_wider1000_base.md").read_text()
    assert "base model at 1000 steps: best lr 2^-7.20 fitted [95% CI" in summary and "nearest the fit, 2^-7" in summary
    assert "1000 steps at the base's best lr 2^-7" in summary


@pytest.mark.slow
def test_the_sweeps_summary_is_rewritten_from_its_csv_with_added_runs(tmp_path, monkeypatch):
    """--replot --sweep-only re-analyses mup_transfer_sweep.csv (a width's runs appended from a later invocation)
    into the same table as a sweep that ran them all, without training."""
    from benchmarks import mup_transfer

    def fake_run_all(points, common, args, workers=None):
        return [dict(parametrization=p, width=w, depth=d, log2_lr=lr, lr=2.0**lr, seed=s, steps=n, seconds=1.0,
                     loss=4.0 + 0.1 * (lr + 6.3 + (p == "standard") * (w // 64)) ** 2 + 0.01 * s - 0.001 * w)
                for p, w, d, lr, s, n in points]  # fmt: skip

    monkeypatch.setattr(mup_transfer, "run_all", fake_run_all)
    monkeypatch.setattr(mup_transfer, "corpus_overrides", lambda work_dir, quick: [])
    monkeypatch.setattr(mup_transfer, "plot", lambda *args, **kwargs: True)  # the figure: not what is checked
    common = ["--sweep-only", "--depths", "4", "--lrs=-9,-4", "--lr-seeds", "2", "--work-dir", str(tmp_path)]
    whole, part, more = tmp_path / "whole", tmp_path / "part", tmp_path / "more"
    assert mup_transfer.main([*common, "--widths", "32,64,128", "--out", str(whole)]) == 0
    assert mup_transfer.main([*common, "--widths", "32,64", "--out", str(part)]) == 0
    assert mup_transfer.main([*common, "--widths", "32,128", "--out", str(more)]) == 0
    added = [line for line in (more / "mup_transfer_sweep.csv").read_text().splitlines()[1:] if ",128," in line]
    with open(part / "mup_transfer_sweep.csv", "a") as f:
        f.write("\n".join(added) + "\n")
    assert mup_transfer.main([*common, "--widths", "32,64,128", "--out", str(part), "--replot"]) == 0
    merged, ran = ((d / "mup_transfer_sweep.md").read_text().split("\n", 1) for d in (part, whole))
    assert "re-analysed from the CSV (--replot)" in merged[0] and merged[1] == ran[1] and "| width | 128 |" in ran[1]


def test_a_run_stopped_by_a_signal_is_not_a_measurement(tmp_path, monkeypatch):
    """The bug: a sweep run stopped by SIGTERM (the trainer saves and exits cleanly at step 410 of 1000) came back
    as finished, its 'late loss' taken over the steps it had, and --resume kept that row for good."""
    from benchmarks import inprocess

    class Stopped:
        def __init__(self, cfg):
            self.cfg = cfg

        def train(self):  # what the trainer leaves after a stop signal: the records up to the stop, no error
            with open(self.cfg.run_dir / "metrics.jsonl", "w") as f:
                f.writelines(f'{{"step": {s}, "loss": 4.0}}\n' for s in range(1, 5))

        def close(self):
            pass

    monkeypatch.setattr("nanotron.trainer.Trainer", Stopped)
    with pytest.raises(RuntimeError, match="stopped at step 4 of 10"):
        inprocess.train_run("stopped", ["--config", "configs/tiny.toml", "--training.steps=10"], tmp_path)


def test_vs_torchtitan_reads_each_tools_step_logs_as_global_tokens_per_sec():
    """nanotron's metrics.jsonl holds global tokens/s; torchtitan's `tps` is per device (x world), logged by
    every rank with its own clock (median per step), in colour or not, with thousands separators."""
    from benchmarks.vs_torchtitan import nanotron_tokens_per_sec, titan_tokens_per_sec

    metrics = '{"step": 2, "tokens_per_sec": 900.5, "loss": 7.1}\n{"step": 1, "tokens_per_sec": 600.0}\n{"eval": 1}\n'
    assert nanotron_tokens_per_sec(metrics) == [600.0, 900.5]
    log = (
        "[titan] 2026-12-05 16:04:37,611 - root - INFO - Model llama3 debugmodel size: 6,163,712 total parameters\n"
        "[rank0]:[titan] ... - step:  1  loss:  8.14570  grad_norm:  0.6281  memory: -0.00GiB(-0.00%)  tps: 420  "
        "tflops: 0.02  mfu: 0.01%\n"
        "[rank1]:[titan] ... - \x1b[31mstep:  1  \x1b[32mloss: -1.00000  \x1b[34mtps: 440  "
        "\x1b[36mtflops: 0.02\x1b[39m\n"
        "[rank0]:[titan] ... - step: 10  loss:  7.93376  grad_norm:  0.6744  memory: -0.00GiB(-0.00%)  tps: 1,587  "
        "tflops: 0.03  mfu: 0.01%\n"
        "[rank1]:[titan] ... - step: 10  loss:  7.93376  grad_norm:  0.6744  memory: -0.00GiB(-0.00%)  tps: 1,587  "
        "tflops: 0.03  mfu: 0.01%\n"
        "[titan] ... - validate step:  1  loss: 7.0  tps: 99999\n"
    )
    assert titan_tokens_per_sec(log, world=2) == [860.0, 3174.0]


def test_vs_torchtitan_pairs_tools_by_round_and_reports_the_ratios_spread():
    """Ratios are this/torchtitan within a round (load drifts between rounds), summarised as median, min and
    max; a round where one tool failed to report is left out rather than paired across rounds."""
    from benchmarks.vs_torchtitan import summarize

    def run(round_index: int, tool: str, tokens: float, rss: float) -> dict:
        return dict(layout="tp2 sp", world=2, round=round_index, tool=tool, tokens_per_sec=tokens, peak_rss_mib=rss)

    runs = [
        run(0, "nanotron", 900, 800),
        run(0, "torchtitan", 1000, 1000),
        run(1, "torchtitan", 500, 1000),
        run(1, "nanotron", 400, 900),
        run(2, "nanotron", 1100, 700),
        run(2, "torchtitan", 1000, 1000),
        run(3, "nanotron", 5000, 100),
    ]
    (row,) = summarize(runs)
    assert (row["layout"], row["world"], row["rounds"]) == ("tp2 sp", 2, 3)
    assert (row["tokens_per_sec_ratio"], row["tokens_per_sec_ratio_min"], row["tokens_per_sec_ratio_max"]) == (
        pytest.approx(0.9),
        pytest.approx(0.8),
        pytest.approx(1.1),
    )
    assert (row["peak_rss_ratio"], row["peak_rss_ratio_min"], row["peak_rss_ratio_max"]) == (
        pytest.approx(0.8),
        pytest.approx(0.7),
        pytest.approx(0.9),
    )
    assert (row["nanotron_tokens_per_sec"], row["torchtitan_tokens_per_sec"]) == (900, 1000)
    assert row["verdict"] == "unsettled" and row["interval_coverage"] is None  # 3 rounds: no 90 % interval


def test_vs_torchtitan_judges_the_target_by_the_median_ratios_sign_test_interval():
    """The verdict is the interval of the median ratio the rounds support: met only when even its low end reaches
    the target, missed only when its high end falls short, unsettled otherwise. The interval's coverage is the
    sign test's, exact: with 5 rounds [min, max] at 1 - 2/32; with 12, the 3rd smallest to the 3rd largest at
    1 - 2 (1 + 12 + 66)/4096 (the 4th from each end would cover only 85 %)."""
    from benchmarks.vs_torchtitan import median_interval, summarize, verdict

    assert median_interval([1.0, 2.0, 3.0]) is None
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    low, high, coverage = median_interval([float(v) for v in range(12, 0, -1)])
    assert (low, high, coverage) == (3.0, 10.0, pytest.approx(1 - 2 * 79 / 4096))

    def rounds(ratios: list[float]) -> list[dict]:
        base = dict(layout="pp2 1f1b", world=2, peak_rss_mib=1.0)
        return [
            {**base, "round": i, "tool": tool, "tokens_per_sec": 1000 * ratio if tool == "nanotron" else 1000}
            for i, ratio in enumerate(ratios)
            for tool in ("nanotron", "torchtitan")
        ]

    assert summarize(rounds([1.06, 1.2, 1.1, 1.07, 1.3]))[0]["verdict"] == "met"
    assert summarize(rounds([1.04, 1.2, 1.1, 1.07, 1.3]))[0]["verdict"] == "unsettled"  # one round below
    assert summarize(rounds([0.9, 1.0, 1.04, 0.95, 0.99]))[0]["verdict"] == "missed"
    assert summarize(rounds([1.06, 1.2, 1.1, 1.07, 1.3]), target=1.1)[0]["verdict"] == "unsettled"
    assert summarize(rounds([1.2, 1.3, 1.25]))[0]["verdict"] == "unsettled"  # every round above, but only 3
    assert verdict((1.0, 1.2, 0.94), 1.0) == "met"  # at the target counts


def test_vs_torchtitan_saves_every_run_and_summarises_them_again_from_the_file(tmp_path, capsys):
    """A measurement's runs are saved (vs_torchtitan_runs.csv) and `--from-runs` re-summarises them without
    measuring, at another target too, with numbers read back as numbers; a file that is not such a CSV is one
    line naming the flag."""
    from benchmarks.common import write_csv
    from benchmarks.vs_torchtitan import RUN_COLUMNS, main, read_runs, summarize

    runs = [
        dict(layout="tp2 sp", world=2, round=i, tool=tool, tokens_per_sec=ratio * 1000, peak_rss_mib=900.0, load=1.5)
        for i, ratio in enumerate([1.06, 1.1, 1.08, 1.2, 1.07])
        for tool, ratio in (("nanotron", ratio), ("torchtitan", 1.0))
    ]
    write_csv(runs, tmp_path / "runs.csv", RUN_COLUMNS)
    assert read_runs(tmp_path / "runs.csv") == runs
    assert summarize(runs)[0]["verdict"] == "met"
    assert main(["--from-runs", str(tmp_path / "runs.csv"), "--out", str(tmp_path / "out"), "--target", "1.1"]) == 0
    assert "tp2 sp: tokens/s this/torchtitan 1.08 [1.06-1.20]" in capsys.readouterr().out
    assert "target 1.10 unsettled" in (tmp_path / "out" / "vs_torchtitan.md").read_text()
    (tmp_path / "bad.csv").write_text("step,loss\n1,2.0\n")
    with pytest.raises(SystemExit):
        main(["--from-runs", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "out")])
    assert "--from-runs:" in capsys.readouterr().err


def test_vs_torchtitan_layouts_split_the_same_global_batch():
    """Every layout trains the same global batch: dp ranks split it, the pipeline into 8 microbatches of 1."""
    from benchmarks.vs_torchtitan import LAYOUTS, nanotron_args, titan_args

    for layout in LAYOUTS:
        nano = nanotron_args(layout, steps=4, global_batch=8, data=[])
        titan = titan_args(layout, steps=4, global_batch=8, corpus_dir=Path("c"), tokenizer=Path("t"))
        assert "--training.global_batch_size=8" in nano and "--training.global_batch_size=8" in titan
        local = 8 // layout.dp
        assert f"--training.local_batch_size={local}" in titan
        assert f"--training.micro_batch_size={local // layout.microbatches}" in nano
    pp = next(layout for layout in LAYOUTS if layout.name == "pp2 1f1b")
    assert "--training.micro_batch_size=1" in nanotron_args(pp, 4, 8, [])
    assert "--parallelism.pipeline_parallel_microbatch_size=1" in pp.torchtitan


def test_muon_exchange_quick_counts_the_routes_the_plan_charges():
    """The busiest owner of tp 2 x FSDP 4, built on the fake process group (in this process: `count` ends its
    group): what its real routes send and receive in Muon's two all-to-alls is what `nanotron plan` charges."""
    from benchmarks.muon_exchange import QUICK, count
    from nanotron.config import load_config, parse_overrides
    from nanotron.plan.timing import muon_loads

    _, owned, _ = muon_loads(load_config(*parse_overrides([*QUICK, "--optimizer.name=muon"])), 0)
    row = count(QUICK, rank=owned.index(max(owned)))
    assert row["ranks"] == 8 and not row["matrices_owned"].startswith("0 of"), row
    assert row["sent_mb"] == row["received_mb"] == row["plan_sent_mb"] > 0, row


def test_the_synthetic_corpus_is_the_one_each_benchmark_asks_for_whichever_ran_first(tmp_path):
    """The bug: the corpus was written once per work dir with the first caller's size (gpu_check --quick: 600
    documents), and a benchmark run after it in the same dir (stability: 1200) trained on other data, so its
    LR spike went undetected in one test order of the suite."""
    from benchmarks.common import synthetic_data

    small, _ = synthetic_data(tmp_path, n_docs=20, vocab_size=300)
    large, _ = synthetic_data(tmp_path, n_docs=40, vocab_size=300)
    assert len(small.read_text().splitlines()) == 20 and len(large.read_text().splitlines()) == 40
