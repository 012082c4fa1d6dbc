"""Real Slurm jobs on a local cluster: `launch/slurm.sh` by hand, the launcher, and preempt → requeue → resume.

These tests submit only to a cluster they may spend: the project's own local cluster (tests/slurm/cluster-up.sh,
ClusterName=nanotron-local-test; `.ci/run` starts one and exports SLURM_CONF, or one is started here for this module
and stopped after it), or a real cluster the user names explicitly with NANOTRON_TEST_SLURM_CLUSTER=<its ClusterName>
(`scontrol show config`). Any other cluster that answers — a login node's — is never submitted to. The SLURM_LOCAL_*
knobs of cluster-up.sh (ports, node prefix) pass through from the environment, so it can run beside another cluster.
Without Slurm installed the tests skip; in CI (CI=true) they fail instead, so a cluster that can't start is never
mistaken for a pass.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO, TEST_VARIABLE, TINY_MODEL, TinyData, read_metrics, run_train, train_env

# Tests that submit jobs are marked `cluster`: one at a time on the cluster, beside other shared tests.

CLUSTER_SCRIPTS = REPO / "tests" / "slurm"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def unavailable(reason: str) -> None:
    """Skip where Slurm can't run; in CI, fail: these tests are the proof that the Slurm path works."""
    if IN_CI:
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


LOCAL_CLUSTER = "nanotron-local-test"  # ClusterName in the slurm.conf tests/slurm/cluster-up.sh writes
OPT_IN = "NANOTRON_TEST_SLURM_CLUSTER"  # the ClusterName of a real cluster the user lets these tests submit to


def cluster_answers(env: dict[str, str]) -> bool:
    if shutil.which("scontrol") is None:
        return False
    ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=20)
    return ping.returncode == 0 and "UP" in ping.stdout


def cluster_name(env: dict[str, str]) -> str:
    config = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True, text=True, timeout=20)
    return next(
        (line.split("=", 1)[1].strip() for line in config.stdout.splitlines() if line.startswith("ClusterName")), ""
    )


def may_submit_to(name: str, opt_in: str) -> bool:
    """The project's own test cluster, or the one cluster the user named; never whatever answers."""
    return name == LOCAL_CLUSTER or (bool(opt_in) and name == opt_in)


@pytest.mark.parametrize(
    "name, opt_in, allowed",
    [
        (LOCAL_CLUSTER, "", True),
        ("university-hpc", "", False),  # a login node's cluster answers: never spent unasked
        ("university-hpc", "university-hpc", True),
        ("university-hpc", "other-cluster", False),
        ("", "", False),
    ],
)
def test_the_tests_submit_only_to_their_own_cluster_or_one_named_explicitly(name, opt_in, allowed):
    assert may_submit_to(name, opt_in) is allowed


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for sbatch/scontrol and the jobs (they inherit it): a running cluster, or one started here."""
    env = {k: v for k, v in train_env().items() if k != "NPROC_PER_NODE"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the venv activated, as the docs ask
    if cluster_answers(env):
        name = cluster_name(env)
        if may_submit_to(name, os.environ.get(OPT_IN, "")):
            yield env
            return
        if not IN_CI:
            pytest.skip(
                f"the Slurm cluster that answers (ClusterName={name or '?'}) is not the project's local test cluster: "
                f"set {OPT_IN}={name} to let these tests submit real jobs to it"
            )
    if shutil.which("sbatch") is None and not IN_CI:  # CI lets cluster-up.sh install the packages
        pytest.skip("Slurm is not installed; as root, `bash tests/slurm/cluster-up.sh DIR` installs and starts it")
    if os.geteuid() != 0:
        unavailable("no Slurm cluster answers `scontrol ping` and starting the local one needs root")
    cluster = tmp_path_factory.mktemp("slurm-cluster")
    # the daemons outlive the test that starts them: without its marker, or the test's end would kill them
    setup = {k: v for k, v in os.environ.items() if k != TEST_VARIABLE}
    setup |= {"SLURM_LOCAL_NODES": "3", "SLURM_LOCAL_FAKE_GPUS": "2"}
    up_script = ["bash", str(CLUSTER_SCRIPTS / "cluster-up.sh"), str(cluster)]
    down = ["bash", str(CLUSTER_SCRIPTS / "cluster-down.sh"), str(cluster)]
    up = subprocess.run(up_script, env=setup, capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        subprocess.run(down, capture_output=True, timeout=300)
        unavailable(f"the local Slurm cluster did not start:\n{up.stdout[-2000:]}{up.stderr[-3000:]}")
    try:
        yield {**env, "SLURM_CONF": str(cluster / "etc" / "slurm.conf")}
    finally:
        subprocess.run(down, capture_output=True, timeout=300)


def job_args(data: TinyData, out_dir: Path, name: str, *overrides: str) -> list[str]:
    """Trainer arguments after the config: the tiny model on the synthetic corpus, one metrics line per step."""
    run = [f"--job.out_dir={out_dir}", f"--job.name={name}", "--checkpoint.interval=0", "--training.device=cpu"]
    return ["configs/tiny.toml", *TINY_MODEL, *data.overrides(), *run, *overrides]


SUBMITTED: list[tuple[str, dict[str, str]]] = []  # the running test's jobs, with the environment that reaches them


def sbatch(args: list[str], env: dict[str, str], cwd: Path = REPO) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    SUBMITTED.append((job, env))
    return job


@pytest.fixture(autouse=True)
def _cancel_submitted() -> Iterator[None]:
    """A test's jobs end with it: one that failed mid-job (or timed out) must not leave its job running or requeued,
    holding the nodes that the next cluster test's jobs wait for. Its own jobs only: the cluster may be shared."""
    yield
    while SUBMITTED:
        job, env = SUBMITTED.pop()
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60)


def job_field(job: str, field: str, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return next((item.split("=", 1)[1] for item in out.split() if item.startswith(f"{field}=")), "")


def wait_for(condition: Callable[[], object], timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.is_file() else "(no log)"
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; log:\n{tail}")
        time.sleep(0.25)


def wait_until_done(job: str, env: dict[str, str], log: Path, timeout: float = 240) -> str:
    wait_for(lambda: job_field(job, "JobState", env) in TERMINAL, timeout, f"job {job} to end", log)
    return job_field(job, "JobState", env)


def release_requeued(job: str, restarts: int, env: dict[str, str], log: Path) -> None:
    """Slurm holds a requeued job back for ~2 minutes (BeginTime, until the old job credential expires); start it
    sooner. The nodes refuse credentials issued in the same second as the revocation, hence the short pause."""
    pending = lambda: job_field(job, "Restarts", env) == str(restarts) and job_field(job, "JobState", env) == "PENDING"
    wait_for(pending, 60, f"job {job} to be requeued (restart {restarts})", log)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)


def train_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "metrics.jsonl").is_file():
        return []
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def cluster_has_gpus(env: dict[str, str]) -> bool:
    return gpus_per_node(env) > 0


def gpus_per_node(env: dict[str, str]) -> int:
    nodes = subprocess.run(["scontrol", "show", "nodes", "-o"], env=env, capture_output=True, text=True).stdout
    return int(match[1]) if (match := re.search(r"Gres=gpu:(\d+)", nodes)) else 0


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("allocation", ["NPROC_PER_NODE=2", "--gpus-per-node=2"])
def test_two_node_job_script_trains_with_world_size_nodes_times_processes(slurm_env, tiny_data, tmp_path, allocation):
    env, sbatch_options = dict(slurm_env), []
    if allocation.startswith("NPROC"):  # CPU nodes: the explicit variable
        env["NPROC_PER_NODE"] = "2"
    elif cluster_has_gpus(env):  # GPU nodes: one process per allocated GPU (count-only fake GPUs here)
        sbatch_options.append(allocation)
    else:
        pytest.skip("the cluster declares no GPUs (start it with SLURM_LOCAL_FAKE_GPUS=2)")
    args = job_args(tiny_data, tmp_path, "by-hand", "--parallelism.dp=4", "--training.steps=4")
    job = sbatch(["--nodes=2", f"--output={tmp_path}/%x-%j.out", *sbatch_options, "launch/slurm.sh", *args], env)
    log = tmp_path / f"nanotron-{job}.out"

    state = wait_until_done(job, env, log)

    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "2 node(s) x 2 process(es)" in text and " on 4 x cpu " in text
    assert train_steps(tmp_path / "by-hand") == [1, 2, 3, 4]


@pytest.fixture
def reservation(slurm_env) -> Iterator[str]:
    """A reservation of every node for this test (the launcher's --reservation must name one that exists)."""
    name = f"nanotron_test_{os.getpid()}"
    create = ["scontrol", "create", "reservation", f"reservationname={name}", "users=root", "nodes=ALL"]
    create += ["starttime=now", "duration=30", "flags=ignore_jobs"]
    if subprocess.run(create, env=slurm_env, capture_output=True).returncode != 0:
        unavailable("could not create a Slurm reservation (needs root on the local cluster)")
    yield name
    subprocess.run(["scontrol", "delete", f"reservation={name}"], env=slurm_env, capture_output=True)


@pytest.mark.slow
@pytest.mark.cluster
def test_launcher_job_on_two_cpu_nodes_completes_and_show_logs_follows_it(slurm_env, tiny_data, tmp_path, reservation):
    """Also every option a stranger's cluster asks for reaches the job, and the set-up file runs on every node
    before the trainers' Python (it puts a sitecustomize on PYTHONPATH, which each trainer runs at start). QoS is
    passed and accepted; without an accounting database the local cluster does not record it."""
    nodes = subprocess.run(["sinfo", "-h", "-o", "%N"], env=slurm_env, capture_output=True, text=True).stdout
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodes.strip()], env=slurm_env, capture_output=True, text=True
    )
    excluded = hosts.stdout.split()[-1] if len(hosts.stdout.split()) > 2 else ""
    site_dir = tmp_path / "site"  # every Python started after the set-up logs its command line
    site_dir.mkdir()
    command_line = "open('/proc/self/cmdline').read().replace(chr(0), ' ')"
    (site_dir / "sitecustomize.py").write_text(
        f"open({str(tmp_path / 'starts.log')!r}, 'a').write({command_line} + chr(10))\n"
    )
    (tmp_path / "setup.sh").write_text(f'export PYTHONPATH="{site_dir}:$PYTHONPATH"\n')
    site = ["--account", "proj42", "--qos", "normal", "--reservation", reservation, "--constraint", "local&cpu"]
    site += ["--sbatch_args", "--comment=from-the-launcher", "--setup", str(tmp_path / "setup.sh")]
    site += ["--exclude", excluded] if excluded else []
    flags = (
        "--run_name via-launcher --nodes 2 --gpus_per_node 0 --nproc_per_node 2 --time_limit 10 --dp 4 --tp 1 "
        "--pp 1 --train_steps 4 --micro_batch_size 2 --grad_accum_steps 1 --max_seq_len 16 --hidden_size 32 "
        "--num_layers 4 --num_heads 4 --num_kv_heads 2 --save_interval 0 --show_logs"
    ).split()
    paths = ["--partition", "", "--dataset", str(tiny_data.tokenized), f"--job.out_dir={tmp_path}"]
    overrides = (
        "--model.vocab_size=512 --model.intermediate_size=64 --training.eval_interval=0 --logging.log_interval=1 "
        "--logging.tensorboard=false --logging.peak_tflops=1 --training.device=cpu"
    ).split()
    overrides.append(f"--data.tokenizer={tiny_data.tokenizer}")

    cmd = [sys.executable, "-m", "nanotron.launch", *flags, *site, *paths, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)

    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    job = proc.stdout.split("submitted job ")[1].split(";")[0]
    info = dict(
        f.split("=", 1)
        for f in subprocess.check_output(["scontrol", "show", "job", "-o", job], env=slurm_env, text=True).split()
        if "=" in f
    )
    assert (info["Account"], info["Reservation"], info["Features"]) == ("proj42", reservation, "local&cpu")
    assert info["Comment"] == "from-the-launcher" and info["ExcNodeList"] == (excluded or "(null)")
    starts = (tmp_path / "starts.log").read_text().splitlines()
    launchers = [s for s in starts if " -m nanotron torchrun " in s]
    trainers = [s for s in starts if " -m nanotron.train " in s and s not in launchers]
    assert (len(launchers), len(trainers)) == (2, 4)  # on 2 nodes, 2 trainers each, all after the set-up
    assert f"job {job}: COMPLETED" in proc.stdout
    assert "2 node(s) x 2 process(es)" in proc.stdout and " on 4 x cpu " in proc.stdout  # the followed log
    assert (tmp_path / "via-launcher" / f"slurm-{job}.out").is_file()
    assert train_steps(tmp_path / "via-launcher") == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.cluster
def test_preempted_job_checkpoints_and_requeued_job_resumes_until_done(slurm_env, tiny_data, tmp_path):
    steps, run = 30, tmp_path / "preempt"
    env = {**slurm_env, "NPROC_PER_NODE": "1"}
    # 8 microbatches per step: slow enough that each signal lands long before the last step.
    batch = "--training.global_batch_size=32"
    args = job_args(tiny_data, tmp_path, "preempt", "--parallelism.dp=2", f"--training.steps={steps}", batch)
    job = sbatch(["--nodes=2", f"--output={tmp_path}/%x-%j.out", "launch/slurm.sh", *args], env)
    log = tmp_path / f"nanotron-{job}.out"

    # 1. SIGUSR1 to the job's processes (the trainer; torchrun ignores it): checkpoint, exit 0, job completes.
    wait_for(lambda: train_steps(run), 180, "the first training step", log)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True)
    assert wait_until_done(job, env, log) == "COMPLETED", log.read_text()[-4000:]
    stopped = train_steps(run)[-1]
    assert stopped < steps
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{stopped}"

    # 2. A requeue resumes from that checkpoint; SIGUSR1 to the job script (as at the time limit) makes the
    #    script forward it to the trainer and requeue the job itself; the third run finishes the training.
    subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    release_requeued(job, 1, env, log)
    wait_for(lambda: len(train_steps(run)) >= stopped + 2, 180, "the requeued job to train", log)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    release_requeued(job, 2, env, log)
    assert wait_until_done(job, env, log) == "COMPLETED", log.read_text()[-4000:]

    text = log.read_text()
    assert text.count("preempted: stopped at step") == 2 and f"preempted: requeueing job {job}" in text
    assert train_steps(run) == list(range(1, steps + 1)), "each run must resume exactly after the last checkpoint"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{steps}"


@pytest.mark.slow
@pytest.mark.cluster
def test_the_job_script_runs_as_documented_from_a_fresh_checkout(slurm_env, tiny_data, tmp_path):
    """`sbatch launch/slurm.sh configs/tiny.toml` with no other option, from a checkout that has no logs/ folder."""
    checkout = tmp_path / "checkout"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True)
    for name in listed.stdout.splitlines():
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    assert (checkout / "launch/slurm.sh").is_file() and not (checkout / "logs").exists()
    # A whole node (--exclusive) comes with its GPUs, and the script starts one process per GPU.
    dp = f"--parallelism.dp={max(1, gpus_per_node(slurm_env))}"
    args = job_args(tiny_data, tmp_path, "fresh", dp, "--training.steps=2")
    job = sbatch(["launch/slurm.sh", *args], slurm_env, checkout)
    log = checkout / f"nanotron-{job}.out"

    state = wait_until_done(job, slurm_env, log)

    assert state == "COMPLETED", log.read_text()[-4000:] if log.is_file() else f"no log at {log}"
    assert train_steps(tmp_path / "fresh") == [1, 2]


@pytest.mark.slow
@pytest.mark.cluster
def test_bad_input_in_a_two_node_job_is_one_error_line_and_exit_code_2(slurm_env, tiny_data, tmp_path):
    env = {**slurm_env, "NPROC_PER_NODE": "2"}
    missing = tmp_path / "no-tokenizer"
    args = job_args(tiny_data, tmp_path, "bad", "--parallelism.dp=4", f"--data.tokenizer={missing}")
    job = sbatch(["--nodes=2", f"--output={tmp_path}/%x-%j.out", "launch/slurm.sh", *args], env)
    log = tmp_path / f"nanotron-{job}.out"

    state = wait_until_done(job, env, log)

    text = log.read_text()
    assert (state, job_field(job, "ExitCode", env)) == ("FAILED", "2:0"), text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"data.tokenizer: no tokenizer.json at '{missing}'" in errors[0], text[-4000:]
    assert errors[0].startswith("error: [rank ") and "Traceback" not in text


@pytest.mark.slow
@pytest.mark.cluster  # beside other tests, as the hang tests of test_watch.py: an 8 s limit against ms phases
def test_a_hang_on_one_node_requeues_the_job_without_it_and_resumes_to_the_undisturbed_loss(
    slurm_env, tiny_data, tmp_path
):
    """A 2-node job on a 3-node cluster; every rank on node2 stalls in data at step 7 (a bad node). The watchers
    name it in one line, the job exits 75, the script requeues it without node2, and the requeued job resumes from
    step 6's checkpoint and ends with the loss of a run that was never disturbed."""
    nodes = subprocess.run(["sinfo", "-h", "-o", "%D"], env=slurm_env, capture_output=True, text=True).stdout.split()
    if sum(map(int, nodes)) < 3:
        unavailable("the cluster has fewer than 3 nodes (start it with SLURM_LOCAL_NODES=3)")
    steps, run = 12, tmp_path / "bad-node"
    common = ["--parallelism.dp=2", f"--training.steps={steps}", "--watch.floor_seconds=8"]
    env = {**slurm_env, "NPROC_PER_NODE": "1", "NANOTRON_FAULT": "node:node2,step:7,kind:sleep"}
    args = job_args(tiny_data, tmp_path, "bad-node", *common, "--checkpoint.interval=2")
    job = sbatch(["--nodes=2", f"--output={tmp_path}/%x-%j.out", "launch/slurm.sh", *args], env)
    log = tmp_path / f"nanotron-{job}.out"  # an idle cluster gives the lowest nodes: node1 and node2

    # The script requeues the job, then excludes node2 (a running job's ExcNodeList can't change): wait for both.
    wait_for(lambda: job_field(job, "ExcNodeList", env) == "node2", 180, "the job to be requeued without node2", log)
    release_requeued(job, 1, env, log)
    assert wait_until_done(job, env, log) == "COMPLETED", log.read_text()[-4000:]

    text = log.read_text()
    hang = [line for line in text.splitlines() if line.startswith("hang:")]
    assert len(hang) == 1 and hang[0].startswith("hang: rank ") and "(node node2) stalled in data at step 7" in hang[0]
    assert f"node fault: requeueing job {job} without node2" in text
    assert (run / "suspect_nodes.txt").read_text() == "node2\n"
    assert train_steps(run) == [*range(1, 7), *range(7, steps + 1)]
    reference = tmp_path / "reference"
    run_train([*job_args(tiny_data, tmp_path, "reference", *common)[1:], "--config", "configs/tiny.toml"], nproc=2)
    assert read_metrics(run)[-1]["loss"] == pytest.approx(read_metrics(reference)[-1]["loss"], rel=1e-6, abs=0)
