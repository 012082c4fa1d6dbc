"""Downstream tasks scored on the training layout: the `Evaluator` (in training) and `nanotron eval` call this.

Every (item, choice) becomes one token row of seq_len + 1 tokens (see `tasks`), right-padded with EOS and
with targets only on the continuation's tokens. The rows of all tasks are dealt out to the dp ranks in equal
contiguous shares (the last share padded with rows that score nothing: `MicrobatchRunner.row_share`), each
share run in batches of the training step's shape (grad_accum_steps x micro_batch_size rows) through
`MicrobatchRunner.score`, so the model is used as it is sharded: FSDP/ZeRO gathers, TP, every pipeline engine
and cp work as in training, and nothing is gathered or converted. The per-row log-likelihoods of a share come
back on each last-stage rank (summed over cp there); one all-gather over dp (R float64, R = rows of all tasks:
320 KB for HellaSwag's 40k rows, per evaluation) gives them to the logging rank, which computes the scores.

Cost per evaluation: R / dp rows forward on each dp rank (padding to whole batches wastes at most one batch
per rank), rows sorted by length so that a batch's continuations share a narrow window of positions, the only
ones the head and the loss run on (not under cp); at 512 GPUs a 10k-item, 4-choice task is ~80 rows per dp rank
at dp 512. Tokenizing happens once, at start-up; each rank keeps only its share's token ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from nanotron.config import Config
from nanotron.evaluation.tasks import Task, encode_item, predictions, rates
from nanotron.io import write_atomic
from nanotron.parallel.runner import IGNORE_INDEX, MicrobatchRunner
from nanotron.tokenize.tokenizer import Tokenizer


@dataclass
class Row:
    tokens: torch.Tensor  # int32: 4 bytes a token (HellaSwag's 40k rows of ~100 tokens at dp 1: 16 MB)
    scored: int  # the last `scored` tokens are the continuation


class DownstreamEval:
    """The configured tasks, encoded once; `run()` scores them at this rank's place in the layout."""

    def __init__(self, tasks: list[Task], cfg: Config, runner: MicrobatchRunner, tokenizer: Tokenizer):
        self.tasks, self.runner = tasks, runner
        t = cfg.training
        self.seq_len, self.eos_id = t.seq_len, tokenizer.eos_id
        self.batch_rows = t.grad_accum_steps * t.micro_batch_size
        self.total = sum(task.rows for task in tasks)
        first, self.share = runner.row_share(self.total)
        self.rows = self._encode(tokenizer, cfg.evaluation.delimiter, first, min(first + self.share, self.total))
        # Batches hold rows of like length (less padding, narrower windows); the scores go back to row order.
        self.order = sorted(range(len(self.rows)), key=lambda i: len(self.rows[i].tokens))

    def _encode(self, tokenizer: Tokenizer, delimiter: str, first: int, end: int) -> list[Row]:
        """This rank's rows [first, end) of all tasks' rows (items whose rows all fall outside are not encoded)."""
        rows, index = [], 0
        for task in self.tasks:
            for number, item in enumerate(task.items):
                if first < index + len(item.choices) and index < end:
                    where = f"evaluation task '{task.name}' item {number}"
                    encoded = encode_item(tokenizer, item, delimiter, self.seq_len, where)
                    mine = range(max(first, index), min(end, index + len(item.choices)))
                    rows += [
                        Row(torch.tensor(encoded[i - index][0], dtype=torch.int32), encoded[i - index][1]) for i in mine
                    ]
                index += len(item.choices)
        return rows

    def batches(self):
        """This rank's share as (tokens, targets, window) batches of the training step's shape; the window
        (lo, hi) holds every scored target position of the batch (None under cp)."""
        count = math.ceil(self.share / self.batch_rows) if self.share else 0
        for b in range(count):
            rows = [self.rows[i] for i in self.order[b * self.batch_rows : (b + 1) * self.batch_rows]]
            width = self.seq_len
            if (multiple := self.runner.width_multiple) is not None:
                longest = max((len(row.tokens) - 1 for row in rows), default=1)
                width = min(self.seq_len, math.ceil(longest / multiple) * multiple)
            tokens = torch.full((self.batch_rows, width + 1), self.eos_id, dtype=torch.long)
            targets = torch.full((self.batch_rows, width), IGNORE_INDEX, dtype=torch.long)
            lo, hi = width, 0
            for r, row in enumerate(rows):
                n = len(row.tokens)
                tokens[r, :n] = row.tokens
                targets[r, n - 1 - row.scored : n - 1] = tokens[r, n - row.scored : n]
                lo, hi = min(lo, n - 1 - row.scored), max(hi, n - 1)
            window = (lo, hi) if hi > lo else (0, 1)  # (0, 1): a batch of padding rows only
            yield tokens, targets, window if self.runner.windowed else None

    def log_likelihoods(self) -> list[float] | None:
        """Every row's log-likelihood, in task order, on the last-stage ranks (None elsewhere)."""
        scores = self.runner.score(self.batches())  # built one batch at a time
        if scores is None:
            return None
        mine = torch.zeros(self.share, dtype=scores.dtype, device=scores.device)  # padding rows score 0
        mine[torch.tensor(self.order, dtype=torch.long, device=scores.device)] = scores[: len(self.order)]
        return self.runner.gather_rows(mine)[: self.total].tolist()

    def run(self) -> tuple[dict[str, float], dict[str, list[dict]]] | None:
        """Scores ({"eval/<task>/acc": ..., "eval/<task>/acc_norm": ...}) and per-item results on the
        last-stage ranks; None elsewhere."""
        values = self.log_likelihoods()
        if values is None:
            return None
        scores, items, start = {}, {}, 0
        for task in self.tasks:
            part = values[start : start + task.rows]
            start += task.rows
            items[task.name] = predictions(task, part)
            for metric, value in rates(items[task.name]).items():
                scores[f"eval/{task.name}/{metric}"] = value
        return scores, items


def scores_line(step: int | None, tasks: list[Task], scores: dict[str, float]) -> str:
    parts = [
        f"{t.name} acc {scores[f'eval/{t.name}/acc']:.3f} acc_norm {scores[f'eval/{t.name}/acc_norm']:.3f} "
        f"({len(t.items)} items)"
        for t in tasks
    ]
    return ("" if step is None else f"eval step {step} | ") + " | ".join(parts)


def write_items(path, items: dict[str, list[dict]]) -> None:
    """Per-item log-likelihoods and predictions, one JSON line per item with its task's name."""
    lines = [json.dumps({"task": name} | item) for name, task_items in items.items() for item in task_items]
    write_atomic(path, "\n".join(lines) + "\n", durable=False)
