"""Never blind: a hang is detected by the node's watcher process and attributed to the right rank and phase in one
line, with every rank's stack in the incident dir and exit code 75; a slow rank is named by its straggler score.

The fast tests hold the pieces to their rules (fault specs, learnt limits, attribution from gloo-like evidence,
the slot and its dump thread, the straggler score); the slow ones inject each fault into a 4-rank run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    FORKRUN,
    REPO,
    TINY_MODEL,
    child_pids,
    console_messages,
    read_metrics,
    run_train,
    train_env,
    train_losses,
    watcher_pids,
)

from nanotron.config import WatchConfig
from nanotron.errors import ConfigError, NodeFaultError
from nanotron.launch.torchrun import KeptWatcher
from nanotron.step_end import StepInfo
from nanotron.watch import doctor
from nanotron.watch.attribution import RankEvidence, attribute
from nanotron.watch.faults import Fault
from nanotron.watch.heartbeat import Heartbeat, flight_path, read_slot, request_dump
from nanotron.watch.nodes import node_name
from nanotron.watch.straggler import StragglerScores, excess
from nanotron.watch.watcher import Limits

# Tests marked `exclusive` compare ranks' times (straggler scores, the doctor's speeds): they run alone. The hang
# tests run beside the other worker's tests: their limits (8 s floors) are 100x a tiny model's phases, and they
# passed two at a time beside four helpers' work (load 8-11).

EXCLUSIVE = pytest.mark.exclusive

SETTINGS = {"factor": 4.0, "floor_seconds": 8.0, "unseen_phase_seconds": 600.0, "startup_seconds": 1800.0}


@pytest.mark.parametrize(
    "spec", ["rank:2", "rank:x,step:3,kind:sleep", "rank:1,step:3,kind:nap", "rank:1,step:3,kind:slow", "kind:sleep"]
)
def test_a_bad_fault_spec_is_one_line_naming_the_variable(spec):
    with pytest.raises(ConfigError, match=r"NANOTRON_FAULT=.*expected rank:R,step:S,kind:K"):
        Fault.parse(spec)


def test_fault_specs_parse():
    assert Fault.parse("rank:2,step:7,kind:slow:3") == Fault(2, 7, "slow", 3.0)
    assert Fault.parse("rank:0,step:1,kind:gil_lock") == Fault(0, 1, "gil_lock")
    assert Fault.parse("node:node2,step:7,kind:sleep") == Fault(None, 7, "sleep", node="node2")


def test_limits_are_learnt_per_phase_with_a_floor_and_limits_for_unseen_phases_and_startup():
    limits = Limits(SETTINGS)
    assert limits.limit("startup") == 1800.0 and limits.limit("checkpoint") == 600.0
    limits.learn({"forward": 0.5, "checkpoint": 30.0, "startup": 99.0, "data": 0.0})
    limits.learn({"forward": 3.0})
    assert limits.limit("forward") == 12.0  # 4 x the longest any rank showed
    assert limits.limit("checkpoint") == 120.0  # a save 10x a step is not an alarm
    assert limits.limit("data") == 600.0  # a phase of 0 s was never seen
    limits.learn({"backward": 0.1})
    assert limits.limit("backward") == 8.0  # the floor


def gloo_evidence(rank: int, phase: str, groups: dict[str, list], blocked: bool = True, stalled: float = 9.0):
    """A rank's evidence as gloo gives it: every entry `scheduled`, whether it finished or not; `groups` maps a
    group name to (description, [(seq, op, sizes) ...]); the last one is pending when `blocked`."""
    evidence = {}
    for name, (desc, recent) in groups.items():
        seq, op, _ = recent[-1]
        evidence[name] = {
            "desc": desc,
            "recent": [list(entry) for entry in recent],
            "seq": seq,
            "op": op,
            "state": "scheduled",
            "created_ns": 100 * seq,
            "record": 100 * seq,
            "enqueued": seq,
            "completed": seq - 1 if blocked and name == max(groups, key=lambda n: groups[n][1][-1][0]) else seq,
        }
    return RankEvidence(rank, "n1" if rank < 2 else "n2", phase, 812, stalled, groups=evidence)


def test_a_rank_stalled_outside_collectives_is_named_by_sequence_numbers():
    """Rank 2 sleeps in data: its peers are blocked in dp all-reduce #41; rank 2 completed #40 and enqueued nothing
    since. Every rank waited as long (the stall time tells nothing); the sequence numbers do."""
    history = [(40, "all_reduce", [[2]])]
    ranks = [gloo_evidence(r, "backward", {"1": ("mesh_dp", [*history, (41, "all_reduce", [[2]])])}) for r in (0, 1, 3)]
    ranks.insert(2, gloo_evidence(2, "data", {"1": ("mesh_dp", history)}, blocked=False))
    verdict = attribute(ranks)
    assert verdict.culprits == [2]
    expected = "hang: rank 2 (node n2) stalled in data at step 812; 3 ranks wait in all_reduce #41 on the dp group"
    assert verdict.line == expected


def test_a_rank_that_skipped_a_collective_is_named_by_the_first_mismatched_sequence_number():
    """Rank 2 skipped the step's all-reduce (2 floats), so its #7 is the next all-reduce (1 float): gloo paired
    them, and the ranks ended up blocked at #7 and #8 in a mix. The first mismatch names rank 2."""
    usual = [(6, "all_reduce", [[2]]), (7, "all_reduce", [[2]]), (8, "all_reduce", [[]])]
    odd = [(6, "all_reduce", [[2]]), (7, "all_reduce", [[]]), (8, "all_reduce", [[1]])]
    ranks = [
        gloo_evidence(0, "optimizer", {"0": ("default_pg", usual)}),
        gloo_evidence(1, "optimizer", {"0": ("default_pg", usual[:2])}),
        gloo_evidence(2, "optimizer", {"0": ("default_pg", odd)}),
        gloo_evidence(3, "optimizer", {"0": ("default_pg", usual[:2])}),
    ]
    verdict = attribute(ranks)
    assert verdict.culprits == [2]
    assert verdict.line.startswith(
        "hang: rank 2 (node n2) took another code path (its all_reduce #7 on the world group differs from the "
        "other ranks') in optimizer at step 812; 2 ranks wait in all_reduce #7 on the world group"
    )


def test_a_stopped_or_silent_rank_is_named_before_any_sequence_number():
    recent = [(41, "all_reduce", [[2]])]
    waiting = [gloo_evidence(r, "backward", {"1": ("mesh_dp", recent)}) for r in (0, 1, 3)]
    stopped = RankEvidence(2, "n2", "data", 812, 9.0, stopped=True)
    assert attribute([*waiting, stopped]).line.startswith("hang: rank 2 (node n2) is stopped (SIGSTOP")
    silent = RankEvidence(2, "n2", "forward", 812, 9.0)
    assert attribute([*waiting, silent]).line.startswith("hang: rank 2 (node n2) does not answer")


def test_the_collectives_evidence_reads_nccls_flight_recorder_too(monkeypatch):
    """NCCL's groups record into a flight recorder of their own (a CUDA build's `_dump_nccl_trace`), not gloo's
    (`_dump_fr_trace`): a GPU run's collectives, the evidence the hang verdicts lean on, are all there. A stand-in
    NCCL recorder holding one blocked all-reduce (enqueued 7, completed 6) must reach the rank's evidence."""
    import pickle

    from nanotron.watch.heartbeat import last_collectives

    c10d = torch._C._distributed_c10d
    entry = {"process_group": ("3", "dp"), "collective_seq_id": 7, "profiling_name": "nccl:all_reduce",
             "input_sizes": [[1024]], "time_created_ns": 1, "record_id": 0, "is_p2p": False}  # fmt: skip
    nccl = {"entries": [entry], "pg_status": {"3": {"last_enqueued_collective": 7, "last_completed_collective": 6}}}
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda **kwargs: pickle.dumps(nccl), raising=False)
    group = last_collectives()["groups"]["3"]
    assert (group["desc"], group["op"], group["enqueued"], group["completed"]) == ("dp", "all_reduce", 7, 6)


def test_a_heartbeat_slot_carries_phase_step_longest_phase_and_answers_dump_requests(tmp_path):
    heartbeat = Heartbeat(tmp_path, rank=3, info={"run_dir": "r", "watch": SETTINGS})
    heartbeat.beat("data", 5)
    time.sleep(0.05)
    heartbeat.beat("forward")
    state = read_slot(heartbeat.slot)
    assert (state["phase"], state["step"]) == ("forward", 5)
    assert state["longest"]["data"] >= 0.05 and state["longest"]["forward"] == 0.0
    request = request_dump(heartbeat.slot)
    deadline = time.time() + 5
    while read_slot(heartbeat.slot)["dump_done"] < request and time.time() < deadline:
        time.sleep(0.05)
    assert read_slot(heartbeat.slot)["dump_done"] == request
    assert "groups" in json.loads(flight_path(tmp_path, 3).read_text())
    assert json.loads((tmp_path / "rank-3.json").read_text())["pid"] == os.getpid()
    heartbeat.close()


def test_a_score_is_how_much_longer_a_rank_works_than_the_median_of_its_stage():
    # rank 2 worked 6 s where ranks 0, 1 and 3 worked about 4 (and waited the difference for it)
    scores, step_time = excess([4.0, 4.2, 6.0, 3.9], [10.0, 10.0, 10.0, 10.0], [0, 0, 0, 0], steps=10)
    assert step_time == 1.0 and scores == pytest.approx([0.0, 0.05, 0.5, 0.0])
    # two pipeline stages: the head's stage works longer by design, each rank is held to its own stage's peers
    scores, _ = excess([4.0, 4.0, 7.0, 8.75], [10.0] * 4, [0, 0, 1, 1], steps=10)
    assert scores == pytest.approx([0.0, 0.0, 0.0, 0.25])


@pytest.mark.parametrize("action", ["warn", "exclude"])
def test_a_persistent_straggler_is_warned_of_or_its_node_handed_back_for_exclusion(monkeypatch, action):
    """The scores' report: logged as metrics; a rank late for straggler_patience intervals is named in a warning, or
    the report stops the run naming its node (the trainer writes suspect_nodes.txt and exits 75)."""
    cfg = WatchConfig(straggler_interval=5, straggler_patience=2, straggler_action=action)
    stragglers = StragglerScores(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    stragglers.nodes, stragglers.slow_intervals = ["node0", "node1"], [0, 2]
    scores = {"straggler/rank_0": 0.0, "straggler/rank_1": 0.7, "straggler/max": 0.7, "straggler/step_time": 1.0}
    monkeypatch.setattr(stragglers, "count_step", lambda: scores)
    report = stragglers.step_end(StepInfo(step=40, applied=True, logging=True, last=False, stopping=False))
    named = "straggler: rank 1 (node node1) works 1.70x as long as its peers between collectives (steps of 1.000s)"
    assert report.entries[0] == ({"step": 40} | scores, None)
    if action == "warn":
        assert report.stop is None and report.entries[1][1].startswith(f"warning: {named}")
    else:
        assert isinstance(report.stop, NodeFaultError) and report.stop.nodes == ["node1"]
        assert str(report.stop).startswith(named) and "watch.straggler_action" in str(report.stop)


# ---- 4-rank runs with an injected fault ------------------------------------------------------------------

WATCH = ["--watch.floor_seconds=8", "--watch.factor=4"]


def start(
    tiny_data, tmp_path: Path, name: str, fault: str | None, extra: list[str] = (), watched: bool = True
) -> subprocess.Popen:
    """4 ranks of the tiny model under nanotron's launcher and its watcher, or (`watched=False`, for what the ranks
    see themselves) forked by tests/forkrun.py, without each rank's own imports."""
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", f"--job.name={name}", *WATCH, *extra]
    args += ["--parallelism.dp=4", "--training.steps=30", "--checkpoint.save_final=false"]
    env = train_env() | ({"NANOTRON_FAULT": fault} if fault else {})
    launch = ["-m", "nanotron.train", "--nproc_per_node", "4"] if watched else [str(FORKRUN), "4"]
    command = [sys.executable, *launch, *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check_incident(run_dir: Path, stderr: str, expected: str, started: float) -> dict:
    lines = [line for line in stderr.splitlines() if line.startswith(("hang:", "incident:", "error:", "Traceback"))]
    assert lines and lines[0].startswith(expected), stderr[-3000:]
    (incident,) = (run_dir / "incidents").iterdir()
    record = json.loads((incident / "incident.json").read_text())
    culprit = next(r for r in record["ranks"] if r["rank"] == record["culprits"][0])
    limit = record["limits"].get(culprit["phase"], 600.0)
    assert culprit["stalled_seconds"] <= 2 * limit and culprit["stalled_seconds"] < 60, (culprit, limit)
    assert time.time() - started < 300
    for rank in range(4):
        stacks = (incident / f"rank-{rank}.stacks.txt").read_text()
        assert "train_step" in stacks or "(most recent call first)" in stacks or "Thread" in stacks, stacks
    assert (run_dir / "suspect_nodes.txt").read_text() == f"{os.uname().nodename}\n"
    return record


@pytest.mark.slow
def test_a_rank_that_skips_the_step_collective_is_named_in_one_line(tiny_data, tmp_path):
    """gloo checks message sizes: the rank that skips the step's all-reduce (4 float64s) meets its peers in a
    smaller one next (the logging step's memory maximum) and aborts, and the launcher names it. On NCCL it hangs
    instead; the watcher's "took another code path" attribution is tested on flight-recorder evidence above."""
    proc = start(tiny_data, tmp_path, "skip_collective", "rank:2,step:3,kind:skip_collective")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    node = os.uname().nodename
    died = (
        f"rank 2 (node {node}) died: killed by signal 6 (SIGABRT) at step 3 (optimizer) while the main thread was in "
    )
    assert died in stderr, stderr[-3000:]  # gloo's own thread aborts: the main thread's line, from its stacks
    (incident,) = (tmp_path / "skip_collective" / "incidents").iterdir()
    stacks = (incident / "rank-2.fatal.txt").read_text()
    assert stacks.startswith("Fatal Python error: Aborted") and "in mean_loss" in stacks, stacks


def test_the_line_a_rank_died_in_is_read_from_its_fatal_signal_stacks(tmp_path):
    """A segfault in a Python thread: `faulthandler` (as each rank enables it) names it the current thread, and
    the launcher's line names its innermost frame (the segfaulting call), not another thread's; without a current
    thread (a C++ thread's abort, as in the test above) the main thread's, not an idle helper's."""
    from nanotron.launch.torchrun import crash_site

    script = tmp_path / "crash.py"
    script.write_text(
        "import ctypes, faulthandler, sys, threading, time\n"
        "faulthandler.enable(file=open(sys.argv[1], 'w'), all_threads=True)\n"
        "def crash():\n"
        "    ctypes.memset(0, 0, 8)\n"
        "def idle():\n"
        "    time.sleep(60)\n"
        "threading.Thread(target=idle, daemon=True).start()\n"
        "thread = threading.Thread(target=crash)\n"
        "thread.start()\n"
        "thread.join()\n"
    )
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "fatal.txt")], capture_output=True)
    assert proc.returncode == -signal.SIGSEGV
    stacks = (tmp_path / "fatal.txt").read_text()
    assert crash_site(stacks) == f" in {script}:4 (crash)", stacks
    main_only = "\n\n".join(b for b in stacks.split("\n\n") if not b.startswith("Current thread"))
    assert re.fullmatch(r" while the main thread was in threading\.py:\d+ \(\w+\)", crash_site(main_only)), main_only
    assert crash_site("") == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("sleep", "hang: rank 2 (node {node}) stalled in data at step 3; 3 ranks wait in "),
        (
            "gil_lock",
            "hang: rank 2 (node {node}) does not answer (it holds the GIL or is stuck in native code) in forward",
        ),
        ("sigstop", "hang: rank 2 (node {node}) is stopped (SIGSTOP: it runs no code) in data at step 3"),
    ],
    ids=["sleep", "gil_lock", "sigstop"],
)
def test_an_injected_hang_is_detected_attributed_and_ends_the_job_with_the_node_fault_code(
    tiny_data, tmp_path, kind, expected
):
    started = time.time()
    proc = start(tiny_data, tmp_path, kind, f"rank:2,step:3,kind:{kind}")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == NodeFaultError.exit_code, stderr[-3000:]
    check_incident(tmp_path / kind, stderr, expected.format(node=os.uname().nodename), started)


def rank_pid(launcher: int, rank: int) -> int | None:
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"NANOTRON_LAUNCHER_PID={launcher}".encode() in variables and f"RANK={rank}".encode() in variables:
            return int(environ.parent.name)
    return None


@pytest.mark.slow
def test_a_rank_stopped_from_outside_is_detected_and_its_stack_read(tiny_data, tmp_path):
    started = time.time()
    proc = start(tiny_data, tmp_path, "stopped", None, ["--training.steps=400"])
    while not (tmp_path / "stopped" / "metrics.jsonl").exists() or len(read_metrics(tmp_path / "stopped")) < 3:
        assert proc.poll() is None and time.time() - started < 240, proc.communicate()
        time.sleep(0.5)
    pid = rank_pid(proc.pid, 2)
    os.kill(pid, signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == NodeFaultError.exit_code, stderr[-3000:]
    node = os.uname().nodename
    record = check_incident(tmp_path / "stopped", stderr, f"hang: rank 2 (node {node}) is stopped (SIGSTOP", started)
    stacks = next((tmp_path / "stopped" / "incidents").iterdir()) / "rank-2.stacks.txt"
    assert "py-spy is not installed" in stacks.read_text() or "MainThread" in stacks.read_text()
    assert record["culprits"] == [2]


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_rank_three_times_slower_is_named_within_20_steps_and_no_other_rank_is(tiny_data, tmp_path):
    straggling = ["--watch.straggler_interval=5", "--watch.straggler_patience=2", "--training.steps=20"]
    proc = start(tiny_data, tmp_path, "slow", "rank:2,step:1,kind:slow:3", straggling, watched=False)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    warnings = [line for line in console_messages(stdout) if line.startswith("warning: straggler:")]
    assert warnings and all(
        w.startswith(f"warning: straggler: rank 2 (node {os.uname().nodename}) works") for w in warnings
    )
    records = [r for r in read_metrics(tmp_path / "slow") if "straggler/max" in r]
    # the drill sleeps twice the step's compute time, waits included: rank 2 works 3x or more as long as its peers
    assert records[1]["step"] <= 20 and all(r["straggler/rank_2"] > 2.0 for r in records)


# ---- a rank at half speed, stopped and continued from outside (no injector) ---------------------------------------

TINY_SHAPE = ["--model.hidden_size=128", "--model.intermediate_size=384", "--model.num_layers=4"]
TINY_SHAPE += ["--model.num_heads=4", "--model.num_kv_heads=2", "--model.vocab_size=512", "--model.max_seq_len=128"]
TINY_SHAPE += ["--training.seq_len=128", "--training.micro_batch_size=4", "--training.global_batch_size=16"]
LAYOUTS = {
    "dp": ["--parallelism.dp=4"],
    "fsdp": ["--parallelism.dp=4", "--parallelism.zero_stage=3"],
    "tp": ["--parallelism.dp=2", "--parallelism.tp=2"],
}


def forked_ranks(launcher: int) -> list[int]:
    """The pids of tests/forkrun.py's `launcher`'s ranks, in rank order: its children (it forks them in rank order;
    their /proc environ is the launcher's, not the RANK each sets after the fork)."""
    with contextlib.suppress(OSError):
        return [int(pid) for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]
    return sorted(child_pids(launcher))  # pids grow in fork order


def kill_forked_run(launcher: int, ranks: list[int]) -> None:
    """SIGKILLs a forkrun launcher and its ranks. The ranks run in sessions of their own and answer their
    launcher's death with a graceful stop (a SIGTERM agreed at the next step): one that cannot take part would
    keep them waiting in a collective for distributed.timeout_minutes, the test's stdout pipe open."""
    for pid in [launcher, *ranks]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def duty_cycle(pid: int, done: threading.Event, stopped: float = 0.15, running: float = 0.15) -> None:
    """Stops and continues `pid` from outside until `done`: a rank at half speed that knows nothing of it."""
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
            os.kill(pid, signal.SIGCONT)
            done.wait(running)
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def run_with_a_half_speed_rank(tiny_data, tmp_path: Path, layout: str, slow_rank: int | None) -> tuple[str, list]:
    """configs/tiny.toml's shape (tiny_data's 512-token vocabulary) at 4 ranks of `layout`, scored every 5 steps;
    `slow_rank` is duty-cycled from outside once the first step is logged, and the run is ended (its process
    group killed) once a straggler is named: what follows would only repeat it. Returns the console up to then
    and the scores."""
    name = f"{layout}-{slow_rank}"
    args = [*TINY_MODEL, *TINY_SHAPE, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", f"--job.name={name}"]
    args += [*WATCH, *LAYOUTS[layout], "--training.steps=40", "--checkpoint.save_final=false"]
    args += ["--watch.straggler_interval=5", "--watch.straggler_patience=2", "--logging.log_interval=5"]
    command = [sys.executable, str(FORKRUN), "4", *args]  # torchrun's ranks, forked: the score is the trainer's
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        command, cwd=REPO, env=train_env(), stdout=pipe, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    done, cycler, lines, ranks = threading.Event(), None, [], []
    # the console is read to its end: a run that neither names a straggler nor ends is killed at the deadline
    deadline = threading.Timer(240, lambda: kill_forked_run(proc.pid, ranks or forked_ranks(proc.pid)))
    deadline.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if not ranks and " step 1/" in line:
                ranks[:] = forked_ranks(proc.pid)
                if slow_rank is not None:
                    cycler = threading.Thread(target=duty_cycle, args=(ranks[slow_rank], done), daemon=True)
                    cycler.start()
            if "warning: straggler:" in line:
                done.set()
                if cycler is not None:
                    cycler.join()  # the slow rank continued, and left so
                kill_forked_run(proc.pid, ranks)
        proc.wait(timeout=60)
    finally:
        deadline.cancel()
        done.set()
        if cycler is not None:
            cycler.join()
        kill_forked_run(proc.pid, ranks)
    stdout = "".join(lines)
    named = any("warning: straggler:" in line for line in lines)
    assert named or proc.returncode == 0, f"exit {proc.returncode} (-9: killed at the deadline)\n{stdout[-3000:]}"
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.endswith("}")]  # a record cut by the kill is left out
    records = [r for r in records if "straggler/max" in r]
    print(name, [(r["step"], [round(r[f"straggler/rank_{rank}"], 2) for rank in range(4)]) for r in records])
    return stdout, records


@pytest.mark.exclusive
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_stopped_half_the_time_from_outside_is_named_under_dp_fsdp_and_tp(tiny_data, tmp_path, layout):
    """Issue 42 item 9: every collective inside the step waits for the slow rank, so all ranks reach the step's
    collective late together; its own compute time between collectives is what shows it."""
    stdout, records = run_with_a_half_speed_rank(tiny_data, tmp_path, layout, slow_rank=2)
    warnings = [line for line in console_messages(stdout) if line.startswith("warning: straggler:")]
    scores = [[round(r[f"straggler/rank_{rank}"], 2) for rank in range(4)] for r in records]
    assert warnings, scores
    assert all(line.startswith(f"warning: straggler: rank 2 (node {os.uname().nodename})") for line in warnings)


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_clean_run_names_no_straggler(tiny_data, tmp_path):
    stdout, records = run_with_a_half_speed_rank(tiny_data, tmp_path, "dp", slow_rank=None)
    scores = [[round(r[f"straggler/rank_{rank}"], 2) for rank in range(4)] for r in records]
    assert not [line for line in console_messages(stdout) if line.startswith("warning: straggler:")], scores


def test_the_watchers_of_several_nodes_agree_on_one_incident_one_leader_and_one_verdict():
    """Node b announces first and leads; node a learns the incident from the store, publishes its evidence and
    takes b's verdict (a node that only learnt the id must not lead too: that printed the line twice)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from nanotron.watch.nodes import Coordinator

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{server.port}"
    a, b = Coordinator(address, 2, "a"), Coordinator(address, 2, "b")
    assert a.announced() is None
    incident, b_leads = b.announce("t0-b")
    assert (incident, b_leads) == ("t0-b", True)
    assert a.announced() == "t0-b" and a.announce(a.announced()) == ("t0-b", False)
    stuck = gloo_evidence(1, "data", {"0": ("default_pg", [(5, "all_reduce", [[2]])])}, blocked=False)
    waiting = gloo_evidence(0, "backward", {"0": ("default_pg", [(5, "all_reduce", [[2]]), (6, "all_reduce", [[2]])])})
    a.publish(incident, [stuck])
    b.publish(incident, [waiting])
    everyone = b.collect(incident)
    assert sorted(e.rank for e in everyone) == [0, 1]
    verdict = attribute(everyone)
    b.decide(incident, verdict, ["n2"])
    assert a.verdict(incident) == {"line": verdict.line, "culprits": [1], "nodes": ["n2"]}


@pytest.mark.slow
def test_a_transient_hang_restarts_the_ranks_in_place_and_a_permanent_one_stops_after_restarts_without_progress(
    tiny_data, tmp_path
):
    """watch.on_hang=restart: a hang in the first launch attempt only (a transient fault) is followed by a restart
    in place that resumes from the last checkpoint and finishes with the undisturbed run's loss; a hang in every
    attempt stops after watch.max_restarts_without_progress restarts without a new checkpoint, in one line."""
    common = ["--watch.on_hang=restart", "--checkpoint.interval=2", "--training.steps=8"]
    common += ["--parallelism.dp=2", "--watch.max_restarts_without_progress=2"]
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", *WATCH, *common]
    command = [sys.executable, "-m", "nanotron.train", "--nproc_per_node", "2", *args]
    transient = train_env() | {"NANOTRON_FAULT": "rank:1,step:5,kind:sleep,restart:0"}
    done = subprocess.run(
        [*command, "--job.name=transient"], cwd=REPO, env=transient, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (hang,) = [line for line in done.stderr.splitlines() if line.startswith("hang:")]
    assert hang.startswith(f"hang: rank 1 (node {os.uname().nodename}) stalled in data at step 5; 1 rank waits in ")
    assert "restarting the ranks in place (attempt 1) after: hang: rank 1" in done.stdout
    steps = [r["step"] for r in read_metrics(tmp_path / "transient") if "loss" in r]
    assert steps == [1, 2, 3, 4, *range(5, 9)]  # the second attempt resumed from step 4's checkpoint
    run_train([*args, "--job.name=reference"], nproc=2)  # undisturbed: forked ranks, no launcher needed
    final, undisturbed = (train_losses(tmp_path / name)[-1] for name in ("transient", "reference"))
    assert final == pytest.approx(undisturbed, rel=1e-6)

    permanent = train_env() | {"NANOTRON_FAULT": "rank:1,step:5,kind:sleep"}
    stuck = subprocess.run(
        [*command, "--job.name=permanent"], cwd=REPO, env=permanent, capture_output=True, text=True, timeout=300
    )
    assert stuck.returncode == 2, stuck.stderr[-3000:]
    errors = [line for line in stuck.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 node faults in a row without a new checkpoint (latest: step-4" in errors[0]
    assert stuck.stdout.count("restarting the ranks in place") == 1


# ---- nanotron doctor ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, expected",
    [  # a slow rank or disk is measured: alone; a wrong matmul is a checksum, beside other tests
        pytest.param("rank:2,step:0,kind:slow:4", "doctor: rank 2 (node {node}): matmul at ", marks=EXCLUSIVE),
        ("rank:3,step:0,kind:bad_matmul", "doctor: rank 3 (node {node}): matmul result differs"),
        pytest.param(
            "rank:0,step:0,kind:slow_disk:3", "doctor: rank 0 (node {node}): checkpoint.dir writes at ", marks=EXCLUSIVE
        ),
    ],
    ids=["slow_rank", "bad_matmul", "slow_disk"],
)
def test_the_doctor_names_a_slow_rank_a_wrong_matmul_and_a_slow_disk(tiny_data, tmp_path, fault, expected):
    """On one node a bad device is named but not excluded (that would be every node of the job: exit 2, a person
    looks), and the standalone doctor writes nothing into the run dir."""
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--parallelism.dp=2"]
    args += ["--parallelism.tp=2", "--config", "configs/tiny.toml"]
    command = [sys.executable, "-m", "nanotron", "doctor", "--nproc_per_node", "4", *args]
    env = train_env() | {"NANOTRON_FAULT": fault}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected.format(node=node_name()) in errors[0], proc.stderr[-3000:]
    if "disk" not in fault:
        assert f"not requeueing without {node_name()}: that is every node of the job" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "tiny").exists()


def figures(tflops: list[float], nodes: list[str]) -> list[dict]:
    """The doctor's gathered figures for ranks with these matmul speeds, on these nodes, all else healthy."""
    return [
        {"rank": r, "node": node, "clock": 0.0, "tflops": t, "checksum": "c", "error": 0.0}
        | {"bus_gbps": {}, "pair_gbps": {(r + 1) % len(tflops): 1.0}, "disk": {}}
        for r, (t, node) in enumerate(zip(tflops, nodes))
    ]


def test_a_rank_that_looks_slow_is_measured_again_and_named_only_if_it_stays_slow():
    slow_once = figures([1.0, 1.0, 0.2, 1.0], ["a", "a", "b", "b"])
    again = iter([figures([1.0, 0.9, 1.1, 1.0], ["a", "a", "b", "b"])])
    assert doctor.findings(doctor.measured_again(slow_once, lambda: next(again))) == ([], set(), False)
    rounds = []
    stays = doctor.measured_again(
        figures([1.0, 1.0, 0.2, 1.0], ["a", "a", "b", "b"]),
        lambda: rounds.append(1) or figures([1.0, 1.0, 0.25, 1.0], ["a", "a", "b", "b"]),
    )
    lines, nodes, _ = doctor.findings(stays)
    assert len(rounds) == doctor.MEASURE_AGAIN and nodes == {"b"}
    assert lines == ["doctor: rank 2 (node b): matmul at 0.2500 TFLOP/s, the median is 1.0000: a slow device"]


def two_node_doctor(tiny_data, tmp_path, fault: str) -> list[subprocess.CompletedProcess]:
    """The in-job doctor (training.preflight) of a 2-node job on this machine: two launchers, one per node name,
    meeting in one rendezvous as Slurm's nodes do."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--parallelism.dp=4"]
    args += ["--training.preflight=true", "--training.steps=2", "--config", "configs/tiny.toml"]
    launch = [sys.executable, "-m", "nanotron", "torchrun", "--nnodes", "2", "--nproc_per_node", "2"]
    launch += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "doctor"]
    procs = [
        subprocess.Popen(
            [*launch, "-m", "nanotron.train", *args],
            cwd=REPO,
            env=train_env() | {"SLURMD_NODENAME": node, "NANOTRON_FAULT": fault},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in ("node-a", "node-b")
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_the_in_job_doctor_of_a_two_node_job_names_the_bad_node_for_the_requeue(tiny_data, tmp_path):
    procs = two_node_doctor(tiny_data, tmp_path, "node:node-b,step:0,kind:bad_matmul")
    assert [p.returncode for p in procs] == [75, 75], procs[0].stderr[-3000:] + procs[1].stderr[-3000:]
    assert "requeue without node(s) node-b" in procs[0].stderr + procs[1].stderr
    assert (tmp_path / "tiny" / "suspect_nodes.txt").read_text() == "node-b\n"
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()  # stopped before step 1


def test_on_cuda_the_doctors_link_timings_wait_for_the_transfers(monkeypatch):
    """NCCL's all-reduce and send/recv return once queued on the GPU: each timed round must end in a device
    synchronize, or the doctor's GB/s are launch rates and it names links at random. Fake CUDA tensors
    (FakeTensorMode: no GPU) and recorded collectives play rank 0 of a world of 2."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    events: list[str] = []
    request = SimpleNamespace(wait=lambda: events.append("wait"))
    monkeypatch.setattr(doctor.dist, "all_reduce", lambda tensor, group=None: events.append("all_reduce"))
    monkeypatch.setattr(doctor.dist, "batch_isend_irecv", lambda ops: [request] * len(ops))
    monkeypatch.setattr(doctor.dist, "P2POp", lambda *args: None)
    monkeypatch.setattr(doctor.dist, "barrier", lambda: None)
    monkeypatch.setattr(doctor.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    group = SimpleNamespace(get_group=lambda: None)
    mesh = type("Mesh", (), {"mesh_dim_names": ("dp",), "__getitem__": lambda self, name: group})()
    ctx = SimpleNamespace(mesh=mesh, device=torch.device("cuda"), rank=0, world_size=2)
    with FakeTensorMode():
        doctor.bus_bandwidth(ctx, None)
        assert events == ["all_reduce", "sync"] * (1 + doctor.ROUNDS)  # the warm-up, then each timed round
        events.clear()
        doctor.pairwise(ctx, None)
    assert events == ["wait", "wait", "sync"] * 2 * doctor.ROUNDS  # with each neighbour (both are rank 1)


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["a file", "under a file", "read-only", "full"])
def test_the_doctor_names_a_checkpoint_dir_it_cannot_write_in_one_line(tiny_data, tmp_path, problem):
    """Issue 42 item 5: the disks the doctor diagnoses were tracebacks; each is a finding, exit 2."""
    target = tmp_path / "ckpt"
    mounted = problem in ("read-only", "full")
    if mounted and os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root")
    if problem == "a file":
        target.write_text("not a folder")
    elif problem == "under a file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "ckpt"
    else:
        target.mkdir()
        size = "64k" if problem == "full" else "4m"
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], check=True)
        if problem == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
    try:
        args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", f"--checkpoint.dir={target}"]
        command = [sys.executable, "-m", "nanotron", "doctor", "--nproc_per_node", "2", *args, "--parallelism.dp=2"]
        proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"checkpoint.dir '{target}' cannot be written: " in errors[0], proc.stderr[-3000:]


@pytest.mark.exclusive
@pytest.mark.slow
def test_the_doctor_passes_a_healthy_8_rank_layout_in_under_a_minute_and_runs_before_step_1(tiny_data, tmp_path):
    layout = ["--parallelism.dp=2", "--parallelism.tp=2", "--parallelism.pp=2", "--config", "configs/tiny.toml"]
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", *layout]
    started = time.perf_counter()
    command = [sys.executable, "-m", "nanotron", "doctor", "--nproc_per_node", "8", *args]
    proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "doctor: 8 ranks healthy" in proc.stdout, proc.stderr[-3000:]
    assert time.perf_counter() - started < 60
    preflight = [
        "--training.preflight=true",
        "--training.steps=2",
        "--parallelism.dp=4",
        "--config",
        "configs/tiny.toml",
    ]
    env = train_env() | {"NANOTRON_FAULT": "rank:1,step:0,kind:bad_matmul"}
    command = [sys.executable, "-m", "nanotron.train", "--nproc_per_node", "4", *args[: -len(layout)], *preflight]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "doctor: rank 1 " in proc.stderr, proc.stderr[-3000:]  # one node: not excluded
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()  # stopped before step 1


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_in_one_line_and_the_details_are_filed(tiny_data, tmp_path):
    """Issue 26 item 6: rank 3 SIGKILLed mid-run. The console shows one line naming the rank, node, signal and
    step, not the peers' gloo tracebacks nor torchrun's table; those go to the run dir's incident folder."""
    proc = start(tiny_data, tmp_path, "killed", "rank:3,step:3,kind:crash", ["--checkpoint.interval=2"])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    node = os.uname().nodename
    (line,) = [x for x in stderr.splitlines() if x.strip()]  # nothing else on stderr
    assert line.startswith(f"rank 3 (node {node}) died: killed by signal 9 (SIGKILL) at step 3"), stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    (incident,) = (tmp_path / "killed" / "incidents").iterdir()
    assert line.endswith(f"details in {incident}")
    assert "Root Cause" in (incident / "summary.txt").read_text()
    assert {f.name for f in incident.glob("rank-*.traceback.txt")} == {f"rank-{r}.traceback.txt" for r in range(3)}
    assert "by peer" in (incident / "rank-0.traceback.txt").read_text()  # gloo: connection closed or reset


@pytest.mark.slow
def test_a_killed_watcher_is_restarted_and_a_later_hang_is_still_named(tiny_data, tmp_path):
    """Issue 42 item 7: kill -9 of the node's watcher left the run unwatched without a word, and a hang then ended in
    gloo's timeout (a traceback and a wrong cause). The launcher waits on its watcher and starts it again on the same
    slots: one console line says so, and the hang at step 5 is named by the new watcher (exit 75)."""
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=watched", *WATCH]
    args += ["--parallelism.dp=2", "--training.steps=30", "--distributed.timeout_minutes=1"]
    env = train_env() | {"NANOTRON_FAULT": "rank:1,step:5,kind:sleep"}
    command = [sys.executable, "-m", "nanotron.train", "--nproc_per_node", "2", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.time()
    while not (watchers := watcher_pids(proc.pid)):
        assert proc.poll() is None and time.time() - started < 60, proc.communicate()
        time.sleep(0.2)
    os.kill(watchers[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == NodeFaultError.exit_code, stderr[-3000:]
    notes = [line for line in console_messages(stdout) if line.startswith("warning:")]
    assert len(notes) == 1 and f"watcher (pid {watchers[0]}) was killed by signal 9 (SIGKILL)" in notes[0], stdout
    assert "restarted it" in notes[0]
    (hang,) = [line for line in stderr.splitlines() if line.startswith("hang:")]
    assert hang.startswith(f"hang: rank 1 (node {os.uname().nodename}) stalled in data at step 5"), stderr[-3000:]
    assert "Traceback" not in stdout + stderr


def test_the_launchers_watcher_is_started_again_when_a_signal_kills_it_and_not_after_it_fails(tmp_path, capsys):
    """The launcher's side of the test above, in one process: a watcher that SIGKILLs itself once is started
    again (one line), stop() ends the new one and starts nothing more; one that exits 3 is left, with one line."""
    once = f"import os, pathlib, signal, time; marker = pathlib.Path({str(tmp_path / 'killed')!r})\n"
    once += "if not marker.exists(): marker.touch(); time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
    watcher = KeptWatcher([sys.executable, "-c", once + "time.sleep(60)"])
    first = watcher.process.pid
    deadline = time.time() + 20
    while "restarted" not in (out := capsys.readouterr().out) and time.time() < deadline:
        time.sleep(0.1)
    second = watcher.process
    assert f"watcher (pid {first}) was killed by signal 9 (SIGKILL); restarted it (pid {second.pid})" in out, out
    assert second.poll() is None
    watcher.stop()
    assert second.returncode == -signal.SIGKILL and watcher.process is second
    time.sleep(0.3)
    assert capsys.readouterr().out == ""  # the watcher stop() killed is not started again

    failing = KeptWatcher([sys.executable, "-c", "raise SystemExit(3)"])
    while "failed" not in (out := capsys.readouterr().out) and time.time() < deadline:
        time.sleep(0.1)
    assert f"watcher (pid {failing.process.pid}) failed (exit code 3); its ranks are unwatched" in out, out
    failing.stop()


HANG_VERDICT = {"exit_code": 75, "line": "hang: rank 1 (node node2) stalled in data at step 7", "action": "requeue"}


def launch_failing_mid_incident(monkeypatch, failure: Exception, incident: bool) -> tuple[int, dict | None]:
    """The launcher's `_run_once` where torchrun's run raises `failure`; its watcher is a stand-in that, with
    `incident`, does what a real one does mid-incident (marked as handling, the verdict 1 s later), else idles."""
    import torch.distributed.run as torch_run

    from nanotron.launch import torchrun
    from nanotron.watch.heartbeat import WATCH_DIR_VARIABLE
    from nanotron.watch.watcher import HANDLING, VERDICT

    mid_incident = (
        "import json, pathlib, sys, time; folder = pathlib.Path(sys.argv[1])\n"
        f"(folder / {HANDLING!r}).touch(); time.sleep(1)\n"
        f"(folder / {VERDICT!r}).write_text(json.dumps({HANG_VERDICT!r}))\n"
    )
    script = mid_incident if incident else "import time; time.sleep(60)"
    stand_in = lambda command: KeptWatcher([sys.executable, "-c", script, command[command.index("--dir") + 1]])
    monkeypatch.setattr(torchrun, "KeptWatcher", stand_in)

    def run(config):
        marker = Path(os.environ[WATCH_DIR_VARIABLE]) / HANDLING
        deadline = time.time() + (20 if incident else 0)
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        raise failure

    monkeypatch.setattr(torch_run, "run", run)
    monkeypatch.setenv(WATCH_DIR_VARIABLE, "")  # the launcher sets it for its ranks: not for this test's neighbours
    return torchrun._run_once(torch_run.parse_args(["--standalone", "--nproc_per_node=1", "--no-python", "true"]))


def store_host_ended() -> Exception:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    error = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception")
    error.__cause__ = torch.distributed.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
    return error


def rank_lost_its_peer() -> Exception:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("nanotron.train", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")})


@pytest.mark.parametrize("failure", [rank_lost_its_peer, store_host_ended], ids=["rank_lost_its_peer", "store_lost"])
def test_a_launch_that_fails_while_its_watcher_handles_an_incident_ends_with_the_watchers_verdict(monkeypatch, failure):
    """Two nodes: the other node's watcher acts first. Our ranks, blocked in a collective with the ranks it ended,
    fail with exit code 1 (CI, 2026-12-07: node1 exited 1 first, so the Slurm job ended 1 and was not requeued
    without node2); or its launcher, which hosts the rendezvous store, exits and our torchrun agent loses the store
    (a traceback and exit 1, seen with the leader delayed 3 s). Either way the launch waits for our watcher's verdict
    and exits with its code."""
    assert launch_failing_mid_incident(monkeypatch, failure(), incident=True) == (75, HANG_VERDICT)


def test_a_lost_rendezvous_store_outside_an_incident_is_one_line_naming_it(monkeypatch, capsys):
    """The node hosting the store ended first (bad input there, a crash, the node gone): this node's ranks are
    stopped by torchrun, and the launch says so in one line instead of torchrun's traceback."""
    assert launch_failing_mid_incident(monkeypatch, store_host_ended(), incident=False) == (1, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: lost the rendezvous store (--rdzv_endpoint "), err
    assert "its node's launcher ended or the node is unreachable" in err[0]


def test_the_watcher_marks_an_incident_as_handled_before_it_gathers_evidence(tmp_path, monkeypatch):
    """The mark the launcher waits on (the test above) comes before the slow part, the ranks' stacks and, on several
    nodes, the leader's gathering; then the verdict, then the ranks are ended."""
    from types import SimpleNamespace

    from nanotron.watch import watcher

    folder, run_dir = tmp_path / "watch", tmp_path / "run"
    folder.mkdir()
    rank = subprocess.Popen(["sleep", "60"])
    info = {"pid": rank.pid, "run_dir": str(run_dir), "checkpoint_dir": str(run_dir / "checkpoints")}
    info["watch"] = {"on_hang": "requeue", "max_restarts_without_progress": 3}
    marked = []

    def gather(folder, ranks, now):
        marked.append((folder / watcher.HANDLING).exists() and not (folder / watcher.VERDICT).exists())
        return [gloo_evidence(0, "data", {"0": ("default_pg", [(5, "all_reduce", [[2]])])}, blocked=False)], {0: ""}

    monkeypatch.setattr(watcher, "gather", gather)
    watcher.handle(folder, {0: SimpleNamespace(rank=0, info=info)}, Limits(SETTINGS), None, None)
    assert marked == [True]
    assert json.loads((folder / watcher.VERDICT).read_text())["exit_code"] == NodeFaultError.exit_code
    assert rank.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize("world", range(1, 10))
def test_the_doctors_link_rounds_pair_ranks_both_ways_and_cover_every_ring_link(world):
    """Each round pairs ranks with each other (a rank exchanging with one that exchanges with a third waits for
    good: an odd ring's last rank did, the doctor hung at 3 ranks), both ranks of a pair take the same CPU turn,
    and the rounds together measure every link of the ring."""
    covered = set()
    turns = max(world // 2, 1)
    for round_ in doctor.ring_rounds(world):
        peers = {rank: doctor.ring_peer(rank, world, round_) for rank in range(world)}
        for rank, peer in peers.items():
            if peer is not None:
                assert peers[peer] == rank, (round_, peers)
                covered.add(frozenset((rank, peer)))
                assert doctor.ring_turn(rank, world, round_, turns) == doctor.ring_turn(peer, world, round_, turns)
    assert covered == {frozenset((rank, (rank + 1) % world)) for rank in range(world)} - {frozenset((0,))}
