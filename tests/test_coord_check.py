"""`nanotron coord-check`: the slope verdict, bad flags as one line, and a real check that passes µP and fails
standard parametrization at a tensor-parallel layout."""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import FORKRUN, TINY_MODEL, ZYGOTE, train_env

from nanotron.commands.coord_check import main
from nanotron.coord_check import runs
from nanotron.coord_check.report import slope, verdicts

GOOD_JSON = '{"steps": 3, "caption": "c"}'
GOOD_CSV = "sweep,parametrization,size,seed,step,statistic,value\nwidth,mup,64,0,3,size/logits,0.5\n"


def rows_for(values: dict[int, float], parametrization: str, statistic: str = "update/q_proj") -> list[dict]:
    return [
        dict(sweep="width", parametrization=parametrization, size=size, seed=0, step=3, statistic=statistic, value=v)
        for size, v in values.items()
    ]


def test_the_verdict_is_the_log_log_slope_over_the_sweep():
    """A statistic growing like width^1 has slope 1 and is not flat; one within noise of constant is flat."""
    assert slope([64, 128, 256], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert slope([64, 128, 256], [5.0, 5.0 * 2**-0.5, 2.5]) == pytest.approx(-0.5)
    rows = rows_for({64: 1.0, 128: 2.0, 256: 4.0}, "standard") + rows_for({64: 1.0, 128: 1.1, 256: 0.95}, "mup")
    (row,) = verdicts(rows, steps=3, tolerance=0.2)
    assert row["standard slope"] == 1.0 and row["standard flat"] is False and row["standard max/min"] == 4.0
    assert abs(row["µP slope"]) < 0.05 and row["µP flat"] is True
    # Only the last step is judged: an earlier step's values do not move the slope.
    early = [dict(r, step=1, value=r["value"] * r["size"]) for r in rows_for({64: 1.0, 128: 1.0, 256: 1.0}, "mup")]
    (again,) = verdicts(rows + early, steps=3, tolerance=0.2)
    assert again["µP slope"] == row["µP slope"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--widths", "64"], "--widths='64': expected at least two distinct positive sizes"),
        (["--widths", "64,x"], "--widths='64,x': expected comma-separated positive integers"),
        (["--model.intermediate_size=200", "--widths", "50,100"], "--widths: 50 x the config's MLP ratio 200/128"),
        (["--widths", "36,72"], "--widths: width 36 cannot hold 4"),
        (["--parametrizations", "sp"], "--parametrizations='sp': expected standard, mup or standard,mup"),
        (["--model.hidden_sise=3"], "hidden_sise"),
        (["--replot"], "--replot: "),
        (["--steps", "abc"], "argument --steps: expected an integer >= 1, got 'abc'"),
        (["--seeds", "0"], "argument --seeds: expected an integer >= 1, got '0'"),
        (["--bogus"], "unrecognized arguments: --bogus (config overrides are --section.key=value)"),
        (["--widths", "-64,128"], "argument --widths: expected one argument"),
        (["--probe-tokens", "0"], "argument --probe-tokens: expected an integer >= 1, got '0'"),
        (["--probe-tokens", "-5"], "argument --probe-tokens: expected an integer >= 1, got '-5'"),
        (["--tolerance", "nan"], "argument --tolerance: expected a finite number >= 0, got 'nan'"),
        (["--tolerance", "-1"], "argument --tolerance: expected a finite number >= 0, got '-1'"),
    ],
)
def test_bad_flags_are_one_line_and_nothing_runs(flags, expected, tmp_path, capsys):
    assert main([*flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_member_of_a_resolved_config_gets_its_own_head_dim():
    """A run dir's config.toml states head_dim: a wider member must not keep the base's (4 heads of 64 at 256)."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.coord_check.runs import family

    base = ["--config", str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"), "--model.head_dim=32"]
    cfg = load_config(*parse_overrides(base))
    member = family(cfg, 256, 4, fixed_head_dim=False)
    wide = load_config(*parse_overrides([*base, *member.overrides()])).model
    assert (wide.hidden_size, wide.num_heads, wide.head_dim) == (256, 4, 64) == (member.width, member.heads, 64)


def forked(command: list[str], stdout, stderr) -> subprocess.CompletedProcess:
    """The member's `python -m nanotron.train ARGS --nproc_per_node N`, its ranks forked by tests/forkrun.py from
    the worker's tests/zygote.py: the same ranks without their imports (6 members x 2 ranks of ~4 s of CPU each);
    its output into the member's log, as the command's."""
    assert command[1:3] == ["-m", "nanotron.train"] and command[-2] == "--nproc_per_node", command
    assert stderr == subprocess.STDOUT
    nproc, args = int(command[-1]), command[3:-2]
    proc = ZYGOTE.run([sys.executable, str(FORKRUN), *command[-1:], *args], args, nproc, Path.cwd(), train_env(), 300)
    stdout.write(proc.stdout + proc.stderr)
    return proc


@pytest.mark.slow
def test_coord_check_passes_mup_and_fails_standard_at_tp2(tiny_data, tmp_path, capsys, monkeypatch):
    """The tiny family at tp2 (2 processes; docs/mup.md's example is tiny.toml at tp2 x pp2): µP's slopes flat,
    standard's not (its updates grow ~width^1); the table, every value and the figures written. The members'
    launch through `nanotron.train --nproc_per_node` is the launch tests' (test_launch.py)."""
    monkeypatch.setattr(runs, "subprocess", types.SimpleNamespace(run=forked, STDOUT=subprocess.STDOUT))
    out = tmp_path / "cc"
    model = [o for o in TINY_MODEL if not o.startswith(("--model.hidden_size", "--model.intermediate_size"))]
    args = ["--widths", "32,128", "--depths", "2,4", "--steps", "3", "--out", str(out), "--parallelism.tp=2"]
    args += ["--tolerance", "0.45"]  # widths 32 (head dim 8) and 128: µP's worst slope here 0.38, standard's >= 0.78
    args += [*model, "--model.hidden_size=32", "--model.intermediate_size=96", *tiny_data.overrides()]
    args += ["--training.device=cpu", "--optimizer.lr=0.004", "--training.eval_steps=1", "--logging.peak_tflops=1"]
    status = main(args)
    stdout = capsys.readouterr().out
    assert "coord check: standard fails, µP passes" in stdout, stdout[-3000:]
    assert status == 0
    table = (out / "coord_check.md").read_text()
    assert "| width | update/down_proj |" in table and "| depth | change/residual |" in table
    with open(out / "coord_check.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    families = {r["statistic"].split("/")[0] for r in rows}
    assert families == {"size", "change", "update"} and all(math.isfinite(float(r["value"])) for r in rows)
    assert {int(r["step"]) for r in rows if r["statistic"].startswith("size/")} == {1, 2, 3}
    if importlib.util.find_spec("matplotlib"):
        for sweep in ("width", "depth"):
            assert all((out / f"coord-check-{sweep}-{s}.png").stat().st_size > 0 for s in ("size", "change", "update"))


@pytest.mark.parametrize(
    "saved, table, expected",
    [
        ("{", GOOD_CSV, "coord_check.json' is not valid JSON"),
        ("{}", GOOD_CSV, "coord_check.json': steps: missing"),
        ('{"steps": 0, "caption": "c"}', GOOD_CSV, "coord_check.json': steps: expected an integer >= 1, got 0"),
        ('{"steps": 3, "caption": 5}', GOOD_CSV, "coord_check.json': caption: expected a caption (a string), got 5"),
        (GOOD_JSON, "a,b\n", "coord_check.csv' has no column sweep, parametrization, size"),
        (GOOD_JSON, "sweep,parametrization,size,seed,step,statistic,value\n", "coord_check.csv' has no rows"),
        (GOOD_JSON, GOOD_CSV.replace(",3,size/logits,0.5", ",3,size/logits,nan"), "coord_check.csv' line 2: expected"),
        (GOOD_JSON, GOOD_CSV.replace("width,mup,64", "width,mup,x"), "coord_check.csv' line 2: expected"),
        (GOOD_JSON, b"\xff\xfe", "coord_check.csv' is not a coord-check CSV"),
        (GOOD_JSON, GOOD_CSV, "coord_check.csv' has no rows of width change, width update, depth size, depth change"),
    ],
)
def test_replot_of_a_corrupt_record_is_one_line_and_keeps_it(saved, table, expected, tmp_path, capsys):
    """--replot reads back what a check wrote: a corrupt or wrongly shaped file is named, not a traceback, and
    left as it was."""
    for name, text in (("coord_check.json", saved), ("coord_check.csv", table)):
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["--replot", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert "--out" in err  # the hint: how to write it again
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
