"""The Trainer: one rank's model pieces, optimizer, data and checkpoints, and the training loop.

Started by `nanotron.train` (the command line); everything a step does is here.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint import CheckpointManager, ModelState, OptimizerState, resolve_source
from nanotron.checkpoint.resume_policy import check_resume
from nanotron.config import Config, to_toml
from nanotron.data import build_train_loader, eval_batches, loader_batches, open_corpus
from nanotron.distributed import ParallelContext, init_distributed, loss_mesh
from nanotron.errors import DivergenceError, NodeFaultError
from nanotron.evaluation.scoring import DownstreamEval, load_tasks, scores_line, write_items
from nanotron.gpu import set_matmul_precision
from nanotron.io import write_atomic
from nanotron.metrics.activations import ActivationStats
from nanotron.metrics.logger import MetricsLogger
from nanotron.metrics.profiler import Profiler
from nanotron.metrics.step import StepTimer, detect_peak_tflops, memory_record, run_line, step_record, throughput
from nanotron.metrics.wandb_run import WandbRun
from nanotron.models.shapes import flops_per_token
from nanotron.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from nanotron.parallel.expert import ExpertBalance
from nanotron.parallel.parallelize import build_model
from nanotron.parallel.runner import MicrobatchRunner
from nanotron.signals import StopRequest
from nanotron.stability import SpikeGuard, Stability
from nanotron.tokenize.tokenizer import copy_tokenizer, load_tokenizer
from nanotron.watch.doctor import preflight
from nanotron.watch.heartbeat import Heartbeat
from nanotron.watch.straggler import StragglerScores


@dataclass
class TrainState:
    """Progress that travels with checkpoints (trainer_state.json). The data position is consumed_samples:
    the global sample order is a pure function of (seed, sample index)."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            value = state.get(f.name, 0)
            if type(value) is not int or value < 0:
                raise ValueError(f"{f.name}: expected a non-negative integer, got {value!r}")
            setattr(self, f.name, value)


class Progress:
    """What trainer_state.json holds: the TrainState's counters and the stability state."""

    def __init__(self, state: TrainState, stability: Stability, checkpoint_dir: Path) -> None:
        self.state, self.stability, self.checkpoint_dir = state, stability, checkpoint_dir

    def state_dict(self) -> dict:
        return self.state.state_dict() | {"stability": self.stability.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
        self.stability.load_state_dict(state.get("stability"), self.checkpoint_dir)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Trapped from the start, so a stop signal during set-up still stops cleanly at the first step boundary.
        self.stop = StopRequest()
        info = {"run_dir": str(cfg.run_dir.absolute()), "checkpoint_dir": str(cfg.checkpoint_dir.absolute())}
        info["watch"] = asdict(cfg.watch)
        self.heartbeat = Heartbeat.from_env(int(os.environ.get("RANK", "0")), info, cfg.watch.enabled)
        self.ctx: ParallelContext = init_distributed(cfg)
        set_matmul_precision(cfg, self.ctx.device)
        if cfg.training.preflight:  # bad nodes stop the job before anything is built
            preflight(cfg, self.ctx)
        p = cfg.parallelism
        self.corpus = open_corpus(cfg)
        # Known before the model exists: a start that loads weights skips the random init (the load overwrites it).
        self.source = resolve_source(cfg.checkpoint_dir, cfg.checkpoint)
        if self.source is not None and not self.source[1]:  # a resume: refuse what it cannot honour, list the rest
            note = check_resume(cfg, self.source[0])
            if note and self.ctx.rank == 0:
                print(note, flush=True)
        started = time.perf_counter()
        self.stages = build_model(cfg, self.ctx, initialize=self.source is None)
        self.build_seconds = time.perf_counter() - started
        self.modules = [module for _, module in self.stages]
        self.params = [param for module in self.modules for param in module.parameters()]
        self.runner = MicrobatchRunner(
            self.stages, cfg, self.ctx, on_phase=self.heartbeat.beat, eos_id=self.corpus.eos_id
        )
        self.stragglers = StragglerScores(cfg.watch, self.ctx.rank, self.ctx.world_size, self.ctx.device)
        # One optimizer per stage module keeps optimizer-state keys equal to parameter FQNs (DCP resharding).
        self.optimizers = [
            build_optimizer(module, cfg.optimizer, self.ctx.device, cfg.model) for module in self.modules
        ]
        self.state = TrainState()
        self.stability = Stability(cfg)
        self.spikes = SpikeGuard(self)
        # The loss lives on the last pipeline stage (rank 0's second stage under zbv): its first dp/cp/tp rank logs.
        first = self.ctx.dp_rank == 0 and self.ctx.cp_rank == 0 and self.ctx.tp_rank == 0
        self.is_logging_rank = self.runner.has_last and first
        wandb = WandbRun.start(cfg) if self.is_logging_rank and cfg.logging.wandb else None
        self.metrics = MetricsLogger(cfg.run_dir, self.is_logging_rank, cfg.logging.tensorboard, wandb)
        self.activation_stats = ActivationStats(cfg, self.modules, self.ctx.tp_rank, self.ctx.device)
        dp_cp = loss_mesh(self.ctx.mesh).get_group() if p.dp * p.cp > 1 else None
        self.experts = ExpertBalance(cfg, self.modules, dp_cp, self.ctx.device)
        self.downstream = None
        if cfg.evaluation.tasks:  # tokenized once, each rank its own share of the rows
            tasks = load_tasks(cfg)
            tokenizer = load_tokenizer(cfg.data.tokenizer)
            self.downstream = DownstreamEval(tasks, cfg, self.ctx, self.runner, tokenizer)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint_dir,
            cfg.checkpoint,
            states={"model": ModelState(self.modules), "optimizer": OptimizerState(self.modules, self.optimizers)},
            progress=Progress(self.state, self.stability, cfg.checkpoint_dir),
            write_extras=self.write_checkpoint_extras,
            meta={
                "global_batch_size": cfg.training.global_batch_size,
                "world_size": self.ctx.world_size,
                "layout": {"dp": p.dp, "cp": p.cp, "ep": p.ep, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage},
            },
            log=lambda message: print(message, flush=True),  # called on rank 0, the committing rank, at any pp
            device=self.ctx.device,
        )

    # ---- one step -------------------------------------------------------------------------------

    def next_batch(self) -> torch.Tensor:
        """grad_accum_steps microbatches stacked: [grad_accum_steps * micro_batch_size, seq_len + 1]."""
        return torch.cat([next(self.loader_iter) for _ in range(self.cfg.training.grad_accum_steps)])

    def dp_mean(self, value: torch.Tensor | None) -> float | None:
        """The dp x cp average of a per-rank loss, on the host (a collective and a sync: logging steps only)."""
        if value is None:
            return None
        if self.cfg.parallelism.dp * self.cfg.parallelism.cp > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG, group=loss_mesh(self.ctx.mesh).get_group())
        return value.item()

    def train_step(self) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        """One optimizer step; returns (loss, grad norm) as device tensors and whether a stop was agreed.

        The step's one host sync: a tiny all-reduce telling every rank whether any rank was asked to stop and
        whether the loss or the gradient norm is non-finite anywhere, and summing the global loss and gradient norm
        the spike detector scores. A non-finite step is not applied; a spike is handled by `[stability]`.
        """
        t = self.cfg.training
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
            set_lr(optimizer, lr_at(self.state.step, self.cfg.optimizer, t.steps))
        self.heartbeat.beat("data", self.state.step + 1)
        self.batch = self.next_batch()
        loss, grad_norm = self.forward_backward(injected=True)
        bad_loss = False if loss is None else ~torch.isfinite(loss)
        flags, values = self.agree(
            [self.stop.requested, bad_loss | ~torch.isfinite(grad_norm)], self.shares(loss, grad_norm)
        )
        stop, non_finite = flags
        self.applied, self.rolled_back = not non_finite, False
        if non_finite:
            self.skip_step(loss, grad_norm)
        else:
            self.applied = self.spikes.check(*values, loss, grad_norm)
        if self.applied:
            self.checkpoints.wait_for_staging()  # an async save's copy of the weights is complete
            for optimizer in self.optimizers:
                optimizer.step()
        return loss, grad_norm, stop

    def forward_backward(self, injected: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's gradients from `self.batch`, clipped; (this rank's loss, the global gradient norm)."""
        loss = self.runner.forward_backward(self.batch)
        fault = self.heartbeat.fault
        if injected and fault is not None and loss is not None:  # a drill's transient fault on this rank's loss
            loss = loss * fault.loss_factor(self.ctx.rank, self.state.step + 1)
        self.heartbeat.beat("optimizer")
        pp_group = self.ctx.mesh["pp"].get_group() if self.cfg.parallelism.pp > 1 else None
        return loss, clip_grad_norm(self.params, self.cfg.training.clip_grad, pp_group)

    def shares(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> list[torch.Tensor | float]:
        """This rank's terms of the global loss (the dp x cp mean of the last stage's losses, once per tp group)
        and of the gradient norm (already global: rank 0's), summed by the step's all-reduce."""
        p = self.cfg.parallelism
        loss_share = loss.double() / (p.dp * p.cp) if loss is not None and self.ctx.tp_rank == 0 else 0.0
        return [loss_share, grad_norm if self.ctx.rank == 0 else 0.0]

    def agree(self, flags: list, values: list) -> tuple[list[bool], list[float]]:
        """The step's collective (`ParallelContext.agree`), timed for the straggler scores; an injected fault
        may delay it or skip it on its rank."""
        fault, step = self.heartbeat.fault, self.state.step + 1
        if fault is not None:
            fault.at(self.ctx.rank, "step_collective", step)
            if fault.skips_collective(self.ctx.rank, step):
                return [False] * len(flags), [0.0] * len(values)
        return self.stragglers.timed(lambda: self.ctx.agree(flags, values))

    def skip_step(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        """A non-finite loss or gradient: the step is not applied, and after training.max_skipped_steps such
        steps the run stops before any checkpoint could keep the damage."""
        self.state.skipped_steps += 1
        where = f"step {self.state.step + 1}: loss {_host(loss)}, grad_norm {grad_norm.item()}"
        if self.state.skipped_steps > self.cfg.training.max_skipped_steps:
            raise DivergenceError(
                f"non-finite loss or gradients at {where}; stopped without applying it or saving a checkpoint "
                f"({self.state.skipped_steps - 1} earlier steps skipped; training.max_skipped_steps="
                f"{self.cfg.training.max_skipped_steps}); lower optimizer.lr (or training.clip_grad) and resume "
                "from the last checkpoint"
            )
        self.metrics.info(f"warning: non-finite loss or gradients at {where}; step skipped")

    def evaluate(self) -> float | None:
        """The validation loss, averaged over dp (None on ranks without the last pipeline stage)."""
        t, p = self.cfg.training, self.cfg.parallelism
        microbatches = list(eval_batches(self.corpus, t, dp=p.dp, dp_rank=self.ctx.dp_rank))
        steps = range(0, len(microbatches), t.grad_accum_steps)
        return self.dp_mean(self.runner.evaluate([torch.cat(microbatches[i : i + t.grad_accum_steps]) for i in steps]))

    # ---- the loop -------------------------------------------------------------------------------

    def log_eval(self) -> None:
        self.heartbeat.beat("eval", self.state.step)
        eval_loss = self.evaluate()
        if eval_loss is not None:
            self.metrics.log(
                {"step": self.state.step, "eval_loss": eval_loss},
                f"eval step {self.state.step} | eval_loss {eval_loss:.4f} | eval_ppl "
                f"{math.exp(min(eval_loss, 50)):.1f}",
            )

    def log_downstream(self) -> None:
        """The downstream tasks' scores at this step (and each item's, with evaluation.write_items)."""
        self.heartbeat.beat("eval", self.state.step)
        started = time.perf_counter()
        result = self.downstream.run()
        if result is None or not self.is_logging_rank:
            return
        scores, items = result
        seconds = time.perf_counter() - started
        self.metrics.log(
            {"step": self.state.step} | scores | {"eval/seconds": seconds},
            scores_line(self.state.step, self.downstream.tasks, scores) + f" | {seconds:.1f}s",
        )
        if self.cfg.evaluation.write_items:
            write_items(self.cfg.run_dir / "evaluation" / f"step-{self.state.step}.jsonl", items)

    def evaluating(self, interval: int) -> bool:
        step = self.state.step
        return bool(interval) and (step % interval == 0 or step == self.cfg.training.steps)

    def save_checkpoint(self, final: bool = False) -> None:
        self.heartbeat.beat("checkpoint", self.state.step)
        self.checkpoints.save(self.state.step, final=final)

    def log_stragglers(self, scores: dict[str, float]) -> None:
        """The scores to the metrics; a rank late for straggler_patience intervals in a row is named (every rank
        holds the same scores, so every rank takes the same decision)."""
        self.metrics.log({"step": self.state.step} | scores)
        for rank in self.stragglers.persistent():
            line = self.stragglers.describe(rank, scores)
            if self.cfg.watch.straggler_action == "exclude":
                if self.ctx.rank == 0:
                    write_atomic(self.cfg.run_dir / "suspect_nodes.txt", self.stragglers.nodes[rank] + "\n")
                raise NodeFaultError(f"{line}; stopped to requeue without its node (watch.straggler_action)")
            self.metrics.info(f"warning: {line}")

    def resume(self) -> None:
        if self.source is None:
            self.metrics.info(f"model: built and randomly initialised in {self.build_seconds:.2f}s")
            return
        path, model_only = self.source
        self.checkpoints.load(path, model_only)
        built = f"model built in {self.build_seconds:.2f}s, random init skipped"
        if model_only:
            self.metrics.info(f"checkpoint: model weights initialised from {path} ({built})")
        else:
            self.metrics.info(f"checkpoint: resumed from {path} at step {self.state.step} ({built})")
            self.metrics.resumed(self.state.step)

    def data_iterator(self):
        """The global batches from the trainer's position on, outside the skipped windows."""
        loader = build_train_loader(
            self.corpus,
            self.cfg.training,
            seed=self.cfg.job.seed,
            dp=self.cfg.parallelism.dp,
            dp_rank=self.ctx.dp_rank,
            start_sample=self.state.consumed_samples,
            skips=self.stability.skips,
        )
        return loader_batches(loader)

    def train(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.resume()
        if self.ctx.rank == 0:
            write_atomic(cfg.run_dir / "config.toml", to_toml(cfg), durable=False)
        self.loader_iter = self.data_iterator()
        self.metrics.info(run_line(cfg, self.corpus, self.ctx.world_size, self.ctx.device, self.state.step))
        if self.state.step == 0 and cfg.checkpoint.save_initial_state:
            self.save_checkpoint()
        downstream_interval = cfg.evaluation.interval or t.eval_interval
        if t.eval_interval and self.state.step == 0:
            self.log_eval()
        if self.downstream is not None and downstream_interval and self.state.step == 0:
            self.log_downstream()
        tokens_per_step = t.global_batch_size * t.seq_len
        flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
        peak = cfg.logging.peak_tflops or (
            detect_peak_tflops(self.ctx.device, t.dtype, t.tf32) if self.is_logging_rank else 0.0
        )
        timer, stop = StepTimer(self.state.step, t.steps), False
        profiler = Profiler.start(
            cfg.profiler, self.ctx.device, f"rank{self.ctx.rank}", self.ctx.rank == 0 or self.is_logging_rank
        )
        while self.state.step < t.steps and not stop:
            with self.activation_stats.step(self.state.step + 1):
                loss, grad_norm, stop = self.train_step()
            self.ctx.end_startup()  # the first step is done: collectives get distributed.timeout_minutes
            profiler.step()
            if self.rolled_back:  # the state is the older checkpoint's: the loop goes on from there
                self.activation_stats.discard()
                timer = StepTimer(self.state.step, t.steps)
                continue
            self.state.step += 1
            if (activations := self.activation_stats.result()) is not None:  # a collective on stats steps
                self.metrics.log({"step": self.state.step} | activations)
            logging_step = self.state.step % cfg.logging.log_interval == 0 or self.state.step == t.steps
            if (moe := self.experts.step_end(self.applied, logging_step)) is not None and logging_step:
                self.metrics.log({"step": self.state.step} | moe)
            if (scores := self.stragglers.step_end()) is not None:  # a collective every straggler_interval steps
                self.log_stragglers(scores)
            self.state.consumed_samples += t.global_batch_size
            self.state.consumed_tokens += tokens_per_step
            if self.state.step % cfg.logging.log_interval == 0 or self.state.step == t.steps:
                step_time, eta = timer.lap(self.state.step)
                loss_value = self.dp_mean(loss)
                memory = memory_record(self.ctx.device)  # a collective: every rank
                if self.is_logging_rank:
                    group = self.optimizers[0].param_groups[0]  # the rate the step used, not a recomputation
                    lr = group["lr"] / group.get("lr_scale", 1.0)
                    record = step_record(self.state, loss_value, lr, grad_norm.item(), step_time, eta)
                    record |= {f"stability/{name}_z": z for name, z in self.stability.last_z.items()}
                    record |= throughput(tokens_per_step, flops_per_step, step_time, self.ctx.world_size, peak)
                    self.metrics.log_step(record | memory, t.steps)
            if self.evaluating(t.eval_interval):
                self.log_eval()
            if self.downstream is not None and self.evaluating(downstream_interval):
                self.log_downstream()
            if not stop and cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0:
                self.save_checkpoint()
        profiler.stop()
        if stop or cfg.checkpoint.save_final:
            self.save_checkpoint(final=True)
        self.checkpoints.wait()
        if stop:
            self.metrics.info(
                f"preempted: stopped at step {self.state.step} after a stop signal; checkpoint saved "
                f"in {cfg.checkpoint_dir}; rerun the same command to resume"
            )

    def write_checkpoint_extras(self, step_dir: Path) -> None:
        """What makes a step dir usable on its own: the resolved config and the tokenizer."""
        (step_dir / "config.toml").write_text(to_toml(self.cfg))
        copy_tokenizer(Path(self.cfg.data.tokenizer), step_dir / "tokenizer")

    def close(self) -> None:
        self.heartbeat.close()
        self.checkpoints.close()
        self.metrics.close()
        self.stop.close()


def _host(value: torch.Tensor | None) -> float | None:
    return None if value is None else value.item()
