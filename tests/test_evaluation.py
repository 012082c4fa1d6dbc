"""Downstream evaluation: task files in every accepted layout, the harness's scoring rules, bad input in one line,
`nanotron eval` of a checkpoint at another layout equal to transformers on its HF export, and the demo task.
(Every training layout's per-item log-likelihoods are held to one process in test_parallel.py's matrix.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODEL, ZYGOTE, item_log_likelihoods, run_train, train_env

from nanotron.errors import DataError
from nanotron.evaluation.tasks import Item, Task, accuracy, encode_item, encode_pair, load_task
from nanotron.tokenize.tokenizer import load_tokenizer
from nanotron.tokenize.writer import tokenize_paths

RECORDS = {
    "native": {"context": "The cat", "choices": ["runs", "sees far"], "gold": 1},
    "lighteval": {"query": "The cat", "choices": ["runs", "sees far"], "gold_index": [1]},
    "hellaswag": {"ctx": "The cat", "endings": ["runs", "sees far"], "label": "1"},
    "arc": {"question": "The cat", "choices": {"text": ["runs", "sees far"], "label": ["A", "B"]}, "answerKey": "B"},
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("layout", RECORDS)
def test_each_harness_layout_reads_as_the_same_item(layout, tmp_path):
    task = load_task("t", write_jsonl(tmp_path / "t.jsonl", [RECORDS[layout]] * 3), max_items=2)
    context = "Question: The cat\nAnswer:" if layout == "arc" else "The cat"
    assert task.items == [Item(context, ("runs", "sees far"), 1)] * 2


@pytest.mark.parametrize(
    "line, expected",
    [
        ("{not json", "t.jsonl:2: not JSON"),
        ('{"text": "x"}', "t.jsonl:2: no context/query/ctx/question field"),
        ('{"context": "x", "choices": ["a"], "gold": 0}', "expected 'choices' to be a list of 2 or more"),
        ('{"context": "x", "choices": ["a", "b"], "gold": 2}', "expected the gold index to be an integer in [0, 2)"),
    ],
)
def test_a_bad_item_is_one_line_naming_file_and_line(line, expected, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(RECORDS["native"]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=None) as error:
        load_task("t", path)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_acc_norm_divides_by_the_choices_characters_as_the_harness_does():
    # lm-evaluation-harness: acc_norm = argmax(ll / len(choice)), len in characters (not tokens, not bytes).
    item = Item("ctx", ("a", "bbbbbbbb", "ccc"), 1)
    scores = accuracy(Task("t", Path("t"), [item, Item("ctx", ("x", "y"), 0)]), [-2.0, -8.0, -9.0, -1.0, -3.0])
    assert scores == {"acc": 0.5, "acc_norm": 1.0}  # -2/1 < -8/8: the long choice wins once normalised


def test_trailing_context_whitespace_moves_into_the_continuation(tiny_data):
    tokenizer = load_tokenizer(tiny_data.tokenizer)
    assert encode_pair(tokenizer, "the cat ", "runs") == encode_pair(tokenizer, "the cat", " runs")
    context, continuation = encode_pair(tokenizer, "the cat", " runs")
    assert tokenizer.decode(continuation) == " runs" and tokenizer.decode(context) == "the cat"
    rows = encode_item(tokenizer, Item(("the cat " * 20).strip(), ("runs", "sees"), 0), " ", seq_len=16, where="w")
    assert all(
        len(row) == 17 and row[-scored:] == encode_pair(tokenizer, "the cat", " " + c)[1]
        for (row, scored), c in zip(rows, ("runs", "sees"))
    )


@pytest.mark.slow
def test_eval_of_a_checkpoint_at_another_layout_equals_training_and_transformers(tiny_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    task = tiny_data.task
    run_train(
        [*tiny_data.overrides(), *TINY_MODEL, f"--job.out_dir={tmp_path}", "--job.name=run", "--training.steps=3"]
        + [f"--evaluation.tasks=mine={task}", "--evaluation.interval=3", "--evaluation.write_items=true"]
    )
    run_dir = tmp_path / "run"
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/mine/acc" in r]
    assert [r["step"] for r in records] == [0, 3]
    in_training = item_log_likelihoods(run_dir, 3)
    # nanotron eval at tp2 x pp2 (the run was one process), with its own command line.
    out, items = tmp_path / "scores.json", tmp_path / "items.jsonl"
    command = [sys.executable, "-m", "nanotron", "eval", str(run_dir), "--tasks", f"mine={task}"]
    command += ["--out", str(out), "--items", str(items), "--nproc_per_node", "4"]
    command += ["--parallelism.tp=2", "--parallelism.pp=2"]
    done = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads(out.read_text())["tasks"]["mine"]
    assert scores["items"] == 7 and scores["acc"] == records[-1]["eval/mine/acc"]
    at_tp2_pp2 = [value for line in items.read_text().splitlines() for value in json.loads(line)["log_likelihoods"]]
    assert torch.allclose(torch.tensor(at_tp2_pp2), torch.tensor(in_training), rtol=1e-5, atol=0)
    # transformers on the HF export, scored here the plain way: sum of log p(continuation token | prefix).
    export = ["convert", "to-hf", str(run_dir), str(tmp_path / "hf")]
    done = ZYGOTE.run([sys.executable, "-m", "nanotron", *export], export, 1, REPO, train_env(), 300, module="nanotron")
    assert done.returncode == 0, done.stderr[-3000:]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = load_tokenizer(tiny_data.tokenizer)
    expected = []
    for item in load_task("mine", task).items:
        expected.append([])
        for row, scored in encode_item(tokenizer, item, " ", seq_len=16, where="test"):
            with torch.no_grad():
                logprobs = hf(torch.tensor([row])).logits[0].log_softmax(-1)
            positions = range(len(row) - scored, len(row))
            expected[-1].append(sum(logprobs[p - 1, row[p]].item() for p in positions))
    assert torch.allclose(torch.tensor(at_tp2_pp2), torch.tensor(sum(expected, [])), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_the_next_words_task_is_learned_well_above_chance(tmp_path):
    """The demo task's builder on a corpus with something to learn (lines of a small fixed set, in random order):
    after a short training the accuracy beats chance (0.25) by more than 4 binomial standard errors of the item
    sample, which no seed's luck explains; at step 0 it does not."""
    import random

    from conftest import WORDS

    from nanotron.data.demo import next_words_items
    from nanotron.tokenize.bpe import train_tokenizer

    rng = random.Random(0)
    verses = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 9))).capitalize() + "," for _ in range(12)]
    plays = ["\n".join(rng.choice(verses) for _ in range(60)) for _ in range(43)]
    train_docs, held_out = plays[:40], plays[40:]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "plays.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs))
    train_tokenizer(train_docs, tmp_path / "tokenizer", vocab_size=512)
    items = next_words_items(held_out, 100, seed=0)
    assert items == next_words_items(held_out, 100, seed=0) and len(items) == 100  # deterministic
    assert all(len(i["choices"]) == 4 and len(set(i["choices"])) == 4 for i in items)
    task = write_jsonl(tmp_path / "next_words.jsonl", items)
    tokenize_paths(
        [str(tmp_path / "corpus")], tmp_path / "tokenizer", tmp_path / "tokens", validation_split=0.0, progress=False
    )
    data = [f"--data.path={tmp_path / 'tokens'}", f"--data.tokenizer={tmp_path / 'tokenizer'}"]
    run_train(
        [*TINY_MODEL, *data, f"--job.out_dir={tmp_path}", "--job.name=run", "--training.steps=50"]
        + ["--model.hidden_size=64", "--model.num_layers=2", "--training.seq_len=32", "--optimizer.lr=0.01"]
        + [f"--evaluation.tasks={task}", "--evaluation.interval=50", "--evaluation.max_items=100"]
    )
    scores = [
        r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "eval/next_words/acc" in r
    ]
    margin = 4 * (0.25 * 0.75 / len(items)) ** 0.5
    first, last = scores[0]["eval/next_words/acc"], scores[-1]["eval/next_words/acc"]
    print(f"next_words acc: step 0 {first:.2f}, step 50 {last:.2f} (chance 0.25 + 4 s.e. = {0.25 + margin:.2f})")
    assert [r["step"] for r in scores] == [0, 50] and first < 0.25 + margin < last


def test_eval_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    from nanotron.commands import eval as evaluate

    assert evaluate.main([str(tmp_path / "nope"), "--tasks", "t.jsonl"]) == 2
    assert evaluate.main([str(tmp_path), "--tasks", "t.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "does not exist" in err[0] and "holds no committed checkpoint" in err[1]


def test_eval_output_paths_are_checked_before_any_work(tmp_path, capsys):
    """An --out or --items that can't be written failed only after loading and scoring everything."""
    from nanotron.commands import eval as evaluate

    step = tmp_path / "step-8"
    step.mkdir()
    (step / ".metadata").write_text("")  # a checkpoint to find: its config and weights are never read
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    assert evaluate.main([str(step), "--tasks", "t.jsonl", "--out", str(tmp_path / "folder")]) == 2
    items = ["--items", str(tmp_path / "file" / "items.jsonl"), "--out", str(tmp_path / "scores.json")]
    assert evaluate.main([str(step), "--tasks", "t.jsonl", *items]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --out: '{tmp_path / 'folder'}' is a folder; give the path of a file to write",
        f"error: --items: cannot write to '{tmp_path / 'file'}' (a file is there); choose a writable folder",
    ]


def test_batches_score_like_length_rows_with_the_head_on_their_continuations_only(tiny_data):
    """Rows are batched by length and each batch carries one window of positions holding all of its targets:
    the head and the loss run there only (scores unchanged: the transformers comparison above)."""
    from types import SimpleNamespace

    from nanotron.config import load_config, parse_overrides
    from nanotron.evaluation.scoring import DownstreamEval
    from nanotron.evaluation.tasks import load_tasks
    from nanotron.parallel.runner import IGNORE_INDEX

    args = [*tiny_data.overrides(), *TINY_MODEL, f"--evaluation.tasks={tiny_data.task}", "--training.seq_len=16"]
    cfg = load_config(None, parse_overrides(args)[1], world_size=1)
    runner = SimpleNamespace(row_share=lambda total: (0, total), width_multiple=1, windowed=True)  # one process's
    scoring = DownstreamEval(load_tasks(cfg), cfg, runner, tokenizer=load_tokenizer(tiny_data.tokenizer))
    batches = list(scoring.batches())
    assert sum(int((targets != IGNORE_INDEX).sum()) for _, targets, _ in batches) == sum(
        row.scored for row in scoring.rows
    )
    for _, targets, (lo, hi) in batches:
        scored = (targets != IGNORE_INDEX).nonzero()[:, 1]
        assert lo == scored.min() and hi == scored.max() + 1  # every target inside, and no wider
    lengths = [len(scoring.rows[i].tokens) for i in scoring.order]
    assert lengths == sorted(lengths)
    windows, rows = sum(hi - lo for _, _, (lo, hi) in batches), sum(t.shape[1] for _, t, _ in batches)
    assert windows < rows / 2, (windows, rows)


def test_an_evaluation_record_carries_each_tasks_item_count_and_chance_level(tiny_data):
    """For the report's error bars and chance line: `eval/<task>/items` and `eval/<task>/chance` (uniform guessing's
    expected accuracy, the mean over items of 1 / choices) beside the scores, taken from the task file once."""
    from types import SimpleNamespace

    from nanotron.config import load_config, parse_overrides
    from nanotron.evaluation.evaluator import Evaluator
    from nanotron.step_end import StepInfo

    args = [*tiny_data.overrides(), *TINY_MODEL, f"--evaluation.tasks=mine={tiny_data.task}", "--training.seq_len=16"]
    args += ["--training.eval_interval=0", "--evaluation.interval=3"]  # downstream only, at step 3
    cfg = load_config(None, parse_overrides(args)[1], world_size=1)
    runner = SimpleNamespace(row_share=lambda total: (0, total), width_multiple=1, windowed=True, is_logging_rank=True)
    runner.score = lambda batches: torch.arange(25, dtype=torch.float64)  # one process's 25 rows, any scores
    runner.gather_rows = lambda mine: mine
    evaluator = Evaluator(cfg, corpus=None, ctx=None, runner=runner, on_phase=lambda phase, step: None)
    info = StepInfo(step=3, applied=True, logging=True, last=False, stopping=False)
    [(record, line)] = evaluator.step_end(info).entries
    choices = [len(json.loads(item)["choices"]) for item in tiny_data.task.read_text().splitlines()]
    assert set(record) == {"step", "eval/seconds"} | {f"eval/mine/{k}" for k in ("acc", "acc_norm", "items", "chance")}
    assert record["eval/mine/items"] == 7 and record["eval/mine/chance"] == sum(1 / n for n in choices) / 7
