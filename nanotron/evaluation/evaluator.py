"""Evaluation during training, at the steps it is due: the validation loss (every training.eval_interval steps) and
the downstream tasks (every evaluation.interval steps, else the same), before the first step of a fresh run and
after the last, on the training layout. A step-end service (`nanotron.step_end`): it reports, the trainer logs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from nanotron.config import Config
from nanotron.data import Corpus
from nanotron.data.loader import eval_batches
from nanotron.evaluation.scoring import DownstreamEval, scores_line, write_items
from nanotron.evaluation.tasks import load_tasks
from nanotron.parallel.mesh import ParallelContext
from nanotron.parallel.runner import MicrobatchRunner
from nanotron.step_end import StepInfo, StepReport
from nanotron.tokenize.tokenizer import load_tokenizer


class Evaluator:
    def __init__(
        self,
        cfg: Config,
        corpus: Corpus,
        ctx: ParallelContext,
        runner: MicrobatchRunner,
        on_phase: Callable[[str, int], None],
    ):
        self.training, self.corpus, self.ctx, self.runner, self.on_phase = cfg.training, corpus, ctx, runner, on_phase
        self.validation_interval = cfg.training.eval_interval
        self.downstream_interval = cfg.evaluation.interval or cfg.training.eval_interval
        self.downstream = None
        self.task_facts: dict[str, float] = {}
        if cfg.evaluation.tasks:  # tokenized once, each rank its own share of the rows
            tokenizer = load_tokenizer(cfg.data.tokenizer)
            self.downstream = DownstreamEval(load_tasks(cfg), cfg, runner, tokenizer)
            # logged with the scores, for their error bars and chance line; known from the task files
            for t in self.downstream.tasks:
                self.task_facts |= {f"eval/{t.name}/items": len(t.items), f"eval/{t.name}/chance": t.chance}
        self.items_dir = cfg.run_dir / "evaluation" if cfg.evaluation.write_items else None

    def start(self, step: int) -> StepReport | None:
        """Before the first step of a fresh run (a resumed run's step was evaluated before it was saved)."""
        if step:
            return None
        return self._run(0, bool(self.validation_interval), bool(self.downstream_interval))

    def step_end(self, info: StepInfo) -> StepReport | None:
        return self._run(info.step, _due(self.validation_interval, info), _due(self.downstream_interval, info))

    def _run(self, step: int, validation: bool, downstream: bool) -> StepReport | None:
        entries = self._validation(step) if validation else []
        if downstream and self.downstream is not None:
            entries += self._downstream(step)
        return StepReport(entries) if entries else None

    def _validation(self, step: int) -> list[tuple[dict, str]]:
        """The validation loss, averaged over dp x cp (nothing to log on ranks without the last pipeline stage)."""
        self.on_phase("eval", step)
        t = self.training
        microbatches = list(eval_batches(self.corpus, t, dp=self.ctx.dp, dp_rank=self.ctx.dp_rank))
        steps = range(0, len(microbatches), t.grad_accum_steps)
        losses = self.runner.evaluate([torch.cat(microbatches[i : i + t.grad_accum_steps]) for i in steps])
        loss = self.runner.mean_loss(losses)
        if loss is None:
            return []
        line = f"eval step {step} | eval_loss {loss:.4f} | eval_ppl {math.exp(min(loss, 50)):.1f}"
        return [({"step": step, "eval_loss": loss}, line)]

    def _downstream(self, step: int) -> list[tuple[dict, str]]:
        """The downstream tasks' scores (and each item's, with evaluation.write_items, in evaluation/step-N.jsonl)."""
        self.on_phase("eval", step)
        started = time.perf_counter()
        result = self.downstream.run()
        if result is None or not self.runner.is_logging_rank:
            return []
        scores, items = result
        seconds = time.perf_counter() - started
        if self.items_dir is not None:
            write_items(self.items_dir / f"step-{step}.jsonl", items)
        line = scores_line(step, self.downstream.tasks, scores) + f" | {seconds:.1f}s"
        return [({"step": step} | scores | self.task_facts | {"eval/seconds": seconds}, line)]


def _due(interval: int, info: StepInfo) -> bool:
    return bool(interval) and (info.step % interval == 0 or info.last)
