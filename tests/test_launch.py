"""The Slurm launcher without a cluster: flags → resolved config → the exact sbatch command, and its refusals.

Submission is exercised against stand-in `sbatch`/`scontrol` executables on PATH that record their arguments;
real submissions run in tests/test_slurm.py.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanotron import train, trainer
from nanotron.commands import launch
from nanotron.config import Config, load_config, parse_overrides
from nanotron.launch import checks, cluster
from nanotron.tokenize.writer import DEFAULT_VALIDATION_SPLIT

REPO = Path(__file__).resolve().parents[1]


def run_launcher(*argv: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    """`python -m nanotron.launch` as a user types it: exit code and the exact stdout/stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "nanotron.launch", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )


def printed_sbatch(out: str) -> str:
    """The sbatch line of the submit script the launcher prints."""
    script = out.split("submit script (")[1].splitlines()[1:]
    return next(line.strip() for line in script if line.strip().startswith("sbatch "))


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


@pytest.fixture
def checked_data(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """For tests of flags and commands: records the configs whose data the launcher checks instead of tokenizing
    the corpus they name (the data checks themselves are tested below with a real corpus). The configs' local
    corpus folder exists, so data.path is a path and not a hub dataset name."""
    (in_tmp / "data" / "corpus").mkdir(parents=True)
    checked: list = []
    monkeypatch.setattr(
        checks, "check_data", lambda cfg: checked.append(cfg) or SimpleNamespace(num_train_samples=10**9)
    )
    return checked


def as_file(cfg: Config, root: Path) -> Config:
    """`cfg` with its relative paths made absolute from `root`, as the launcher writes them."""
    cfg = copy.deepcopy(cfg)
    for key in ("job.out_dir", "data.path", "data.tokenizer"):
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, str(root / getattr(getattr(cfg, section), name)))
    return cfg


def test_dry_run_writes_the_resolved_config_and_prints_the_exact_sbatch_command(in_tmp, checked_data, capsys):
    assert launch.main("--run_name exp1 --nodes 2 --dp 8 --tp 2 --model_size small --dry_run".split()) == 0
    out = capsys.readouterr().out

    cfg = load_config("runs/exp1/config.toml")
    assert (cfg.job.name, cfg.model.size, cfg.model.hidden_size) == ("exp1", "small", 768)
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (8, 2, 1)
    assert checked_data == [cfg]
    expected = [
        "sbatch",
        "--parsable",
        "--job-name=exp1",
        "--nodes=2",
        "--time=1:00:00",
        f"--output={in_tmp}/runs/exp1/slurm-%j.out",
        "--signal=B:USR1@360",  # no --partition: the cluster's default (no site's name)
        "--gpus-per-node=8",
        f"--export=ALL,NPROC_PER_NODE=8,NANOTRON_PYTHON={sys.executable}",
        str(cluster.JOB_SCRIPT),
        f"{in_tmp}/runs/exp1/config.toml",
    ]
    assert f"  {shlex.join(expected)}\n" in out
    assert (in_tmp / "runs/exp1/submit.sh").read_text().splitlines()[-1] == shlex.join(expected)
    assert "dry run: nothing submitted" in out


def test_every_slurm_and_environment_option_reaches_the_submission_it_shows(in_tmp, checked_data, capsys):
    """What a stranger's cluster asks for (account, QoS, reservation, excluded nodes, features, any other sbatch
    option) and how its nodes start (a set-up file, a container) are in the printed script and submit.sh."""
    (in_tmp / "setup.sh").write_text("module load cuda\n")
    argv = ["--run_name", "site", "--nodes", "2", "--dp", "4", "--dry_run", "--account", "proj-42", "--qos", "high"]
    argv += [
        "--reservation",
        "maint_1",
        "--exclude",
        "node[3-4],node7",
        "--constraint",
        "h100&ib",
        "--partition",
        "gpu",
    ]
    argv += ["--sbatch_args", "--mem=0 --comment='two words'", "--setup", "setup.sh"]
    argv += ["--container_image", "nvcr.io#nvidia/pytorch:24.05-py3", "--container_mounts", "/data:/data,/scratch:/s"]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    submit = (in_tmp / "runs/site/submit.sh").read_text().splitlines()
    exports = [
        f"export NANOTRON_SETUP={in_tmp}/setup.sh",
        "export NANOTRON_CONTAINER_IMAGE='nvcr.io#nvidia/pytorch:24.05-py3'",
        "export NANOTRON_CONTAINER_MOUNTS=/data:/data,/scratch:/s",
    ]
    assert submit[-4:-1] == exports
    sbatch = shlex.split(submit[-1])
    options = ["--partition=gpu", "--account=proj-42", "--qos=high", "--reservation=maint_1"]
    options += ["--exclude=node[3-4],node7", "--constraint=h100&ib"]
    assert [o for o in sbatch if o.split("=")[0] in {x.split("=")[0] for x in options}] == options
    assert sbatch[-4:-2] == ["--mem=0", "--comment=two words"]  # after ours: they override them
    assert "NANOTRON_PYTHON=python" in " ".join(sbatch)  # in a container, the image's Python
    for line in [*exports, submit[-1]]:
        assert f"  {line}\n" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--account", "a;rm -rf ~"], "--account 'a;rm -rf ~': unexpected characters for an sbatch --account value"),
        (["--sbatch_args", "mem=0"], "--sbatch_args 'mem=0': expected sbatch options"),
        (["--sbatch_args", "--comment='unclosed"], '--sbatch_args "--comment=\'unclosed": No closing quotation'),
        (["--setup", "missing.sh"], "--setup 'missing.sh': not a readable file"),
        (["--container_mounts", "/a:/a"], "--container_mounts needs --container_image"),
        (["--container_image", "i", "--container_exec", "apptainer exec x.sif"], "pick pyxis (image) or a wrapper"),
    ],
)
def test_bad_slurm_and_environment_options_are_one_line(in_tmp, checked_data, capsys, argv, expected):
    assert launch.main(["--run_name", "bad", "--dry_run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_run_that_repeats_its_corpus_or_outlasts_its_time_limit_is_warned_of(in_tmp, monkeypatch, capsys):
    """One warning line each, not an error: 250 steps x 64 samples over 2,000 samples is 8 passes (over the default
    4); large.toml's planned 5,000 steps on 4 x 8 H100s take hours, and a 2-hour limit means requeues."""
    monkeypatch.setattr(checks, "check_data", lambda cfg: SimpleNamespace(num_train_samples=2000))
    small = ["--run_name", "repeat", "--model_size", "tiny", "--nodes", "1", "--gpus_per_node", "0", "--dry_run"]
    small += ["--train_steps", "250", "--training.global_batch_size=64"]
    assert launch.main(small) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "passes over" in line or " h, more" in line]
    assert warnings == [
        "warning: 250 steps x 64 samples = 8.0 passes over the corpus's 2,000 training samples (more than "
        "--max_epochs 4): lower training.steps, add data, or raise --max_epochs if the repetition is intended"
    ]
    assert launch.main([*small, "--max_epochs", "10"]) == 0
    assert "passes over" not in capsys.readouterr().err
    assert launch.main([*small, "--max_epochs", "0"]) == 0  # 0: no warning (it warned on every run)
    assert "passes over" not in capsys.readouterr().err

    long = ["--run_name", "long", "--model_size", "large", "--nodes", "4", "--time_limit", "2:00:00", "--dry_run"]
    assert launch.main([*long, "--max_epochs", "1e9"]) == 0
    cfg = load_config("runs/long/config.toml")
    step = cluster.planned_step_seconds(cfg, launch.build_parser().parse_args(long), 8)
    hours, requeues = cfg.training.steps * step / 3600, math.ceil(cfg.training.steps * step / (7200 - 600)) - 1
    assert hours > 2 and requeues >= 1
    warning = next(line for line in capsys.readouterr().err.splitlines() if " h, more" in line)
    assert warning == (
        f"warning: {cfg.training.steps} steps of ~{step:.2f} s (the plan) take ~{hours:.1f} h, more than --time_limit "
        f"2:00:00: the job will requeue ~{requeues} time(s), each resuming from its latest checkpoint; raise "
        "--time_limit to run it in one go"
    )


@pytest.mark.parametrize("size", ["small", "base", "large"])
def test_a_model_size_trains_as_its_config_file_says(in_tmp, checked_data, size):
    assert launch.main(["--run_name", "sized", "--model_size", size, "--nodes", "4", "--dry_run"]) == 0
    cfg = load_config("runs/sized/config.toml")
    file = as_file(load_config(str(REPO / f"configs/{size}.toml"), [("job.name", "sized")]), in_tmp)
    assert cfg == file  # dtype, seq_len, batch, ZeRO stage, schedule, data: everything


def test_custom_architecture_flags_start_from_the_nearest_preset_with_a_llama_intermediate_size(in_tmp, checked_data):
    argv = "--run_name custom --hidden_size 2048 --num_layers 4 --num_heads 16 --num_kv_heads 4 --dry_run"
    assert launch.main(argv.split()) == 0
    m, t = (cfg := load_config("runs/custom/config.toml")).model, cfg.training
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads) == (2048, 5632, 4, 16, 4)
    assert (m.vocab_size, m.max_seq_len, t.seq_len, t.dtype) == (32000, 2048, 2048, "bfloat16")  # base.toml's


@pytest.mark.parametrize(("hidden", "intermediate"), [(2048, 5632), (4096, 11008), (5120, 13824)])
def test_the_derived_intermediate_size_is_llamas(hidden, intermediate):
    from nanotron.launch.flags import llama_intermediate_size

    assert llama_intermediate_size(hidden) == intermediate


def test_the_dry_run_prints_the_resolved_model(in_tmp, checked_data, capsys):
    assert launch.main("--run_name shown --model_size base --dry_run".split()) == 0
    assert (
        "model: 1.74B parameters | 24 layers | hidden 2048 | intermediate 8192 | 16 heads (16 kv) | vocab 32000 | "
        "seq_len 2048 (max 2048) | bfloat16\n"
    ) in capsys.readouterr().out


def test_with_config_only_the_given_flags_override_the_file(in_tmp, checked_data):
    argv = f"--run_name fromfile --config {REPO}/configs/tiny.toml --train_steps 7 --gpus_per_node 0 --dry_run"
    assert launch.main(argv.split()) == 0
    cfg = load_config("runs/fromfile/config.toml")
    file = as_file(load_config(str(REPO / "configs/tiny.toml")), in_tmp)
    assert cfg.training.steps == 7
    assert cfg.parallelism == file.parallelism and cfg.optimizer == file.optimizer and cfg.data == file.data


def test_flags_and_overrides_reach_their_config_keys(in_tmp, checked_data):
    (in_tmp / "corpus").mkdir()
    argv = (
        "--run_name mapped --gpus_per_node 0 --nodes 1 --nproc_per_node 2 --dp 1 --cp 2 --tp 1 --pp 1 "
        "--hidden_size 64 --intermediate_size 96 "
        "--num_layers 3 --num_heads 4 --num_kv_heads 2 --vocab_size 640 --max_seq_len 64 --seq_len 32 --train_steps 5 "
        "--learning_rate 1e-3 --micro_batch_size 3 --grad_accum_steps 2 --warmup_steps 1 --dataset corpus "
        "--pp_engine afab --tp_mode all_reduce --save_interval 2 --save_initial_state --resume_from_checkpoint none "
        "--profiler_export_path traces --optimizer.min_lr=1e-4 --training.eval_interval 0 --dry_run "
        "--ep 2 --model.moe.num_experts=4"
    )
    assert launch.main(argv.split()) == 0
    c = load_config("runs/mapped/config.toml")
    m, t, p = c.model, c.training, c.parallelism
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads) == (64, 96, 3, 4, 2)
    assert (m.vocab_size, m.max_seq_len, t.seq_len) == (640, 64, 32)
    assert (t.steps, t.micro_batch_size, t.global_batch_size, t.grad_accum_steps) == (5, 3, 6, 2)
    assert (c.optimizer.lr, c.optimizer.warmup_steps, c.optimizer.min_lr, t.eval_interval) == (1e-3, 1, 1e-4, 0)
    assert (p.pp_engine, p.tp_mode, c.data.path) == ("afab", "all_reduce", str(in_tmp / "corpus"))
    assert p.cp == 2 and p.ep == 2 and m.moe.num_experts == 4  # nanotron's --cp, --ep
    assert c.profiler.export_path == str(in_tmp / "traces")
    assert (c.checkpoint.interval, c.checkpoint.save_initial_state, c.checkpoint.resume_from) == (2, True, "none")


def test_a_seq_len_beyond_the_models_max_seq_len_raises_it(in_tmp, checked_data):
    assert launch.main("--run_name long --model_size small --seq_len 4096 --dry_run".split()) == 0
    cfg = load_config("runs/long/config.toml")
    assert (cfg.training.seq_len, cfg.model.max_seq_len) == (4096, 4096)


def test_the_run_config_names_every_path_absolutely_and_runs_at_another_layout(in_tmp, checked_data):
    argv = "--run_name paths --model_size base --dp 8 --tp 2 --job.out_dir=out --checkpoint.dir=~/ckpt --dry_run"
    assert launch.main(argv.split()) == 0
    cfg = load_config("out/paths/config.toml")
    assert cfg.job.out_dir == str(in_tmp / "out") and cfg.checkpoint.dir == str(Path.home() / "ckpt")
    assert cfg.data.path == str(in_tmp / "data/tokenized/corpus")
    assert cfg.data.tokenizer == str(in_tmp / "data/tokenizer")
    elsewhere = load_config("out/paths/config.toml", [("parallelism.dp", "4")]).training
    assert (elsewhere.global_batch_size, elsewhere.grad_accum_steps) == (256, 32)


def test_blended_dataset_paths_are_written_absolutely_and_checked_for_control_characters(in_tmp, checked_data, capsys):
    for name in ("web", "code"):
        (in_tmp / "tok" / name).mkdir(parents=True)  # existing dirs: paths, not hub dataset names
    argv = ["--run_name", "mix", "--model_size", "small", "--data.datasets=tok/web:0.7,tok/code:0.3", "--dry_run"]
    assert launch.main(argv) == 0
    cfg = load_config("runs/mix/config.toml")
    assert [(d.path, d.weight) for d in cfg.data.datasets] == [
        (str(in_tmp / "tok/web"), 0.7),
        (str(in_tmp / "tok/code"), 0.3),
    ]
    (in_tmp / "job.toml").write_text('[data]\n[[data.datasets]]\npath = "a\\nb"\n')
    capsys.readouterr()
    assert launch.main(["--run_name", "ctrl", "--config", "job.toml", "--dry_run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: data.datasets[0].path: ") and "a\\nb' contains a control character" in err


def test_more_processes_than_gpus_is_one_error_line_with_exit_code_2(tmp_path):
    argv = "--run_name x --model_size base --nodes 1 --gpus_per_node 8 --dp 8 --tp 2 --dry_run".split()
    proc = run_launcher(*argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: dp*cp*tp*pp = 8*1*2*1 = 16 processes but --nodes 1 x --gpus_per_node 8 = 8 GPUs (16 > 8 GPUs); "
        "lower --dp/--cp/--tp/--pp or raise --nodes\n"
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
def test_only_the_nodes_and_gpus_that_dp_tp_pp_needs_are_requested(
    in_tmp, checked_data, capsys, flags, nodes, per_node
):
    assert launch.main(["--run_name", "shrink", *flags, "--grad_accum_steps", "1", "--dry_run"]) == 0
    out, err = capsys.readouterr()
    command = printed_sbatch(out).split()
    assert f"--nodes={nodes}" in command and per_node in command
    assert err.startswith("note: dp*cp*tp*pp = ") and "requesting only that" in err


def test_cpu_nodes_get_nproc_per_node_processes_and_no_gpu_request(in_tmp, checked_data, capsys):
    argv = "--run_name cpu --nodes 2 --gpus_per_node 0 --nproc_per_node 2 --dp 4 --tp 1 --dry_run".split()
    assert launch.main([*argv, "--partition", ""]) == 0
    command = printed_sbatch(capsys.readouterr().out).split()
    assert "--nodes=2" in command and f"--export=ALL,NPROC_PER_NODE=2,NANOTRON_PYTHON={sys.executable}" in command
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
        (["--max_epochs", "nan"], "error: argument --max_epochs: expected a finite number >= 0, got 'nan'"),
        (["--max_epochs", "inf"], "error: argument --max_epochs: expected a finite number >= 0, got 'inf'"),
        (["--max_epochs", "-1"], "error: argument --max_epochs: expected a finite number >= 0, got '-1'"),
    ],
)
def test_bad_flags_are_one_error_line_with_exit_code_2(in_tmp, checked_data, capsys, flags, message):
    assert launch.main(["--run_name", "bad", *flags, "--dry_run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(message) and err.count("\n") == 1 and out == ""


def test_a_resume_checkpoint_the_job_would_refuse_is_one_line_on_the_login_node(in_tmp, checked_data, capsys):
    """Checkpoints live on the shared filesystem the login node mounts: a --resume_from_checkpoint that is no
    committed step dir (missing, or a run dir: the trainer resumes from a step dir) was accepted, and the job failed
    only once it had nodes. It is refused by the trainer's own resolver, with a hint, and nothing is written."""
    step = in_tmp / "old" / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    for path, expected in [
        ("missing", f"'{in_tmp}/missing' does not exist"),
        ("old", f"'{in_tmp}/old' is a folder of checkpoints: give one, e.g. its latest '{step}'"),
    ]:
        assert launch.main(["--run_name", "r", "--resume_from_checkpoint", path, "--dry_run"]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"error: checkpoint.resume_from: {expected}; ") and err.count("\n") == 1, err
        assert out == "" and not (in_tmp / "runs").exists()
    assert launch.main(["--run_name", "r", "--resume_from_checkpoint", str(step), "--dry_run"]) == 0


@pytest.mark.slow
def test_missing_sbatch_is_a_clear_error_pointing_to_dry_run(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    proc = run_launcher("--run_name", "nosbatch", cwd=tmp_path, path=str(empty_bin))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: sbatch not found: run this on a Slurm login node, or add --dry_run")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_submit_runs_the_printed_command_and_reports_job_id_and_log(in_tmp, checked_data, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", f'printf "%s\\n" "$@" > {in_tmp}/sbatch-args; echo "4242;cluster"')
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    assert launch.main("--run_name real --nodes 1 --dp 4 --tp 2".split()) == 0
    out = capsys.readouterr().out
    printed = printed_sbatch(out)
    assert shlex.split(printed)[1:] == (in_tmp / "sbatch-args").read_text().splitlines()
    assert f"submitted job 4242; log: {in_tmp}/runs/real/slurm-4242.out" in out


def test_sbatch_refusal_is_reported_in_one_line(in_tmp, checked_data, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", 'echo "sbatch: error: invalid partition specified: hopper-prod" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    assert launch.main(["--run_name", "refused"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] + "\n" == (
        "error: sbatch refused the job: sbatch: error: invalid partition specified: hopper-prod\n"
    )


def test_show_logs_follows_the_log_and_stops_when_the_job_ends(in_tmp, checked_data, capsys, monkeypatch):
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
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    assert launch.main("--run_name follow --nodes 1 --dp 4 --tp 2 --show_logs".split()) == 0
    out = capsys.readouterr().out
    assert out.endswith("line 0\nline 1\nline 2\njob 7: COMPLETED\n")


def test_show_logs_does_not_hang_when_the_log_file_is_elsewhere(in_tmp, checked_data, capsys, monkeypatch):
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
    assert cluster.time_limit_seconds(text) == seconds


def test_the_checkpoint_signal_comes_a_tenth_of_the_time_limit_early_at_most_ten_minutes(in_tmp, checked_data, capsys):
    for limit, signal in (("20", "--signal=B:USR1@120"), ("24:00:00", "--signal=B:USR1@600")):
        launch.main(["--run_name", "sig", "--time_limit", limit, "--dry_run"])
        assert signal in capsys.readouterr().out


def test_job_script_refuses_a_missing_config_with_one_line():
    proc = subprocess.run(["bash", str(cluster.JOB_SCRIPT), "no/such.toml"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: config 'no/such.toml' not found; usage: sbatch [options] launch/slurm.sh")


def test_every_launcher_flag_is_documented():
    guide = (REPO / "docs/multi-node-training.md").read_text()
    flags = [o for a in launch.build_parser()._actions for o in a.option_strings if o.startswith("--")]
    assert [f for f in flags if f"`{f}" not in guide and f != "--help"] == []


# ---- strings the launcher writes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--dataset", "corpus\ntouch pwned"], "--dataset"),
        (["--profiler_export_path=traces\r"], "--profiler_export_path"),
        (["--data.tokenizer", "tok\x1b[2J"], "--data.tokenizer"),
        (["--run_name=a\nb"], "--run_name"),
    ],
)
def test_control_characters_in_any_value_are_refused_before_anything_is_written(tmp_path, args, flag):
    proc = run_launcher(*(["--run_name", "inj"] if flag != "--run_name" else []), *args, "--dry_run", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {flag}: ") and "control character" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no submit.sh whose comment line a newline would have ended


def test_control_characters_from_a_config_file_are_refused_too(in_tmp, checked_data, capsys):
    (in_tmp / "job.toml").write_text('[logging]\nwandb_group = "text\\n#"\n')
    assert launch.main(["--run_name", "ctrl", "--config", "job.toml", "--dry_run"]) == 2
    assert capsys.readouterr().err.startswith("error: logging.wandb_group: 'text\\n#' contains a control character")
    assert not (in_tmp / "runs").exists()


# ---- first contact: spellings of the original nanotron --------------------------------------------------------------


def test_the_original_launchers_hyphenated_flags_work(in_tmp, checked_data, capsys):
    """huggingface/nanotron's slurm_launcher.py spells these flags with hyphens; each sets what ours does."""
    argv = (
        "--run_name spelled --gpus_per_node 0 --hidden-size 64 --intermediate-size 128 --num-layers 2 --num-heads 4 "
        "--num-kv-heads 2 --vocab-size 1024 --learning-rate 0.002 --warmup-steps 5 --save-interval 10 "
        "--save-initial-state --dry-run"
    )
    assert launch.main(argv.split()) == 0
    cfg = load_config("runs/spelled/config.toml")
    m = cfg.model
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads) == (64, 128, 2, 4, 2)
    assert (m.vocab_size, cfg.optimizer.lr, cfg.optimizer.warmup_steps) == (1024, 0.002, 5)
    assert (cfg.checkpoint.interval, cfg.checkpoint.save_initial_state) == (10, True)
    assert "dry run: nothing submitted" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "ours"),
    [("--run-name", "--run_name"), ("--train-steps", "--train_steps"), ("--gpus-per-node", "--gpus_per_node")],
)
def test_other_hyphenated_forms_of_our_flags_are_one_line_naming_ours(in_tmp, checked_data, capsys, flag, ours):
    assert launch.main([*(["--run_name", "x"] if flag != "--run-name" else []), flag, "4", "--dry_run"]) == 2
    assert capsys.readouterr().err == f"error: unrecognized argument {flag}: use {ours}\n"
    assert launch.main(["--run_name", "x", "--config-file", "a.toml", "--dry_run"]) == 2
    assert capsys.readouterr().err.startswith("error: --config-file is the original nanotron's spelling: use --config")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mbs", "4"], "error: unrecognized argument --mbs: nanotron's original --mbs is --micro_batch_size\n"),
        (["--model", "7b"], "error: unrecognized argument --model: nanotron's original --model is --model_size"),
        (["--config", "config.yaml"], "error: --config: 'config.yaml' is YAML; nanotron configs are TOML"),
    ],
)
def test_the_original_launchers_other_flags_and_yaml_configs_get_a_one_line_hint(in_tmp, capsys, args, message):
    (in_tmp / "config.yaml").write_text("general:\n  project: x\n")
    assert launch.main(["--run_name", "hint", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


# ---- what would fail in the queue ---------------------------------------------------------------------------------


def test_paths_on_node_local_filesystems_are_named_and_unknown_ones_said_so(tmp_path):
    for folder in ("tmp", "scratch", "home", "odd"):
        (tmp_path / folder).mkdir()
    kinds = {"tmp": "tmpfs", "scratch": "lustre", "home": "nfs4", "odd": "fuse.unknownfs"}
    mounts = [("/", "nfs"), *((str(tmp_path / folder), kind) for folder, kind in kinds.items())]
    paths = {
        "job.out_dir": tmp_path / "scratch/runs",
        "data.path": tmp_path / "home/me/corpus-not-there-yet",
        "checkpoint.dir": tmp_path / "tmp/checkpoints",
        "the working directory": tmp_path / "tmp",
        "data.tokenizer": tmp_path / "odd/tok",
    }
    notes = checks.shared_filesystem_notes(paths, mounts)
    assert len(notes) == 2, notes
    assert notes[0].startswith(
        f"warning: checkpoint.dir, the working directory on a node-local filesystem (tmpfs at {tmp_path}/tmp)"
    )
    assert notes[1].startswith(f"note: cannot tell whether data.tokenizer (fuse.unknownfs at {tmp_path}/odd) is shared")


def test_the_launcher_reports_node_local_paths_before_submitting(in_tmp, checked_data, capsys, monkeypatch):
    monkeypatch.setattr(checks, "mount_table", lambda: [("/", "nfs"), (str(in_tmp), "tmpfs")])
    assert launch.main(["--run_name", "local", "--dry_run"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: the working directory, job.out_dir, data.tokenizer, data.path on a node-local "
        f"filesystem (tmpfs at {in_tmp})"
    )


def test_a_corpus_too_small_for_the_config_fails_before_submitting(tiny_data, in_tmp, capsys, monkeypatch):
    fake_command(in_tmp / "bin", "sbatch", f"touch {in_tmp}/submitted; echo 1")
    monkeypatch.setenv("PATH", f"{in_tmp / 'bin'}:{os.environ['PATH']}")
    argv = ["--run_name", "small", "--model_size", "small", *tiny_data.overrides()]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: data.path: the train split has ") and "training.global_batch_size=256" in err
    assert not (in_tmp / "submitted").exists() and not (in_tmp / "runs").exists()


def test_the_trainer_checks_the_corpus_size_before_building_the_model(tiny_data, tmp_path, capsys, monkeypatch):
    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(trainer, "build_model", build_model)
    argv = ["--config", f"{REPO}/configs/small.toml", *tiny_data.overrides(), f"--job.out_dir={tmp_path}"]
    assert train.main([*argv, "--parallelism.dp=1", "--training.seq_len=16", "--training.global_batch_size=64"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: data.path: the validation split has ")


@pytest.mark.parametrize("size", ["small", "base", "large"])
def test_the_cluster_configs_say_what_data_they_need(size):
    cfg = load_config(str(REPO / f"configs/{size}.toml"))
    t = cfg.training
    validation = t.eval_steps * t.global_batch_size * (t.seq_len + 1)
    header = " ".join(line[1:].strip() for line in (REPO / f"configs/{size}.toml").read_text().splitlines()[:8])
    expected = (
        f"{t.eval_steps} x {t.global_batch_size} samples of {t.seq_len + 1} tokens = {validation / 1e6:.1f}M "
        f"validation tokens, i.e. a corpus of at least {validation / DEFAULT_VALIDATION_SPLIT / 1e6:.0f}M tokens "
        f"at `nanotron tokenize --validation_split {DEFAULT_VALIDATION_SPLIT}` (its default)"
    )
    assert expected in header, header
    assert f"{t.steps * t.global_batch_size * t.seq_len / 1e9:.1f}B tokens" in header


# ---- the documented by-hand commands ------------------------------------------------------------------------------


def documented_sbatch_lines() -> list[tuple[str, str]]:
    """Every `sbatch ... launch/slurm.sh configs/X.toml ...` in the docs, the job script and the configs, with
    continuation lines joined and comments dropped."""
    found = []
    for doc in (
        "README.md",
        "docs/multi-node-training.md",
        "launch/slurm.sh",
        *sorted((REPO / "configs").glob("*.toml")),
    ):
        text = re.sub(r"\\\n\s*", " ", (REPO / doc).read_text())
        for line in text.splitlines():
            for part in line.split("`")[1::2] if "`" in line else [line]:  # inline code, or a line of a code block
                command = part.lstrip("# ").split("  #")[0].strip()
                if "sbatch " in command and " launch/slurm.sh configs/" in command:
                    found.append((str(doc), command))
    return found


def test_every_documented_by_hand_command_starts_as_many_processes_as_its_config_needs():
    lines = documented_sbatch_lines()
    assert len(lines) >= 6, lines
    for doc, line in lines:
        words = [w for w in shlex.split(line) if not re.match(r"^\[|\]$|^\.\.\.", w)]
        script = words.index("launch/slurm.sh")
        env = dict(w.split("=", 1) for w in words[: words.index("sbatch")])
        options = dict(
            zip(words[words.index("sbatch") + 1 : script : 2], words[words.index("sbatch") + 2 : script : 2])
        )
        assert "--output" not in options and "mkdir" not in line, (doc, line)  # the script's default log works as is
        cfg = load_config(str(REPO / words[script + 1]), parse_overrides(words[script + 2 :])[1])
        per_node = int(env.get("NPROC_PER_NODE", options.get("--gpus-per-node", 1)))
        assert int(options["--nodes"]) * per_node == cfg.world_size, (doc, line)


def test_plan_and_launch_refuse_a_muon_adamw_name_that_matches_no_parameter(in_tmp, checked_data, capsys):
    """The login node says what the job would refuse at its start: a typo in optimizer.muon_adamw_names (it would
    also plan the typo's matrices with Muon's optimizer state)."""
    from nanotron.commands import plan

    typo = ["--optimizer.name=muon", "--optimizer.muon_adamw_names=mlp.gate_prj"]
    message = "optimizer.muon_adamw_names: 'mlp.gate_prj' is part of no parameter's name; did you mean 'mlp.gate_proj"
    for command in (
        lambda: plan.main(["--config", f"{REPO}/configs/small.toml", *typo]),
        lambda: launch.main(["--run_name", "typo", "--model_size", "small", "--dry_run", *typo]),
    ):
        assert command() == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(errors) == 1 and message in errors[0], errors
