"""Loss spikes: one decision for the whole job from agreed values, a replay that tells a faulty rank from bad
data, and a rollback past the bad samples whose result equals a run that never had them."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TINY_MODEL, read_metrics, run_train, synthetic_documents, train_losses
from matrix import RTOL

from benchmarks.common import ensure_data, model_overrides
from nanotron.config import StabilityConfig, TrainingConfig, load_config
from nanotron.data.loader import StepSampler
from nanotron.data.skips import SKIPPED_SAMPLES, SampleSkips
from nanotron.errors import ConfigError, NodeFaultError, SpikeError
from nanotron.stability import Observation, Replay, SpikeDetector, Stability, differing_ranks

# ---- the detector and the skip windows ------------------------------------------------------------


def noisy_decline(steps: int, seed: int = 0) -> list[float]:
    """A loss curve falling like a pretraining run's, with 3% multiplicative noise."""
    rng = random.Random(seed)
    return [(2.0 + 8.0 / (1 + 0.05 * t)) * (1 + 0.03 * rng.gauss(0, 1)) for t in range(steps)]


def test_a_jump_is_a_spike_after_warm_up_and_a_falling_noisy_curve_is_not():
    cfg = StabilityConfig(warmup_steps=20, ema_decay=0.9, loss_z=6.0, grad_norm_z=6.0)
    detector, losses = SpikeDetector(cfg), noisy_decline(400)
    for loss in losses:
        z = detector.scores(loss, 1.0)
        assert not detector.is_spike(z)
        detector.observe(loss, 1.0)
    assert 1.0 < detector.worst["loss_z"] < 6.0
    assert detector.is_spike(detector.scores(losses[-1] * 2, 1.0))  # a 2x jump of the loss
    assert detector.is_spike(detector.scores(losses[-1], 3.0))  # a 3x jump of the gradient norm
    early = SpikeDetector(cfg)
    for loss in losses[:10]:
        early.observe(loss, 1.0)
    assert not early.is_spike(early.scores(losses[10] * 10, 10.0))  # still warming up


def small_batch_curve(steps: int, seed: int = 0) -> list[tuple[float, float]]:
    """(loss, gradient norm) falling like configs/tiny.toml's first 100 steps (9.2 -> 5.4 and 2.1 -> 0.42), with
    the step-to-step noise of its 16-sample batches (log-normal, 2.5% on the loss and 10% on the gradient norm: what
    its clean 500-step run shows after step 100)."""
    rng = random.Random(seed)
    return [
        (
            (5.4 + 3.8 * math.exp(-t / 15)) * math.exp(0.025 * rng.gauss(0, 1)),
            0.42 * (1 + 4 * math.exp(-t / 10)) * math.exp(0.1 * rng.gauss(0, 1)),
        )
        for t in range(steps)
    ]


def first_detection(detector: SpikeDetector, curve: list[tuple[float, float]]) -> int | None:
    """The index of the first step of `curve` the detector calls a spike; the others join its statistics."""
    for index, (loss, grad_norm) in enumerate(curve):
        if detector.is_spike(detector.scores(loss, grad_norm)):
            return index
        detector.observe(loss, grad_norm)
    return None


def test_a_30x_lr_ramp_on_a_noisy_small_batch_curve_is_detected_within_10_steps():
    """Issue 42, item 8: the loss 5.4 -> 7.5 (+39%) and the gradient norm 0.42 -> 6.4 (15x) within five steps, after
    a warm-up whose fall inflated the variance: the z rule alone scores it below 3 and 5 and misses it; the ratio to
    the running mean sees it. 500 steps of the same noisy curve without the ramp are no spike."""
    ramp = [(5.4 * (7.5 / 5.4) ** (k / 5), 0.42 * (6.4 / 0.42) ** (k / 5)) for k in range(1, 6)]
    spike = ramp + ramp[-1:] * 5
    z_only = SpikeDetector(StabilityConfig(loss_ratio=0, grad_norm_ratio=0))
    assert first_detection(z_only, small_batch_curve(100) + spike) is None
    assert z_only.worst["loss_z"] < 3.0 and z_only.worst["grad_norm_z"] < 5.0
    detector = SpikeDetector(StabilityConfig())
    assert first_detection(detector, small_batch_curve(100)) is None
    found = first_detection(detector, spike)
    assert found is not None and found < 10
    assert detector.fired(detector.scores(*spike[found])) == ["grad_norm_ratio"]
    clean = SpikeDetector(StabilityConfig())
    assert first_detection(clean, small_batch_curve(500)) is None
    assert clean.worst["loss_ratio"] < 1.25 and clean.worst["grad_norm_ratio"] < 4.0


def test_the_detector_state_survives_a_json_round_trip_exactly():
    cfg = StabilityConfig(warmup_steps=5)
    detector = SpikeDetector(cfg)
    for loss in noisy_decline(50):
        detector.observe(loss, loss / 3)
    restored = SpikeDetector(cfg)
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert restored.scores(4.0, 1.5) == detector.scores(4.0, 1.5)
    assert restored.state_dict() == detector.state_dict()


def test_a_detector_state_saved_before_the_ratio_rule_loads_with_its_level_as_the_running_mean():
    """A checkpoint from before the ratio rule has no running means nor largest ratios: it passes the schema and
    resumes with z-scores unchanged, each mean taken from the forecast's level and the ratios counted afresh."""
    from nanotron import records

    detector = SpikeDetector(StabilityConfig(warmup_steps=5))
    for loss in noisy_decline(50):
        detector.observe(loss, loss / 3)
    old = json.loads(json.dumps(detector.state_dict()))
    del old["mean"], old["max_ratio"]
    assert records.problem(old, records.TRAINER_STATE["stability"].schema["detector"]) is None
    restored = SpikeDetector(StabilityConfig(warmup_steps=5))
    restored.load_state_dict(old)
    scores, before = restored.scores(4.0, 1.5), detector.scores(4.0, 1.5)
    assert (scores["loss_z"], scores["grad_norm_z"]) == (before["loss_z"], before["grad_norm_z"])
    assert scores["loss_ratio"] == pytest.approx(4.0 / math.exp(old["stats"]["loss"][0]), rel=1e-12)
    assert restored.worst["loss_ratio"] == restored.worst["grad_norm_ratio"] == 0.0


def test_the_kth_trained_sample_is_the_kth_position_outside_every_window():
    skips = SampleSkips([(10, 20), (15, 30), (40, 41)])
    assert skips.windows == [(10, 30), (40, 41)] and len(skips) == 21
    outside = [p for p in range(200) if not any(a <= p < b for a, b in skips.windows)]
    assert [skips.position(k) for k in range(len(outside))] == outside


def test_every_dp_layout_reads_the_same_samples_and_none_in_a_window():
    skips = SampleSkips([(8, 16), (27, 29)])
    steps = 6

    def step_samples(dp: int) -> list[set[int]]:
        t = TrainingConfig(micro_batch_size=2, grad_accum_steps=4 // dp, global_batch_size=8)
        samplers = [iter(StepSampler(t, dp, rank, start=0, skips=skips)) for rank in range(dp)]
        return [{g for s in samplers for _ in range(t.grad_accum_steps) for g in next(s)} for _ in range(steps)]

    one = step_samples(1)
    assert one == step_samples(2) == step_samples(4)
    read = set().union(*one)
    assert len(read) == steps * 8 and not read & (set(range(8, 16)) | {27, 28})


def test_a_rollback_window_ends_with_the_spiking_step_and_never_reaches_before_the_checkpoint():
    stability = Stability(load_config(None, [("stability.window_steps", "3"), ("data.skip_samples", "4:6")]))
    # The spiking step starts at trained sample 40 (gbs 8); its own samples are positions 42..49 (4 and 5 skipped).
    assert stability.window(40, 8, floor_sample=0) == (26, 50)  # 3 steps: trained samples 24..47
    assert stability.window(40, 8, floor_sample=32) == (34, 50)  # the checkpoint rolled back to is at sample 32


def resumed(windows: list[str], saved_windows: list[str], consumed_samples: int, where: Path) -> Stability:
    """A run with data.skip_samples = `windows` resuming from a checkpoint that had `saved_windows` and had trained
    `consumed_samples` samples."""
    saved_cfg, cfg = load_config(None, []), load_config(None, [])
    saved_cfg.data.skip_samples, cfg.data.skip_samples = saved_windows, windows
    stability = Stability(cfg)
    stability.load_state_dict(Stability(saved_cfg).state_dict(), where, consumed_samples)
    return stability


def test_a_skip_window_added_on_resume_behind_the_trained_position_is_refused(tmp_path):
    """Trained samples 0..63 of a checkpoint that skipped 40:48 are positions 0..39 and 48..71: a window added now
    may only lie at or after position 72 (or inside what was skipped already); one behind would shift the order
    and skip other, unnamed samples."""
    step = tmp_path / "step-8"
    assert resumed(["40:48", "72:80"], ["40:48"], 64, step).skips.windows == [(40, 48), (72, 80)]
    assert resumed(["42:46"], ["40:48"], 64, step).skips.windows == [(40, 48)]
    for window in ("16:24", "64:72", "70:90"):
        with pytest.raises(ConfigError) as raised:
            resumed([window], ["40:48"], 64, step)
        expected = (
            f"data.skip_samples: window {window} lies behind the data position 72 that {step} has trained to "
            "(64 samples)"
        )
        assert str(raised.value).startswith(expected)


def warm_stability(overrides: list[tuple[str, str]], steps: int = 8) -> Stability:
    """A policy that has seen `steps` steps of a flat loss 4.0 and gradient norm 1.0 (warm-up 3): 40.0 is a spike."""
    stability = Stability(load_config(None, [("stability.warmup_steps", "3"), *overrides]))
    for step in range(1, steps + 1):
        assert stability.decide(Observation(step, 4.0, 1.0)).action == "apply"
    return stability


def test_a_spike_is_replayed_and_a_reproduced_one_rolled_back_to_the_newest_checkpoint_before_it(tmp_path):
    """The policy asks the trainer questions (a replay, the committed checkpoints) and decides from the answers;
    its statistics move only with a final decision."""
    stability = warm_stability([])
    spike = Observation(12, 40.0, 1.0)
    assert stability.decide(spike).action == "replay"
    same = Replay(40.0, 1.0, [[40.0, 1.0, 40.0, 1.0]], ["node0"])
    assert stability.decide(replace(spike, replay=same)).action == "checkpoints"
    checkpoints = [tmp_path / f"step-{step}" for step in (4, 8, 12, 16)]
    decision = stability.decide(replace(spike, replay=same, checkpoints=checkpoints))
    assert decision.action == "rollback" and decision.target == tmp_path / "step-8"
    assert "the replay reproduced it" in decision.line and "stability/action" not in decision.event
    assert stability.detector.observed == 8  # a spike never joins the statistics
    event, line = stability.rolled_back(decision, first_sample=88, step=8, floor_sample=64)
    assert stability.rollbacks == 1 and stability.skips.windows == [(88, 96)]
    assert event["stability/action"] == "rollback" and event["stability/window"] == [88, 96]
    rolled = f"rolled back to step 8 ({tmp_path / 'step-8'}) and skipping samples [88, 96) (rollback 1 of 3)"
    assert line.endswith(rolled)
    decision = stability.decide(replace(spike, replay=same, checkpoints=checkpoints[-1:]))
    assert decision.action == "skip" and "no committed checkpoint before step 12" in decision.line


@pytest.mark.parametrize("on_transient", ["continue", "stop"])
def test_a_replay_that_differs_on_a_rank_is_a_transient_fault_of_its_node(on_transient):
    stability = warm_stability([("stability.on_transient", on_transient)])
    rows = [[4.0, 1.0, 4.0, 1.0], [76.0, 1.0, 4.0, 1.0]]  # rank 1's loss was 19x in the first pass only
    decision = stability.decide(Observation(9, 40.0, 1.0, replay=Replay(4.0, 1.0, rows, ["node0", "node1"])))
    assert decision.event["stability/ranks"] == [1] and "loss differed on rank 1 (node node1)" in decision.line
    if on_transient == "stop":
        assert decision.action == "stop" and decision.event["stability/action"] == "exclude"
        assert isinstance(decision.error, NodeFaultError) and decision.error.nodes == ["node1"]
    else:
        assert decision.action == "apply" and decision.event["stability/action"] == "transient"
        assert stability.detector.observed == 9  # the replayed step's values joined the statistics


def test_a_rollback_past_stability_max_rollbacks_stops_the_run(tmp_path):
    stability = warm_stability([("stability.max_rollbacks", "2"), ("stability.replay", "false")])
    stability.rollbacks = 2
    decision = stability.decide(Observation(12, 40.0, 1.0, checkpoints=[tmp_path / "step-8"]))
    assert decision.action == "stop" and decision.event["stability/action"] == "stop"
    assert isinstance(decision.error, SpikeError)
    assert "stopped: stability.max_rollbacks=2 rollbacks already" in str(decision.error)


@pytest.mark.parametrize("action", ["skip_step", "rollback"])
def test_a_level_that_stays_is_taken_as_the_new_level_after_max_skips_skipped_updates(action, tmp_path):
    """A spike lasts a step or a few; a signal that stays at its new level is not one. Skipping every update while
    it stays would stop the training for good (found: a 600-step AdamW run of configs/tiny.toml whose gradient norm
    rose 9x its warm-up mean at step 107 skipped the next 400+ updates): after stability.max_skips skipped updates in
    a row the step's values become the statistics' level and its update is applied. The noise scale is kept, so the
    guard goes on guarding around that level."""
    overrides = [("stability.action", action), ("stability.replay", "false"), ("stability.max_skips", "3")]
    stability = warm_stability(overrides)
    stability.detector.stats["grad_norm"].var = 0.04  # the noise of the warm-up's gradient norms (std 0.2 in log)
    risen = [Observation(step, 4.0, 9.0, checkpoints=[]) for step in range(9, 14)]
    actions = [stability.decide(seen).action for seen in risen[:3]]
    assert actions == ["skip"] * 3
    decision = stability.decide(risen[3])
    assert decision.action == "apply" and decision.event["stability/action"] == "rebase"
    assert "3 updates skipped in a row" in decision.line and "stability.max_skips" in decision.line
    grad_norm = stability.detector.stats["grad_norm"]
    assert grad_norm.mean == pytest.approx(math.log(9.0)) and grad_norm.var == 0.04  # the noise scale kept
    assert stability.decide(risen[4]).action == "apply"  # the new level is no spike
    assert stability.decide(Observation(14, 4.0, 90.0, checkpoints=[])).action == "skip"  # a spike over it is one
    state = json.loads(json.dumps(stability.state_dict()))
    assert state["skips_in_a_row"] == 1
    resumed = Stability(load_config(None, [("stability.warmup_steps", "3"), *overrides]))
    resumed.load_state_dict(state, "step-14", 0)
    assert resumed.skips_in_a_row == 1


def test_differing_ranks_are_named_by_the_earliest_value_that_changed():
    first = [[1.0, 4.0], [50.0, 4.0], [0.0, 2.0]]  # rank 1's loss was 50x in the first pass
    assert differing_ranks(first, [[1.0, 4.0], [1.0, 4.0], [0.0, 2.0]], 1e-3) == ([1], "loss")
    assert differing_ranks(first, [[1.0, 4.0], [50.0, 4.5], [0.0, 2.5]], 1e-3) == ([1, 2], "gradient")
    assert differing_ranks(first, first, 1e-3) == ([], "")


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--stability.ema_decay=1.5", "stability.ema_decay: expected a number in (0, 1)"),
        ("--stability.action=explode", "stability.action: expected one of 'rollback'"),
        ("--stability.window_steps=0", "stability.window_steps: expected a value >= 1"),
        ("--stability.loss_ratio=0.9", "stability.loss_ratio: expected 0 (off) or a number > 1, got 0.9;"),
        ("--stability.grad_norm_ratio=1", "stability.grad_norm_ratio: expected 0 (off) or a number > 1, got 1.0;"),
        ("--stability.grad_norm_ratio=-2", "stability.grad_norm_ratio: expected a value >= 0.0"),
        ("--data.skip_samples=8:4", "data.skip_samples[0]='8:4': expected START:END"),
        ("--data.skip_samples=1:2,x", "data.skip_samples[1]='x': expected START:END"),
    ],
)
def test_bad_stability_settings_are_one_line(flag, expected):
    key, _, value = flag[2:].partition("=")
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        load_config(None, [(key, value)])


def test_every_rule_off_with_detection_on_is_refused():
    rules = [(f"stability.{rule}", "0") for rule in ("loss_z", "grad_norm_z", "loss_ratio", "grad_norm_ratio")]
    assert load_config(None, rules[:3]).stability.grad_norm_ratio == 4.0  # one rule left is a guard
    with pytest.raises(ConfigError, match="stability.loss_z, grad_norm_z, loss_ratio and grad_norm_ratio are all 0"):
        load_config(None, rules)


# ---- a real run resumed at 30x its learning rate ------------------------------------------------------


@pytest.mark.slow
def test_a_resume_at_30x_the_learning_rate_is_stopped_within_10_steps_by_the_ratio_rule(tmp_path):
    """The benchmark's nano model on its synthetic corpus (`benchmarks.stability --quick`): the clean run (40 steps,
    decisions after 20) has no spike; resumed from its last checkpoint with the whole schedule 30x higher, the loss
    more than doubles and the gradient norm jumps ~5x, at z-scores the warm-up's fall keeps below their thresholds.
    The guard (stability.action=stop) stops within 10 steps by the ratio rules alone. The running means travel
    with the checkpoint: the resumed run's first step is scored against the saved ones."""
    common = [
        *ensure_data(tmp_path),
        *model_overrides("nano"),
        "--stability.warmup_steps=20",
        "--stability.replay=false",
        "--optimizer.decay_steps=40",
        "--logging.log_interval=1",
        "--logging.tensorboard=false",
        f"--job.out_dir={tmp_path}",
    ]
    run_train([*common, "--training.steps=40", "--checkpoint.interval=40", "--job.name=clean"])
    assert events(tmp_path / "clean") == []
    detector = json.loads((tmp_path / "clean" / "checkpoints" / "step-40" / "trainer_state.json").read_text())
    detector = detector["stability"]["detector"]
    assert 0 < detector["max_ratio"]["loss"] < 1.25 and 0 < detector["max_ratio"]["grad_norm"] < 4.0
    lr = ["--optimizer.lr=0.09", "--optimizer.min_lr=0.009"]  # 30x the defaults, 3e-3 and 3e-4
    resume = [f"--checkpoint.resume_from={tmp_path / 'clean' / 'checkpoints' / 'step-40'}", "--training.steps=50"]
    proc = run_train([*common, *lr, *resume, "--stability.action=stop", "--job.name=lr30"], check=False)
    assert proc.returncode == 4, proc.stderr[-2000:]
    [event] = events(tmp_path / "lr30")
    assert 40 < event["step"] <= 50 and event["stability/rules"] == ["loss_ratio", "grad_norm_ratio"]
    assert event["stability/loss_z"] < 6 and event["stability/grad_norm_z"] < 8  # what the z rule alone missed
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"step {event['step']} spiked" in line and "stability.loss_ratio=1.25, stability.grad_norm_ratio=4" in line
    first = read_metrics(tmp_path / "lr30")[0]
    assert first["step"] == 41
    for name in ("loss", "grad_norm"):
        saved_mean = math.exp(detector["mean"][name])
        assert first[f"stability/{name}_ratio"] == pytest.approx(first[name] / saved_mean, rel=1e-9)


# ---- training runs on a corpus with one poisoned document ------------------------------------------

SEED, POISON_STEP, STEPS = 355, 28, 38
GBS = 8
POISON_WINDOW = [(POISON_STEP - 1) * GBS, POISON_STEP * GBS]  # the data positions of the spiking step
STABILITY = [
    "--stability.warmup_steps=12",
    "--stability.ema_decay=0.8",
    "--stability.loss_z=4",
    "--stability.grad_norm_z=6",
    "--optimizer.lr=0.01",
    "--optimizer.min_lr=0.001",
    "--checkpoint.interval=8",
    f"--job.seed={SEED}",
    f"--training.steps={STEPS}",
]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """Sentences of two 4-way choices in a fixed frame (the model is sure of most tokens within 20 steps), and one
    document of a character the corpus never has: the two of its samples this run reads are both read at step
    POISON_STEP (global positions inside POISON_WINDOW). The step's loss jumps 2.7x and its gradient norm 42x
    (z 6.2 and 22.7, in runs whose other steps stay below 2 after warm-up)."""
    from nanotron.data import open_corpus
    from nanotron.data.loader import TrainSamples
    from nanotron.tokenize.bpe import train_tokenizer
    from nanotron.tokenize.tokenizer import load_tokenizer
    from nanotron.tokenize.writer import tokenize_paths

    root = tmp_path_factory.mktemp("poisoned")
    train_tokenizer(synthetic_documents(60), root / "tokenizer", vocab_size=512)
    rng = random.Random(5)
    docs = [
        " ".join(
            f"the {rng.choice(['cat', 'dog', 'bird', 'tree'])} sees a {rng.choice(['red', 'blue', 'small', 'large'])} "
            "house."
            for _ in range(40)
        )
        for _ in range(40)
    ]
    poison = "#" * 40
    docs.insert(17, poison)
    (root / "corpus").mkdir()
    (root / "corpus" / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenize_paths([str(root / "corpus")], root / "tokenizer", root / "tokens", validation_split=0.0, progress=False)
    overrides = [f"--data.path={root / 'tokens'}", f"--data.tokenizer={root / 'tokenizer'}"]
    cfg = load_config(None, [tuple(o[2:].split("=", 1)) for o in [*TINY_MODEL, *overrides]])
    corpus = open_corpus(cfg)
    tokenizer = load_tokenizer(root / "tokenizer")
    others = " ".join(d for d in docs if d != poison)
    foreign = set(tokenizer.encode(poison)) - set(tokenizer.encode(others)) - {tokenizer.eos_id}
    samples = TrainSamples(corpus, SEED)
    poisoned_positions = [g for g in range((STEPS + 2) * GBS) if foreign & set(samples[g].tolist())]
    assert len(poisoned_positions) == 2 and all(POISON_WINDOW[0] <= g < POISON_WINDOW[1] for g in poisoned_positions)
    return overrides


def train(overrides: list[str], out: Path, name: str, extra: list[str], nproc: int = 1, check: bool = True):
    proc = run_train(
        [*TINY_MODEL, *overrides, *STABILITY, f"--job.out_dir={out}", f"--job.name={name}", *extra],
        nproc=nproc,
        check=check,
    )
    return out / name, proc


def events(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "stability/action" in r]


def last_loss(run_dir: Path) -> float:
    return train_losses(run_dir)[-1]


@pytest.fixture(scope="module")
def never_had_the_window(poisoned, tmp_path_factory):
    """The reference: the same run told to skip the poisoned window from the start."""
    window = ":".join(map(str, POISON_WINDOW))
    run_dir, _ = train(poisoned, tmp_path_factory.mktemp("ref"), "ref", [f"--data.skip_samples={window}"])
    assert events(run_dir) == []
    return run_dir


@pytest.fixture(scope="module")
def rolled_back(poisoned, tmp_path_factory):
    run_dir, proc = train(poisoned, tmp_path_factory.mktemp("rollback"), "run", [])
    return run_dir, proc.stdout


def saved_stability(step_dir: Path) -> dict:
    return json.loads((step_dir / "trainer_state.json").read_text())["stability"]


@pytest.mark.slow
def test_a_poisoned_step_is_rolled_back_past_and_ends_where_a_run_without_its_samples_ends(
    rolled_back, never_had_the_window
):
    run_dir, stdout = rolled_back
    [event] = events(run_dir)
    assert event["step"] == POISON_STEP and event["stability/action"] == "rollback"
    assert event["stability/window"] == POISON_WINDOW and event["stability/rollback_to"] == 24
    assert event["stability/loss_z"] > 4 and event["stability/grad_norm_z"] > 6
    assert f"stability: step {POISON_STEP} spiked" in stdout and "the replay reproduced it" in stdout
    assert f"rolled back to step 24 ({run_dir / 'checkpoints' / 'step-24'}) and skipping samples [216, 224)" in stdout
    assert json.loads((run_dir / SKIPPED_SAMPLES).read_text()) == {"windows": [POISON_WINDOW]}
    assert saved_stability(run_dir / "checkpoints" / "step-24")["skipped_samples"] == []
    assert saved_stability(run_dir / "checkpoints" / "step-32")["skipped_samples"] == [POISON_WINDOW]
    assert saved_stability(run_dir / "checkpoints" / "step-32")["rollbacks"] == 1
    reference = train_losses(never_had_the_window)
    assert len(reference) == STEPS
    # The rolled-back run logs steps 25 and 26 twice; from the rollback on, it is the reference's run.
    assert train_losses(run_dir)[-(STEPS - 24) :] == pytest.approx(reference[24:], rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_resume_from_a_checkpoint_after_the_rollback_keeps_skipping_the_window(poisoned, rolled_back, tmp_path):
    run_dir, _ = rolled_back
    step_32 = run_dir / "checkpoints" / "step-32"
    resumed, _ = train(poisoned, tmp_path, "resumed", [f"--checkpoint.resume_from={step_32}"])
    assert events(resumed) == []
    assert train_losses(resumed) == pytest.approx(train_losses(run_dir)[-(STEPS - 32) :], rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_run_stopped_before_its_next_checkpoint_does_not_meet_the_window_again(poisoned, rolled_back, tmp_path):
    """The rollback's window is in the run dir at once: a resume from the checkpoint before the spike (which does
    not know the window) skips it too."""
    original, _ = rolled_back
    shutil.copytree(original, tmp_path / "run")
    for step in (32, STEPS):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / f"step-{step}")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    run_dir, proc = train(poisoned, tmp_path, "run", [])
    assert "resumed from" in proc.stdout and "at step 24" in proc.stdout
    assert events(run_dir) == [] and "stability:" not in proc.stdout
    assert train_losses(run_dir) == pytest.approx(train_losses(original)[-(STEPS - 24) :], rel=1e-6, abs=0)


@pytest.mark.slow
def test_at_dp2_pp2_a_transient_fault_names_its_rank_and_a_poisoned_step_is_rolled_back(
    poisoned, never_had_the_window, tmp_path, monkeypatch
):
    """One decision for the whole job: rank 3 alone sees a 50x loss at step 20 (a drill's transient fault), every
    rank replays the step, rank 3 is named and the replayed step is kept; then the poisoned step is rolled back
    past, and the run ends where the 1-process run without those samples ends."""
    monkeypatch.setenv("NANOTRON_FAULT", "rank:3,step:20,kind:loss_spike:50")
    layout = ["--parallelism.dp=2", "--parallelism.pp=2", "--stability.on_transient=continue"]
    run_dir, proc = train(poisoned, tmp_path, "run", layout, nproc=4)
    transient, rollback = events(run_dir)
    assert transient["step"] == 20 and transient["stability/action"] == "transient"
    assert transient["stability/ranks"] == [3] and transient["stability/loss_z"] > 10
    assert "a transient fault, loss differed on rank 3" in proc.stdout
    assert rollback["step"] == POISON_STEP and rollback["stability/window"] == POISON_WINDOW
    reference = train_losses(never_had_the_window)  # 1 process: the layout matrix's tolerance
    assert train_losses(run_dir)[-(STEPS - 24) :] == pytest.approx(reference[24:], rel=RTOL, abs=0)


@pytest.mark.slow
def test_a_transient_fault_stops_the_job_with_the_node_fault_exit_code(poisoned, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRON_FAULT", "rank:0,step:14,kind:loss_spike:50")
    run_dir, proc = train(poisoned, tmp_path, "run", ["--training.steps=16"], check=False)
    assert proc.returncode == 75, proc.stderr[-2000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "step 14 spiked" in line and "a transient fault, loss differed on rank 0 (node " in line
    assert (run_dir / "suspect_nodes.txt").read_text().strip()
    assert not (run_dir / "checkpoints" / "step-16").exists()


@pytest.mark.slow
@pytest.mark.parametrize("action", ["stop", "skip_step"])
def test_the_stop_and_skip_step_policies(poisoned, tmp_path, action):
    run_dir, proc = train(poisoned, tmp_path, "run", [f"--stability.action={action}"], check=False)
    [event] = events(run_dir)
    assert event["step"] == POISON_STEP and event["stability/action"] == action
    if action == "stop":
        assert proc.returncode == 4
        [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert f"step {POISON_STEP} spiked" in line and "stability.action=stop" in line
        assert len(train_losses(run_dir)) == POISON_STEP - 1
    else:
        assert proc.returncode == 0 and len(train_losses(run_dir)) == STEPS
        assert f"step {POISON_STEP} spiked" in proc.stdout and "update skipped" in proc.stdout
        assert not (run_dir / SKIPPED_SAMPLES).exists()


@pytest.mark.slow
def test_a_float8_run_replays_its_spike_reproduced_and_rolls_back_past_it(poisoned, tmp_path):
    """The guard on a float8 run (emulated, tensorwise): the poisoned step spikes as in the plain run, its replay
    from the same state and batch reproduces it (float8's dynamic scales are recomputed from the same values: no
    false transient fault), and the run rolls back to the checkpoint before it, skips the window and finishes.
    (Past the rollback the run is a resume from that checkpoint, which test_float8 holds to the uninterrupted run.)"""
    steps = POISON_STEP + 2  # two steps past the spike are enough to see the run go on
    run_dir, proc = train(poisoned, tmp_path, "run", ["--training.float8=tensorwise", f"--training.steps={steps}"])
    assert " float8: tensorwise scaling, emulated" in proc.stdout + proc.stderr
    [event] = events(run_dir)
    assert event["step"] == POISON_STEP and event["stability/action"] == "rollback"
    assert event["stability/window"] == POISON_WINDOW and event["stability/rollback_to"] == 24
    assert "the replay reproduced it" in proc.stdout
    assert len(train_losses(run_dir)) == steps + POISON_STEP - 1 - 24  # 25..27 twice; the spiking step once, after
    assert saved_stability(run_dir / "checkpoints" / f"step-{steps}")["skipped_samples"] == [POISON_WINDOW]
