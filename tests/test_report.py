"""`nanotron report`: figures and a summary from metrics.jsonl alone, a resumed run's repeated steps counted once;
figures a researcher can paste (units on both axes, MFU in percent, the worst stragglers, accuracy against chance
with error bars, PNG + PDF + SVG) and the run's duration."""

from __future__ import annotations

import json
import math
from html import escape

import pytest

from nanotron.commands import report
from nanotron.metrics import report as metrics
from nanotron.metrics.logger import step_line

pytest.importorskip("matplotlib")


def write_metrics(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def step(n, loss, **extra):
    base = {"step": n, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0 + n, "mfu": 0.1}
    return base | {"memory_gib": 0.4, "consumed_samples": 8 * n} | extra


def test_report_draws_what_the_run_logged_and_summarises_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    records = [
        {"step": 0, "eval_loss": 6.0},
        {"step": 0, "eval/demo/acc": 0.25, "eval/demo/acc_norm": 0.2, "eval/seconds": 1.0},
        step(1, 5.0),
        step(2, 4.0),
        step(3, 9.0),  # the killed process's step 3, trained again after the resume below
        {"step": 3, "stability/action": "rollback", "stability/loss": 9.0, "stability/window": [16, 24]},
        step(3, 3.5),
        {"step": 3, "eval/demo/acc": 0.4, "eval/demo/acc_norm": 0.35, "eval/seconds": 1.0},
        {"step": 3, "straggler/rank_0": 0.0, "straggler/rank_1": 0.6, "straggler/max": 0.6},
        {"step": 3, "act/layers.0": 1.0, "act/norm": 2.0},
    ]
    write_metrics(run_dir, records, tail='{"step": 4, "loss": 3.')  # a line cut by a kill
    assert report.main([str(run_dir)]) == 0
    out = run_dir / "report"
    names = {p.name for p in out.glob("*.png")}
    assert {"loss.png", "downstream.png", "throughput.png", "activations.png", "stragglers.png"} <= names
    text = (out / "summary.md").read_text()
    assert "final train loss 3.5000 (best 3.5000)" in text  # the later record of step 3 wins
    assert "eval/demo/acc: best 0.400 at step 3" in text and "step 3: stability rollback" in text
    assert (
        "straggler scores above 0.4 (a rank working 1.4x as long as its peers) at steps [3]" in text
        and "![loss.png](loss.png)" in text
    )
    assert "report: " in capsys.readouterr().out


# A run of 6 logged steps at 8 ranks over 1h02m03s of wall clock, with a downstream task of 200 items of 4 and
# 2 choices (chance 0.375) and straggler scores whose worst ranks are not the latest at the last step.
START = 1_700_000_000.0
STRAGGLERS = {
    0: 0.0,
    1: 0.05,
    2: 0.7,
    3: 0.1,
    4: 0.3,
    5: 0.9,
    6: 0.02,
    7: 0.4,
}  # each rank's score at its one late step


def straggler_score(rank, step):
    """Each rank late at one step; at the others the ranks that are mildest then are the latest, so the three
    with the worst scores (5, 2, 7) are not the three latest at the last step (5, 0, 6)."""
    worst = STRAGGLERS[rank]
    return worst if step == rank % 6 + 1 else (0.9 - worst) / 10


def full_run(run_dir):
    records = [{"step": 0, "eval_loss": 6.0, "time": START}]
    for n in range(1, 7):
        records.append(step(n, 6.0 - n / 2, step_time_sec=0.5, tflops=1.2, mfu=0.1234, time=START + 600 * n))
        scores = {f"straggler/rank_{r}": straggler_score(r, n) for r in STRAGGLERS}
        records.append({"step": n, **scores, "straggler/max": max(scores.values()), "time": START + 600 * n})
    for n, acc in ((0, 0.25), (3, 0.4), (6, 0.45)):
        scores = {"eval/demo/acc": acc, "eval/demo/acc_norm": acc - 0.05, "eval/demo/items": 200}
        records.append({"step": n, **scores, "eval/demo/chance": 0.375, "eval/seconds": 1.0, "time": START + 600 * n})
    records.append({"step": 4, "stability/action": "skip", "time": START + 2450})
    records.append({"step": 6, "act/layers.0": 1.0, "act/norm": 2.0, "time": START + 3723})
    write_metrics(run_dir, records)
    return records


UNITS = {
    "loss": "loss (nats/token)",
    "learning_rate": "learning rate",
    "grad_norm": "gradient L2 norm",
    "memory": "memory (GiB)",
    "downstream": "accuracy (fraction of items)",
    "throughput": "tokens/s (all devices)",
    "step_time": "step time (s)",
    "tflops": "TFLOP/s per device",
    "mfu": "MFU (% of peak)",
    "activations": "mean |x| per element",
    "stragglers": "own time beyond peers (fraction of their median)",
}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure of `full_run` drawn once: {name: (plot, axes)} and the report dir."""
    run_dir = tmp_path_factory.mktemp("run")
    records = full_run(run_dir)
    data, found = metrics.series(records), metrics.events(records)
    out = run_dir / "drawn"
    out.mkdir()
    return {p.name: (p, metrics.draw(p, out, "run, 1h02m")) for p in metrics.plots(data, found)}, out


def test_every_figure_has_step_on_x_and_its_unit_on_y_in_the_png_pdf_and_svg(drawn):
    figures, out = drawn
    assert set(figures) == set(UNITS)
    for name, (_, ax) in figures.items():
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", UNITS[name]), name
        assert all((out / f"{name}.{suffix}").stat().st_size > 0 for suffix in ("png", "pdf", "svg"))
        svg = (out / f"{name}.svg").read_text()  # text stays text: a paper's editor can restyle it
        assert f">{escape(UNITS[name])}<" in svg and ">step<" in svg and ">run, 1h02m<" in svg


def test_stability_actions_stay_marked_on_the_loss_only(drawn):
    figures, _ = drawn
    _, ax = figures["loss"]
    assert [t.get_text() for t in ax.texts] == ["skip"]
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_label().startswith("_")] == [[4, 4]]
    assert all(not ax.texts for name, (_, ax) in figures.items() if name != "loss")


def test_mfu_is_drawn_in_percent_as_the_step_line_prints_it(drawn):
    (plot, ax) = drawn[0]["mfu"]
    percent = ax.get_lines()[0].get_ydata()
    record = step(6, 3.0, step_time_sec=0.5, tflops=1.2, mfu=0.1234, consumed_tokens=0, eta_sec=0.0)
    assert f"mfu {percent[-1]:.2f}%" in step_line(record | {"tokens_per_sec_per_device": 1.0}, 6)
    assert list(percent) == pytest.approx([12.34] * 6, abs=1e-12)


def test_stragglers_are_the_max_and_the_three_ranks_with_the_worst_scores(drawn):
    plot, ax = drawn[0]["stragglers"]
    assert [line.get_label() for line in ax.get_lines()] == [
        "max over 8 ranks",
        "rank 5 (worst 0.90)",
        "rank 2 (worst 0.70)",
        "rank 7 (worst 0.40)",
    ]
    assert list(ax.get_lines()[0].get_ydata()) == [max(straggler_score(r, n) for r in STRAGGLERS) for n in range(1, 7)]


def test_accuracy_has_binomial_error_bars_over_the_items_and_the_chance_level(drawn):
    plot, ax = drawn[0]["downstream"]
    acc = plot.lines[0]
    assert acc.label == "demo acc" and acc.errors == {s: math.sqrt(p * (1 - p) / 200) for s, p in acc.points.items()}
    assert len(ax.containers) == 2  # acc and acc_norm, each with its error bars
    bars = ax.containers[0].lines[2][0].get_segments()  # the vertical bars: (step, p - se) to (step, p + se)
    expected = [(s, p - acc.errors[s], p + acc.errors[s]) for s, p in sorted(acc.points.items())]
    assert sum(([x0, y0, y1] for (x0, y0), (_, y1) in bars), []) == pytest.approx(sum(map(list, expected), []))
    chance = [line for line in ax.get_lines() if line.get_label() == "chance (demo)"]
    assert len(chance) == 1 and list(chance[0].get_ydata()) == [0.375, 0.375]


def test_the_summary_states_the_wall_clock_duration_and_the_figures_come_in_three_formats(tmp_path):
    run_dir = tmp_path / "run"
    full_run(run_dir)
    assert report.main([str(run_dir)]) == 0
    text = (run_dir / "report" / "summary.md").read_text()
    assert "- duration: 1h02m wall clock, first record to last" in text
    assert "- eval/demo/acc: best 0.450 at step 6, last 0.450 (± 0.035 s.e., 200 items; chance 0.375)" in text
    for name in UNITS:
        assert all((run_dir / "report" / f"{name}.{suffix}").is_file() for suffix in ("png", "pdf", "svg"))


def test_a_dir_without_metrics_is_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and len(err.strip().splitlines()) == 1


def test_an_incident_with_an_empty_summary_is_listed_by_its_folder_name(tmp_path):
    """An incident folder whose summary.txt is empty (a rank killed while writing it) was an IndexError."""
    (tmp_path / "incidents" / "launch-7-0").mkdir(parents=True)
    (tmp_path / "incidents" / "launch-7-0" / "summary.txt").write_text("")
    (tmp_path / "incidents" / "launch-8-0").mkdir()
    (tmp_path / "incidents" / "launch-8-0" / "summary.txt").write_text("rank 1 died: killed by signal 9\nstack\n")
    text = metrics.summary(tmp_path, {}, [], [], None)
    assert "- launch-7-0: launch-7-0\n- launch-8-0: rank 1 died: killed by signal 9\n" in text


def test_an_out_that_is_a_file_is_one_line_before_drawing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [step(1, 5.0)])
    (tmp_path / "taken").write_text("")
    assert report.main([str(run_dir), "--out", str(tmp_path / "taken")]) == 2
    assert report.main([str(run_dir), "--out", str(tmp_path / "taken" / "report")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --out: cannot write to '{tmp_path / 'taken'}' (a file is there); choose a writable folder",
        f"error: --out: cannot write to '{tmp_path / 'taken' / 'report'}' (Not a directory); choose a writable folder",
    ]
