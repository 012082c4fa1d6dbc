"""Multiple-choice tasks: local JSONL files in, token rows to score out, accuracy from the scores.

One item per line. The native fields are `context`, `choices` and `gold` (the index of the right choice);
the field names of three public harnesses' exports are read as well:

    native            {"context": "...", "choices": ["...", ...], "gold": 0}
    lighteval Doc     {"query": "...", "choices": [...], "gold_index": 0}
    HellaSwag (HF)    {"ctx": "...", "endings": [...], "label": "0"}
    ARC (HF)          {"question": "...", "choices": {"text": [...], "label": ["A", ...]}, "answerKey": "A"}

(ARC's context becomes "Question: ...\nAnswer:", as lm-evaluation-harness's arc tasks write it.)

Scoring follows lm-evaluation-harness's `loglikelihood` requests: the continuation is `delimiter + choice`
(a space by default); trailing whitespace of the context moves into the continuation; the continuation's
tokens are those of `tokens(context + continuation)` after the first `len(tokens(context))`. A row is
`[EOS] + context + continuation` (EOS begins every document in training), cut from the left to
`seq_len + 1` tokens. `acc` is the argmax of the summed log-likelihoods, `acc_norm` the argmax of the
log-likelihood divided by the choice's length in characters (lm-evaluation-harness's definition; lighteval's
`LogProbCharNorm`).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from nanotron.config import Config
from nanotron.config.conversion import show
from nanotron.errors import DataError
from nanotron.tokenize.tokenizer import Tokenizer

FORMAT_HINT = 'one JSON object per line, e.g. {"context": "...", "choices": ["...", "..."], "gold": 0}'
# What JSON's "\ud800" escapes decode to and no tokenizer (nor UTF-8) encodes: half of a UTF-16 pair, no text.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass
class Task:
    """A task's items and, once encoded, one token row per (item, choice)."""

    name: str
    path: Path
    items: list[Item]

    @property
    def rows(self) -> int:
        return sum(len(item.choices) for item in self.items)

    @property
    def chance(self) -> float:
        """The accuracy of guessing uniformly: the mean over items of 1 / choices (what a score is read against)."""
        return sum(1 / len(item.choices) for item in self.items) / len(self.items)


def _is_text(value: object) -> bool:
    return isinstance(value, str) and not _LONE_SURROGATE.search(value)


def _item(record: dict, where: str) -> Item:
    """One JSON record in any of the accepted layouts as an Item, or a DataError naming the line."""
    if "context" in record or "query" in record:
        context = record.get("context", record.get("query"))
        choices, gold = record.get("choices"), record.get("gold", record.get("gold_index"))
    elif "ctx" in record and "endings" in record:  # HellaSwag
        context, choices, gold = record["ctx"], record["endings"], record.get("label")
    elif "question" in record and isinstance(record.get("choices"), dict):  # ARC
        question, labels = record["question"], record["choices"].get("label", [])
        context = f"Question: {question}\nAnswer:" if isinstance(question, str) else question
        choices = record["choices"].get("text")
        answer = record.get("answerKey")
        gold = labels.index(answer) if isinstance(labels, list) and answer in labels else answer
    else:
        raise DataError(f"{where}: no context/query/ctx/question field; expected {FORMAT_HINT}")
    if isinstance(gold, list) and len(gold) == 1:  # lighteval stores gold_index as a list
        gold = gold[0]
    if isinstance(gold, str):  # HellaSwag's "0"; anything int() does not read is refused below as it is
        with contextlib.suppress(ValueError):
            gold = int(gold)
    if not _is_text(context):
        raise DataError(f"{where}: expected the context to be text (a string, no lone surrogate), got {show(context)}")
    if not isinstance(choices, list) or len(choices) < 2 or not all(_is_text(c) and c for c in choices):
        raise DataError(
            f"{where}: expected 'choices' to be a list of 2 or more non-empty strings of text, got {show(choices)}"
        )
    if type(gold) is not int or not 0 <= gold < len(choices):
        raise DataError(f"{where}: expected the gold index to be an integer in [0, {len(choices)}), got {show(gold)}")
    return Item(context, tuple(choices), gold)


def _line_item(line: bytes, where: str) -> Item:
    """One line of a task file as an Item, or a DataError naming the line."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); expected {FORMAT_HINT}") from None
    except (ValueError, RecursionError) as e:  # also a number too long for int(), or nesting too deep
        raise DataError(f"{where}: not JSON ({getattr(e, 'msg', e)}); expected {FORMAT_HINT}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, {FORMAT_HINT}")
    return _item(record, where)


def load_task(name: str, path: str | Path, max_items: int = 0) -> Task:
    """The items of a JSONL task file, the first `max_items` of them when > 0 (lm-evaluation-harness's limit)."""
    path = Path(path)
    what = f"evaluation task '{name}'"
    if not path.is_file():
        raise DataError(f"{what}: no file at '{path}'; expected a JSONL file, {FORMAT_HINT}")
    items = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                items.append(_line_item(line, f"{what}: {path}:{number}"))
            if max_items and len(items) == max_items:
                break
    if not items:
        raise DataError(f"{what}: '{path}' holds no items; expected {FORMAT_HINT}")
    return Task(name, path, items)


def load_tasks(cfg: Config) -> list[Task]:
    """The tasks of `[evaluation]`, each cut to evaluation.max_items."""
    e = cfg.evaluation
    return [load_task(t.task_name, t.path, e.max_items) for t in e.tasks]


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as lm-evaluation-harness splits them (see the module's doc)."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole = tokenizer.encode(stripped + continuation)
    context_ids = tokenizer.encode(stripped)
    return whole[: len(context_ids)], whole[len(context_ids) :]


def encode_item(tokenizer: Tokenizer, item: Item, delimiter: str, seq_len: int, where: str) -> list[tuple[list, int]]:
    """One (row tokens, continuation length) per choice: [EOS] + context + continuation, left-cut to seq_len + 1."""
    rows = []
    for choice in item.choices:
        context, continuation = encode_pair(tokenizer, item.context, delimiter + choice)
        if not continuation or len(continuation) > seq_len:
            raise DataError(
                f"{where}: a choice of {len(continuation)} tokens does not fit a row of training.seq_len={seq_len} "
                "tokens (1 to seq_len tokens are scored); shorten the choices or drop the item"
            )
        row = ([tokenizer.eos_id] + context + continuation)[-(seq_len + 1) :]
        rows.append((row, len(continuation)))
    return rows


def accuracy(task: Task, log_likelihoods: list[float]) -> dict[str, float]:
    """acc and acc_norm over the task's items from one log-likelihood per (item, choice), in row order."""
    return rates(predictions(task, log_likelihoods))


def rates(items: list[dict]) -> dict[str, float]:
    """acc and acc_norm of `predictions`' items."""
    return {
        "acc": sum(item["pred"] == item["gold"] for item in items) / len(items),
        "acc_norm": sum(item["pred_norm"] == item["gold"] for item in items) / len(items),
    }


def predictions(task: Task, log_likelihoods: list[float]) -> list[dict]:
    """Per item: the choices' log-likelihoods, gold and both predictions (for `write_items` / `--items`)."""
    out, start = [], 0
    for index, item in enumerate(task.items):
        scores = log_likelihoods[start : start + len(item.choices)]
        start += len(item.choices)
        normalised = [score / len(choice) for score, choice in zip(scores, item.choices)]
        out.append(
            {"item": index, "log_likelihoods": scores, "gold": item.gold, "pred": _argmax(scores)}
            | {"pred_norm": _argmax(normalised)}
        )
    if start != len(log_likelihoods):
        raise ValueError(f"{len(log_likelihoods)} scores for {start} rows of task {task.name}")
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
