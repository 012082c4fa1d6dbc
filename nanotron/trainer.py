"""The Trainer: one rank's model pieces, optimizer, data and checkpoints, and the training loop.

Started by `nanotron.train` (the command line); everything a step does is here. Nothing else holds the trainer:
the stability policy decides from agreed values and the step-end services (`nanotron.step_end`) report; the
trainer carries out their decisions with its own parts.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import NoReturn

import torch

from nanotron.checkpoint.layout import committed_steps, latest_checkpoint
from nanotron.checkpoint.manager import CheckpointManager, resolve_source
from nanotron.checkpoint.resume_policy import check_resume
from nanotron.checkpoint.state import ModelState, OptimizerState
from nanotron.config import Config, to_toml
from nanotron.console import say
from nanotron.data import open_corpus
from nanotron.data.loader import build_train_loader, loader_batches
from nanotron.data.skips import write_run_skips
from nanotron.errors import DivergenceError, NodeFaultError, UserError
from nanotron.evaluation.evaluator import Evaluator
from nanotron.gpu import keep_freed_host_memory, set_matmul_precision
from nanotron.io import write_atomic
from nanotron.metrics.activations import ActivationStats
from nanotron.metrics.logger import MetricsLogger
from nanotron.metrics.profiler import Profiler
from nanotron.metrics.step import StepTimer, detect_peak_tflops, memory_record, run_line, step_record, throughput
from nanotron.metrics.wandb_run import WandbRun
from nanotron.models.shapes import flops_per_token
from nanotron.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from nanotron.optim.muon import describe as describe_muon
from nanotron.parallel.expert import ExpertBalance
from nanotron.parallel.float8 import describe_float8, precompute_float8_scales
from nanotron.parallel.layout import layout_sizes
from nanotron.parallel.mesh import ParallelContext, init_distributed, submesh
from nanotron.parallel.parallelize import build_model
from nanotron.parallel.regather import agree_on_regather
from nanotron.parallel.runner import MicrobatchRunner
from nanotron.records import TRAINER_STATE
from nanotron.signals import StopRequest
from nanotron.stability import Decision, Observation, Replay, Stability, rank_values
from nanotron.step_end import StepEnd, StepInfo, StepReport
from nanotron.tokenize.tokenizer import copy_tokenizer
from nanotron.watch.doctor import preflight
from nanotron.watch.faults import Drill
from nanotron.watch.heartbeat import Heartbeat
from nanotron.watch.straggler import StragglerScores
from nanotron.watch.suspects import write_suspects


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
        """`state` as checked by `records.TRAINER_STATE`."""
        for f in fields(self):
            setattr(self, f.name, state.get(f.name, 0))


class Progress:
    """What trainer_state.json holds: the TrainState's counters and the stability state."""

    def __init__(self, state: TrainState, stability: Stability, checkpoint_dir: Path) -> None:
        self.state = state
        self.stability = stability
        self.checkpoint_dir = checkpoint_dir

    def state_dict(self) -> dict:
        return self.state.state_dict() | {"stability": self.stability.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
        where = f"the checkpoint of step {self.state.step}"
        self.stability.load_state_dict(state.get("stability"), where, self.state.consumed_samples)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.started = time.perf_counter()
        # Trapped from the start, so a stop signal during set-up still stops cleanly at the first step boundary.
        self.stop = StopRequest()
        info = {"run_dir": str(cfg.run_dir.absolute()), "checkpoint_dir": str(cfg.checkpoint_dir.absolute())}
        info["watch"] = asdict(cfg.watch)
        rank = int(os.environ.get("RANK", "0"))
        self.heartbeat = Heartbeat.from_env(rank, info, cfg.watch.enabled)
        # A fault drill (NANOTRON_FAULT: tests, game days) wraps the step's pieces from outside; else they are as is.
        drill = Drill.from_env(rank)
        self.beat = drill.phases(self.heartbeat.beat)
        self.ctx: ParallelContext = init_distributed(cfg)
        self.cfg = cfg = agree_on_regather(cfg, self.ctx.device)  # 'auto' was resolved by each rank on its own
        set_matmul_precision(cfg, self.ctx.device)
        self.host_memory = keep_freed_host_memory(self.ctx.device)  # said on the run's opening line
        if cfg.training.preflight:  # bad nodes stop the job before anything is built
            preflight(cfg, self.ctx)
        self.corpus = open_corpus(cfg)
        # Known before the model exists: a start that loads weights skips the random init (the load overwrites it).
        self.source = resolve_source(cfg.checkpoint_dir, cfg.checkpoint)
        if self.source is not None and not self.source[1]:  # a resume: refuse what it cannot honour, list the rest
            note = check_resume(cfg, self.source[0])
            if note and self.ctx.rank == 0:
                say(note)
        if cfg.training.float8 != "off" and self.ctx.rank == 0:
            say(describe_float8(cfg, self.ctx.device))
        started = time.perf_counter()
        self.stages = build_model(cfg, self.ctx, initialize=self.source is None)
        self.build_seconds = time.perf_counter() - started
        self.modules = [module for _, module in self.stages]
        self.params = [param for module in self.modules for param in module.parameters()]
        self.runner = MicrobatchRunner(self.stages, cfg, self.ctx, on_phase=self.beat, eos_id=self.corpus.eos_id)
        self.run_microbatches = drill.losses(self.runner.forward_backward)
        self.stragglers = StragglerScores(
            cfg.watch, self.ctx.rank, self.ctx.world_size, self.ctx.device, stage=self.ctx.pp_rank
        )
        self.agree = drill.collective(self.ctx.agree)  # the step's collective (`ParallelContext.agree`)
        # One optimizer per stage module keeps optimizer-state keys equal to parameter FQNs (DCP resharding).
        muon = cfg.optimizer.name == "muon"
        stage_group = submesh(self.ctx.mesh, "stage").get_group() if muon else None
        self.optimizers = [
            build_optimizer(module, cfg.optimizer, self.ctx.device, cfg.model, stage_group) for module in self.modules
        ]
        if muon and self.ctx.rank == 0:
            say(describe_muon(self.optimizers[0], self.modules[0]))
        self.state = TrainState()
        self.stability = Stability(cfg)
        self.is_logging_rank = self.runner.is_logging_rank
        wandb = WandbRun.start(cfg) if self.is_logging_rank and cfg.logging.wandb else None
        self.metrics = MetricsLogger(cfg.run_dir, self.is_logging_rank, cfg.logging.tensorboard, wandb)
        self.activation_stats = ActivationStats(
            cfg, self.modules, self.ctx.tp_rank, self.ctx.device, self.runner.sequence_sharded
        )
        self.experts = ExpertBalance(cfg, self.modules, self.ctx)
        self.evaluator = Evaluator(cfg, self.corpus, self.ctx, self.runner, on_phase=self.beat)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint_dir,
            cfg.checkpoint,
            states={"model": ModelState(self.modules), "optimizer": OptimizerState(self.modules, self.optimizers)},
            progress=Progress(self.state, self.stability, cfg.checkpoint_dir),
            write_extras=partial(write_checkpoint_extras, cfg),  # a function of the config, not of the trainer
            meta={
                "global_batch_size": cfg.training.global_batch_size,
                "world_size": self.ctx.world_size,
                "layout": layout_sizes(cfg),
            },
            log=say,  # called on rank 0, the committing rank, at any pp
            device=self.ctx.device,
            on_phase=self.beat,
            progress_schema=TRAINER_STATE,
        )

    # ---- one step -------------------------------------------------------------------------------

    def next_batch(self) -> torch.Tensor:
        """grad_accum_steps microbatches stacked: [grad_accum_steps * micro_batch_size, seq_len + 1]."""
        return torch.cat([next(self.loader_iter) for _ in range(self.cfg.training.grad_accum_steps)])

    def train_step(self) -> tuple[torch.Tensor | None, torch.Tensor, bool, str]:
        """One optimizer step; returns (loss, grad norm) as device tensors, whether a stop was agreed and what
        became of the update: "apply", "skip" or "rollback".

        The step's one host sync: a tiny all-reduce telling every rank whether any rank was asked to stop and
        whether the loss or the gradient norm is non-finite anywhere, and summing the global loss and gradient norm
        the spike detector scores. A non-finite step is not applied; a finite one is the stability policy's.
        """
        t = self.cfg.training
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
            set_lr(optimizer, lr_at(self.state.step, self.cfg.optimizer, t.steps))
        self.beat("data", self.state.step + 1)
        self.batch = self.next_batch()
        loss, grad_norm = self.forward_backward()
        bad_loss = False if loss is None else ~torch.isfinite(loss)
        flags, values = self.agree(
            [self.stop.requested, bad_loss | ~torch.isfinite(grad_norm)], self.runner.step_shares(loss, grad_norm)
        )
        stop, non_finite = flags
        if non_finite:
            self.skip_step(loss, grad_norm)
            outcome = "skip"
        else:
            outcome = self.settle(Observation(self.state.step + 1, *values), loss, grad_norm)
        if outcome == "apply":
            self.checkpoints.wait_for_staging()  # an async save's copy of the weights is complete
            for optimizer in self.optimizers:
                optimizer.step()
            self.weights_changed()
        return loss, grad_norm, stop, outcome

    def forward_backward(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's gradients from `self.batch`, clipped; (this rank's loss, the global gradient norm)."""
        loss = self.run_microbatches(self.batch)
        self.beat("optimizer")
        return loss, clip_grad_norm(self.params, self.cfg.training.clip_grad, self.runner.pp_group)

    def settle(self, seen: Observation, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> str:
        """The stability policy's decision on a finite step (`Stability.decide`), carried out with the trainer's
        parts: the replay and the checkpoint list it asks for, then a rollback, or the log and a stop. Returns what
        became of the update."""
        decision = self.stability.decide(seen)
        if decision.action == "replay":
            seen = replace(seen, replay=self.replay(loss, grad_norm))
            decision = self.stability.decide(seen)
        if decision.action == "checkpoints":
            self.checkpoints.wait()  # an async save in flight commits first: it may be the one to go back to
            decision = self.stability.decide(replace(seen, checkpoints=committed_steps(self.cfg.checkpoint_dir)))
        if decision.action == "rollback":
            return self.roll_back(decision)
        if decision.event is not None:
            self.metrics.log(decision.event, decision.line)
        if decision.error is not None:
            self.halt(decision.error)
        return decision.action

    def replay(self, first_loss: torch.Tensor | None, first_norm: torch.Tensor) -> Replay:
        """The step recomputed from the same state and batch, and every rank's own values of both passes: a step
        and an all-gather of 4 numbers per rank, on spiking steps only."""
        clip = self.cfg.training.clip_grad
        first = rank_values(first_loss, first_norm, self.params, clip)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.experts.reset()
        self.activation_stats.restart()
        self.beat("data", self.state.step + 1)
        loss, grad_norm = self.forward_backward()
        _, (global_loss, global_norm) = self.ctx.agree([], self.runner.step_shares(loss, grad_norm))
        rows = self.ctx.gather(first + rank_values(loss, grad_norm, self.params, clip))
        return Replay(global_loss, global_norm, rows, self.stragglers.nodes)

    def roll_back(self, decision: Decision) -> str:
        """Loads the checkpoint the stability policy chose and goes on from there in this process, past the window
        of samples that led to the spike."""
        first_sample = self.state.consumed_samples
        self.beat("checkpoint", self.state.step + 1)
        self.checkpoints.load(decision.target)
        self.weights_changed()
        event, line = self.stability.rolled_back(decision, first_sample, self.state.step, self.state.consumed_samples)
        if self.ctx.rank == 0:
            write_run_skips(self.cfg.run_dir, self.stability.skips)
        self.metrics.log(event, line)
        self.experts.reset()
        self.loader_iter = self.data_iterator()
        return "rollback"

    def weights_changed(self) -> None:
        """Float8 scales FSDP gathers weights with are computed once per change of the weights (one all-reduce)."""
        if self.cfg.training.float8 != "off":
            precompute_float8_scales(self.modules)

    def halt(self, error: UserError) -> NoReturn:
        """Stops the run as a service decided (every rank alike): a node fault names its nodes for the requeue."""
        if isinstance(error, NodeFaultError) and error.nodes and self.ctx.rank == 0:
            write_suspects(self.cfg.run_dir, error.nodes)
        raise error

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

    # ---- the loop -------------------------------------------------------------------------------

    def resume(self) -> None:
        if self.source is None:
            self.metrics.info(f"model: built and randomly initialised in {self.build_seconds:.2f}s")
            return
        path, model_only = self.source
        self.checkpoints.load(path, model_only, fresh=("optimizer",) if self.cfg.checkpoint.reset_optimizer else ())
        self.weights_changed()
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
            dp=self.ctx.dp,
            dp_rank=self.ctx.dp_rank,
            start_sample=self.state.consumed_samples,
            skips=self.stability.skips,
        )
        return loader_batches(loader)

    def train(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.resume()
        self.first_step = self.state.step
        if self.first_step >= t.steps:  # a finished run started again: say so, touch nothing
            self.metrics.info(
                f"run already complete at step {self.first_step} (training.steps={t.steps}): nothing to train; raise "
                f"training.steps to train on from {cfg.checkpoint_dir}, or start a new run with another job.name"
            )
            return
        if self.ctx.rank == 0:
            write_atomic(cfg.run_dir / "config.toml", to_toml(cfg), durable=False)
        self.loader_iter = self.data_iterator()
        opening = run_line(cfg, self.corpus, self.ctx.world_size, self.ctx.device, self.state.step)
        self.metrics.info(opening + (f" | {self.host_memory}" if self.host_memory else ""))
        if self.state.step == 0 and cfg.checkpoint.save_initial_state:
            self.checkpoints.save(0)
        self.carry_out(self.evaluator.start(self.state.step))
        peak = cfg.logging.peak_tflops or (
            detect_peak_tflops(self.ctx.device, t.dtype, t.tf32) if self.is_logging_rank else 0.0
        )
        self.timer = StepTimer(self.state.step, t.steps)
        stop = False
        profiler = Profiler.start(
            cfg.profiler, self.ctx.device, f"rank{self.ctx.rank}", self.ctx.rank == 0 or self.is_logging_rank
        )
        while self.state.step < t.steps and not stop:
            with self.activation_stats.step(self.state.step + 1), self.stragglers.step():
                loss, grad_norm, stop, outcome = self.train_step()
            self.ctx.end_startup()  # the first step is done: collectives get distributed.timeout_minutes
            profiler.step()
            if outcome == "rollback":  # the state is the older checkpoint's: the loop goes on from there
                self.activation_stats.discard()
                self.timer = StepTimer(self.state.step, t.steps)
                continue
            info = self.keep(applied=outcome == "apply", stopping=stop)
            self.end_step(info, self.activation_stats, self.experts, self.stragglers)
            if info.logging:
                self.log_step(loss, grad_norm, peak)
            self.end_step(info, self.evaluator, self.checkpoints)
        profiler.stop()
        if stop or cfg.checkpoint.save_final:
            self.checkpoints.save(self.state.step, final=True)
        self.checkpoints.wait()
        if stop:
            self.metrics.info(
                f"preempted: stopped at step {self.state.step} after a stop signal; checkpoint saved "
                f"in {cfg.checkpoint_dir}; rerun the same command to resume"
            )
        self.summarize()

    def summarize(self) -> None:
        """The run's last line: steps and tokens this run, wall time, last scores, the checkpoint and the report."""
        t = self.cfg.training
        latest = latest_checkpoint(self.cfg.checkpoint_dir)
        steps = self.state.step - self.first_step
        where = [f"checkpoint {latest}" if latest else "no checkpoint", f"report: nanotron report {self.cfg.run_dir}"]
        seconds = time.perf_counter() - self.started
        self.metrics.summary(self.first_step, steps, steps * t.global_batch_size * t.seq_len, seconds, where)

    def keep(self, applied: bool, stopping: bool) -> StepInfo:
        """The step counts: the progress that checkpoints carry moves on."""
        t = self.cfg.training
        self.state.step += 1
        self.state.consumed_samples += t.global_batch_size
        self.state.consumed_tokens += t.global_batch_size * t.seq_len
        last = self.state.step == t.steps
        first = self.state.step == self.first_step + 1  # this process's first step: the run is seen to train
        logging = self.state.step % self.cfg.logging.log_interval == 0 or last or first
        return StepInfo(self.state.step, applied, logging, last, stopping)

    def end_step(self, info: StepInfo, *services: StepEnd) -> None:
        """The services' ends of a kept step, in the order given: the same on every rank, so collectives line up."""
        for service in services:
            self.carry_out(service.step_end(info))

    def carry_out(self, report: StepReport | None) -> None:
        """A service's report: its records and lines logged, then its stop."""
        if report is None:
            return
        for record, line in report.entries:
            if record is None:
                self.metrics.info(line)
            else:
                self.metrics.log(record, line)
        if report.stop is not None:
            self.halt(report.stop)

    def log_step(self, loss: torch.Tensor | None, grad_norm: torch.Tensor, peak: float) -> None:
        """The step's record and line: loss (dp x cp mean), rate, gradient norm, spike scores, throughput, memory."""
        t = self.cfg.training
        step_time, eta = self.timer.lap(self.state.step)
        loss_value = self.runner.mean_loss(loss)
        # MTP's and the z-loss's means, in the order every rank holds them (a collective each)
        extra = {name: self.runner.mean_loss(value) for name, value in self.runner.extra_losses.items()}
        memory = memory_record(self.ctx.device)  # a collective: every rank
        if self.is_logging_rank:
            group = self.optimizers[0].param_groups[0]  # the rate the step used, not a recomputation
            lr = group["lr"] / group.get("lr_scale", 1.0)
            record = step_record(self.state, loss_value, lr, grad_norm.item(), step_time, eta)
            record |= extra
            record |= {f"stability/{rule}": score for rule, score in self.stability.last_scores.items()}
            tokens = t.global_batch_size * t.seq_len
            flops = flops_per_token(self.cfg.model, t.seq_len) * tokens
            record |= throughput(tokens, flops, step_time, self.ctx.world_size, peak)
            self.metrics.log_step(record | memory, t.steps)

    def close(self) -> None:
        self.heartbeat.close()
        self.checkpoints.close()
        self.metrics.close()
        self.stop.close()


def write_checkpoint_extras(cfg: Config, step_dir: Path) -> None:
    """What makes a step dir usable on its own: the resolved config and the tokenizer."""
    (step_dir / "config.toml").write_text(to_toml(cfg))
    copy_tokenizer(Path(cfg.data.tokenizer), step_dir / "tokenizer")


def _host(value: torch.Tensor | None) -> float | None:
    return None if value is None else value.item()
