"""The `[evaluation]` section: downstream multiple-choice tasks (`EvaluationConfig`, one `EvalTaskConfig` each)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanotron.config.option import opt


@dataclass
class EvalTaskConfig:
    """One `[[evaluation.tasks]]` table; on the command line `--evaluation.tasks=PATH,NAME=PATH`."""

    name: str = opt("", "the task's name in metrics (eval/<name>/acc); empty = the file's name without .jsonl")
    path: str = opt("", "a JSONL file of multiple-choice items (see docs/evaluation.md)")

    @staticmethod
    def from_text(text: str) -> dict[str, str]:
        name, equals, path = text.partition("=")
        return {"name": name, "path": path} if equals else {"path": text}

    @property
    def task_name(self) -> str:
        return self.name or Path(self.path).name.removesuffix(".jsonl").removesuffix(".json")


@dataclass
class EvaluationConfig:
    """[evaluation]: downstream multiple-choice tasks scored by log-likelihood on the training layout."""

    tasks: list[EvalTaskConfig] = opt([], "[[evaluation.tasks]] tables with name and path (JSONL items)")
    interval: int = opt(0, "steps between downstream evaluations; 0 = with training.eval_interval", min=0)
    max_items: int = opt(0, "score only each task's first N items; 0 = all", min=0)
    delimiter: str = opt(" ", "text between the context and each choice (lm-evaluation-harness's target_delimiter)")
    write_items: bool = opt(
        False, "also write each item's log-likelihoods to <run dir>/evaluation/step-N.jsonl at every evaluation"
    )
