"""`nanotron report`: figures and a summary from metrics.jsonl alone, a resumed run's repeated steps counted once."""

from __future__ import annotations

import json

import pytest

from nanotron.commands import report

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
    assert "straggler scores above 0.25 of a step at steps [3]" in text and "![loss.png](loss.png)" in text
    assert "report: " in capsys.readouterr().out


def test_a_dir_without_metrics_is_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and len(err.strip().splitlines()) == 1
