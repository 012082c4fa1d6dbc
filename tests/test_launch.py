"""The Slurm launcher without a cluster: flags → resolved config → the exact sbatch command, and its refusals.

Submission is exercised against stand-in `sbatch`/`scontrol` executables on PATH that record their arguments;
real submissions run in tests/test_slurm.py.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron.config import load_config
from nanotron.launch import cluster as launch

REPO = Path(__file__).resolve().parents[1]


def run_launcher(*argv: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    """`python -m nanotron.launch` as a user types it: exit code and the exact stdout/stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "nanotron.launch", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )


def fake_command(bin_dir: Path, name: str, script: str) -> None:
    """A stand-in executable for a Slurm client command."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(f"#!/usr/bin/env bash\n{script}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_dry_run_writes_the_resolved_config_and_prints_the_exact_sbatch_command(in_tmp, capsys):
    assert launch.main("--run_name exp1 --nodes 2 --dp 8 --tp 2 --model_size small --dry_run".split()) == 0
    out = capsys.readouterr().out

    cfg = load_config("runs/exp1/config.toml")
    assert (cfg.job.name, cfg.model.size, cfg.model.hidden_size) == ("exp1", "small", 768)
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (8, 2, 1)
    expected = [
        "sbatch",
        "--parsable",
        "--job-name=exp1",
        "--nodes=2",
        "--time=1:00:00",
        "--output=runs/exp1/slurm-%j.out",
        "--signal=B:USR1@360",
        "--partition=hopper-prod",
        "--gpus-per-node=8",
        "--export=ALL,NPROC_PER_NODE=8",
        str(launch.JOB_SCRIPT),
        "runs/exp1/config.toml",
    ]
    assert f"  {shlex.join(expected)}\n" in out
    assert (in_tmp / "runs/exp1/submit.sh").read_text().splitlines()[-1] == shlex.join(expected)
    assert "dry run: nothing submitted" in out


def test_without_config_the_seed_launcher_defaults_apply(in_tmp):
    assert launch.main(["--run_name", "defaults", "--dry_run"]) == 0
    cfg = load_config("runs/defaults/config.toml")
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (8, 2, 1)
    assert (cfg.training.steps, cfg.training.micro_batch_size, cfg.training.grad_accum_steps) == (10000, 2, 8)
    assert cfg.training.global_batch_size == 2 * 8 * 8
    assert (cfg.optimizer.lr, cfg.data.path, cfg.checkpoint.interval) == (3e-4, "stas/openwebtext-10k", 1000)


def test_with_config_only_the_given_flags_override_the_file(in_tmp):
    argv = f"--run_name fromfile --config {REPO}/configs/tiny.toml --train_steps 7 --gpus_per_node 0 --dry_run"
    assert launch.main(argv.split()) == 0
    cfg = load_config("runs/fromfile/config.toml")
    file = load_config(str(REPO / "configs/tiny.toml"))
    assert cfg.training.steps == 7
    assert cfg.parallelism == file.parallelism and cfg.optimizer == file.optimizer and cfg.data == file.data


def test_flags_and_overrides_reach_their_config_keys(in_tmp):
    argv = (
        "--run_name mapped --gpus_per_node 0 --nodes 1 --dp 1 --tp 1 --pp 1 --hidden_size 64 --num_layers 3 "
        "--num_heads 4 --num_kv_heads 2 --max_seq_len 64 --train_steps 5 --learning_rate 1e-3 --micro_batch_size 3 "
        "--grad_accum_steps 2 --warmup_steps 1 --dataset data/corpus --pp_engine afab --tp_mode all_reduce "
        "--save_interval 2 --save_initial_state --resume_from_checkpoint none --profiler_export_path traces "
        "--optimizer.min_lr=1e-4 --training.eval_interval 0 --dry_run"
    )
    assert launch.main(argv.split()) == 0
    c = load_config("runs/mapped/config.toml")
    m, t, p = c.model, c.training, c.parallelism
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.max_seq_len) == (64, 3, 4, 2, 64)
    assert (t.seq_len, t.steps, t.micro_batch_size, t.grad_accum_steps, t.global_batch_size) == (64, 5, 3, 2, 6)
    assert (c.optimizer.lr, c.optimizer.warmup_steps, c.optimizer.min_lr, t.eval_interval) == (1e-3, 1, 1e-4, 0)
    assert (p.pp_engine, p.tp_mode, c.data.path) == ("afab", "all_reduce", "data/corpus")
    assert c.profiler.export_path == "traces"
    assert (c.checkpoint.interval, c.checkpoint.save_initial_state, c.checkpoint.resume_from) == (2, True, "none")


def test_more_processes_than_gpus_is_one_error_line_with_exit_code_2(tmp_path):
    argv = "--run_name x --nodes 1 --gpus_per_node 8 --dp 8 --tp 2 --dry_run".split()
    proc = run_launcher(*argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: dp*tp*pp = 8*2*1 = 16 processes but --nodes 1 x --gpus_per_node 8 = 8 GPUs (16 > 8 GPUs); "
        "lower --dp/--tp/--pp or raise --nodes\n"
    )
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("flags", "nodes", "per_node"),
    [
        (["--nodes", "4", "--gpus_per_node", "8", "--dp", "4", "--tp", "2"], 1, "--gpus-per-node=8"),
        (["--nodes", "2", "--gpus_per_node", "8", "--dp", "2", "--tp", "2"], 1, "--gpus-per-node=4"),
        (["--nodes", "2", "--gpus_per_node", "8", "--dp", "6", "--tp", "2"], 2, "--gpus-per-node=6"),
    ],
)
def test_only_the_nodes_and_gpus_that_dp_tp_pp_needs_are_requested(in_tmp, capsys, flags, nodes, per_node):
    assert launch.main(["--run_name", "shrink", *flags, "--dry_run"]) == 0
    out, err = capsys.readouterr()
    command = out.split("sbatch command")[1].splitlines()[1].split()
    assert f"--nodes={nodes}" in command and per_node in command
    assert err.startswith("note: dp*tp*pp = ") and "requesting only that" in err


def test_cpu_nodes_get_nproc_per_node_processes_and_no_gpu_request(in_tmp, capsys):
    argv = "--run_name cpu --nodes 2 --gpus_per_node 0 --nproc_per_node 2 --dp 4 --tp 1 --dry_run".split()
    assert launch.main([*argv, "--partition", ""]) == 0
    command = capsys.readouterr().out.split("sbatch command")[1].splitlines()[1].split()
    assert "--nodes=2" in command and "--export=ALL,NPROC_PER_NODE=2" in command
    assert not any(arg.startswith(("--gpus-per-node", "--partition")) for arg in command)


@pytest.mark.parametrize("name", ["a;rm -rf ~", "$(touch pwned)", "../escape", "a b", "-x", "", "x" * 101, "ü"])
def test_unsafe_run_names_are_refused_before_anything_is_written(tmp_path, name):
    proc = run_launcher(f"--run_name={name}", "--dry_run", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --run_name ") and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "0"], "error: argument --nodes: expected an integer >= 1, got '0'"),
        (["--node", "2"], "error: unrecognized argument --node: did you mean --nodes?"),
        (["--time_limit", "1h"], "error: --time_limit '1h': expected a Slurm time"),
        (["--partition", "gpu;reboot"], "error: --partition 'gpu;reboot': expected a Slurm partition name"),
        (["--email", "me@x.org;id"], "error: --email 'me@x.org;id': expected an address"),
        (["--nproc_per_node", "2"], "error: --nproc_per_node is for CPU nodes: add --gpus_per_node 0"),
        (["--job.name=other"], "error: --job.name: set the run name with --run_name"),
        (["--tp", "4", "--num_kv_heads", "2"], "error: parallelism.tp=4 must divide model.num_kv_heads=2"),
        (["--pp", "8", "--num_layers", "4", "--nodes", "8"], "error: model.num_layers=4 is too few for 8 pipeline"),
        (["--dp", "0"], "error: parallelism.dp: expected a value >= 1, got 0"),
        (["--pp_engine", "gpipe"], "error: parallelism.pp_engine: expected one of"),
        (["--training.stepz=3"], "error: unknown key 'training.stepz' in command line; did you mean 'steps'?"),
    ],
)
def test_bad_flags_are_one_error_line_with_exit_code_2(in_tmp, capsys, flags, message):
    assert launch.main(["--run_name", "bad", *flags, "--dry_run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(message) and err.count("\n") == 1 and out == ""


def test_missing_sbatch_is_a_clear_error_pointing_to_dry_run(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    proc = run_launcher("--run_name", "nosbatch", cwd=tmp_path, path=str(empty_bin))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: sbatch not found: run this on a Slurm login node, or add --dry_run")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_submit_runs_the_printed_command_and_reports_job_id_and_log(in_tmp, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", f'printf "%s\\n" "$@" > {in_tmp}/sbatch-args; echo "4242;cluster"')
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    assert launch.main("--run_name real --nodes 1 --dp 4 --tp 2".split()) == 0
    out = capsys.readouterr().out
    printed = out.split("sbatch command")[1].splitlines()[1].strip()
    assert shlex.split(printed)[1:] == (in_tmp / "sbatch-args").read_text().splitlines()
    assert "submitted job 4242; log: runs/real/slurm-4242.out" in out


def test_sbatch_refusal_is_reported_in_one_line(in_tmp, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", 'echo "sbatch: error: invalid partition specified: hopper-prod" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    assert launch.main(["--run_name", "refused"]) == 2
    assert capsys.readouterr().err == (
        "error: sbatch refused the job: sbatch: error: invalid partition specified: hopper-prod\n"
    )


def test_show_logs_follows_the_log_and_stops_when_the_job_ends(in_tmp, capsys, monkeypatch):
    log = in_tmp / "runs/follow/slurm-7.out"
    # The job runs for two polls, appending a line each time, then completes.
    fake_command(in_tmp / "bin", "sbatch", "echo 7")
    fake_command(
        in_tmp / "bin",
        "scontrol",
        f"n=$(cat {in_tmp}/polls 2>/dev/null || echo 0); echo $((n + 1)) > {in_tmp}/polls\n"
        f'echo "line $n" >> {log}\n'
        f'[ "$n" -lt 2 ] && state=RUNNING || state=COMPLETED\n'
        f'echo "JobId=7 JobName=follow JobState=$state Reason=None StdOut={log}"',
    )
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    assert launch.main("--run_name follow --nodes 1 --dp 4 --tp 2 --show_logs".split()) == 0
    out = capsys.readouterr().out
    assert out.endswith("line 0\nline 1\nline 2\njob 7: COMPLETED\n")


def test_show_logs_does_not_hang_when_the_log_file_is_elsewhere(in_tmp, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", "echo 8")
    fake_command(in_tmp / "bin", "scontrol", 'echo "JobId=8 JobState=FAILED StdOut=/nonexistent/other-8.out"')
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    assert launch.main("--run_name elsewhere --nodes 1 --dp 4 --tp 2 --show_logs".split()) == 1
    assert capsys.readouterr().out.endswith("no log file at /nonexistent/other-8.out\njob 8: FAILED\n")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 5400), ("10:30", 630), ("1:00:00", 3600), ("2-0", 172800), ("1-2:3", 93780), ("1-00:00:10", 86410)],
)
def test_time_limits_in_every_slurm_format(text, seconds):
    assert launch.time_limit_seconds(text) == seconds


def test_the_checkpoint_signal_comes_a_tenth_of_the_time_limit_early_at_most_ten_minutes(in_tmp, capsys):
    for limit, signal in (("20", "--signal=B:USR1@120"), ("24:00:00", "--signal=B:USR1@600")):
        launch.main(["--run_name", "sig", "--time_limit", limit, "--dry_run"])
        assert signal in capsys.readouterr().out


def test_job_script_refuses_a_missing_config_with_one_line():
    proc = subprocess.run(["bash", str(launch.JOB_SCRIPT), "no/such.toml"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: config 'no/such.toml' not found; usage: sbatch [options] launch/slurm.sh")


def test_every_launcher_flag_is_documented():
    guide = (REPO / "docs/multi-node-training.md").read_text()
    flags = [o for a in launch.build_parser()._actions for o in a.option_strings if o.startswith("--")]
    assert [f for f in flags if f"`{f}" not in guide and f != "--help"] == []
