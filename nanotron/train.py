"""Trainer and entry point: `python -m nanotron.train --config configs/tiny.toml [--section.key=value ...]`.

Run it plainly for one process, under `torchrun` for many, or with `--nproc_per_node N` to have it
validate the config first and then start N local processes itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from nanotron import checkpoint
from nanotron.config import Config, help_text, load_config, parse_overrides, to_toml
from nanotron.data import Corpus, build_train_loader, eval_batches, load_corpus, load_tokenizer
from nanotron.distributed import ParallelContext, destroy_distributed, init_distributed, launched_world_size
from nanotron.errors import ConfigError, UserError
from nanotron.metrics import MetricsLogger, detect_peak_tflops, peak_memory_gib, step_line
from nanotron.models.llama import flops_per_token, num_params
from nanotron.optim import build_optimizer, build_scheduler, clip_grad_norm
from nanotron.parallel import async_tp_available, build_model, enable_async_tp
from nanotron.parallel.pipeline import build_schedule, num_stages


@dataclass
class TrainState:
    """Progress that travels with checkpoints besides model/optimizer/scheduler/data-loader state."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Trapped from the start, so a stop signal during set-up still stops cleanly at the first step boundary.
        self.stop_requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self.request_stop)
        self.ctx: ParallelContext = init_distributed(cfg)
        torch.manual_seed(cfg.job.seed)
        p, t = cfg.parallelism, cfg.training
        self.corpus = prepare_data(cfg)

        if p.tp_linear_async_communication:
            if async_tp_available(cfg, self.ctx.device):
                enable_async_tp(self.ctx)
            elif self.ctx.rank == 0:
                print(
                    "warning: parallelism.tp_linear_async_communication is unavailable here (async TP needs "
                    "CUDA, training.compile=true and tp > 1); using synchronous TP",
                    flush=True,
                )
        self.stages = build_model(cfg, self.ctx)
        self.modules = [module for _, module in self.stages]
        self.params = [param for module in self.modules for param in module.parameters()]
        stage_ids = [index for index, _ in self.stages]
        self.has_first, self.has_last = 0 in stage_ids, num_stages(p) - 1 in stage_ids
        self.schedule = (
            build_schedule(self.stages, p, self.ctx.mesh["pp"], self.ctx.device, t.grad_accum_steps, self.loss_fn)
            if p.pp > 1
            else None
        )
        # One optimizer per stage module keeps optimizer-state keys equal to parameter FQNs (DCP resharding).
        self.optimizers = [build_optimizer(module, cfg.optimizer, self.ctx.device) for module in self.modules]
        self.schedulers = [build_scheduler(opt, cfg.optimizer, t.steps) for opt in self.optimizers]
        self.state = TrainState()
        self.checkpointer = checkpoint.Checkpointer(cfg, self.ctx, self)

        self.is_logging_rank = self.has_last and self.ctx.dp_rank == 0 and self.ctx.tp_rank == 0
        self.metrics = MetricsLogger(cfg.run_dir, self.is_logging_rank, cfg.logging.tensorboard)
        self.compute_dtype = torch.bfloat16 if t.dtype == "bfloat16" else torch.float32
        self.peak_tflops = cfg.logging.peak_tflops or (
            detect_peak_tflops(self.ctx.device, self.compute_dtype) if self.is_logging_rank else 0.0
        )

    # ---- one step -------------------------------------------------------------------------------

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of one microbatch; microbatches and dp ranks average to the global-batch mean."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def compute_context(self) -> contextlib.ExitStack:
        """loss_parallel for vocab-sharded logits; autocast for bf16 unless FSDP/replicate already casts."""
        stack = contextlib.ExitStack()
        if self.cfg.parallelism.tp > 1:
            stack.enter_context(loss_parallel())
        if self.compute_dtype == torch.bfloat16 and self.cfg.parallelism.dp == 1:
            stack.enter_context(torch.autocast(self.ctx.device.type, dtype=torch.bfloat16))
        return stack

    def next_batch(self) -> torch.Tensor:
        """grad_accum_steps microbatches stacked: [grad_accum_steps * micro_batch_size, seq_len + 1]."""
        return torch.cat([next(self.loader_iter) for _ in range(self.cfg.training.grad_accum_steps)])

    def forward_backward(self, batch: torch.Tensor, train: bool = True) -> torch.Tensor | None:
        """Mean loss over this dp rank's part of the batch (None on ranks without the last stage)."""
        batch = batch.to(self.ctx.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        n_micro = self.cfg.training.grad_accum_steps
        with self.compute_context():
            if self.schedule is not None:
                losses: list[torch.Tensor] = []
                run = self.schedule.step if train else self.schedule.eval
                run(
                    *([inputs] if self.has_first else []),
                    target=targets if self.has_last else None,
                    losses=losses if self.has_last else None,
                )
                return torch.stack([_plain(loss).detach().float() for loss in losses]).mean() if self.has_last else None
            model, total = self.modules[0], torch.zeros((), device=self.ctx.device)
            # FSDP/replicate reduce gradients only after the last microbatch; earlier ones accumulate locally.
            grad_sync = getattr(model, "set_requires_gradient_sync", None) if train else None
            for index, (inp, tgt) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
                if grad_sync is not None:
                    grad_sync(index == n_micro - 1)
                if train:
                    loss = self.loss_fn(model(inp), tgt) / n_micro
                    loss.backward()
                else:
                    with torch.no_grad():
                        loss = self.loss_fn(model(inp), tgt) / n_micro
                total += _plain(loss).detach()
            return total

    def dp_mean(self, value: torch.Tensor | None) -> float | None:
        if value is None:
            return None
        if self.cfg.parallelism.dp > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG, group=self.ctx.mesh["dp"].get_group())
        return value.item()

    def train_step(self) -> tuple[float | None, float]:
        self.step_lr = self.schedulers[0].get_last_lr()[0]
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(self.next_batch())
        pp_group = self.ctx.mesh["pp"].get_group() if self.cfg.parallelism.pp > 1 else None
        grad_norm = clip_grad_norm(self.params, self.cfg.training.clip_grad, pp_group)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
        return self.dp_mean(loss), grad_norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        t, p = self.cfg.training, self.cfg.parallelism
        for module in self.modules:
            module.eval()
        microbatches = list(eval_batches(self.corpus, t, dp=p.dp, dp_rank=self.ctx.dp_rank))
        total, count = 0.0, 0
        for start in range(0, len(microbatches), t.grad_accum_steps):
            loss = self.forward_backward(torch.cat(microbatches[start : start + t.grad_accum_steps]), train=False)
            loss = self.dp_mean(loss)
            if loss is not None:
                total, count = total + loss, count + 1
        for module in self.modules:
            module.train()
        return total / count if count else None

    # ---- the loop -------------------------------------------------------------------------------

    def request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def agreed_to_stop(self) -> bool:
        """Every rank stops at the same step boundary, whichever ranks received the signal."""
        if not dist.is_initialized():
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def log_eval(self) -> None:
        eval_loss = self.evaluate()
        if eval_loss is not None:
            self.metrics.log(
                {"step": self.state.step, "eval_loss": eval_loss},
                f"eval step {self.state.step} | eval_loss {eval_loss:.4f} | eval_ppl "
                f"{math.exp(min(eval_loss, 50)):.1f}",
            )

    def train(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.checkpointer.resume()
        self.loader = build_train_loader(
            self.corpus,
            t,
            seed=cfg.job.seed,
            dp=cfg.parallelism.dp,
            dp_rank=self.ctx.dp_rank,
            start_step=self.state.step,
        )
        self.loader_iter = iter(self.loader)
        self.announce()
        if self.state.step == 0 and cfg.checkpoint.save_initial_state:
            self.checkpointer.save()
        if t.eval_interval and self.state.step == 0:
            self.log_eval()
        tokens_per_step = t.global_batch_size * t.seq_len
        flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
        window_start, window_steps, run_start, run_steps = time.perf_counter(), 0, time.perf_counter(), 0
        preempted = False
        profiler = self.start_profiler()
        while self.state.step < t.steps:
            loss, grad_norm = self.train_step()
            if profiler is not None:
                profiler.step()
            self.state.step += 1
            self.state.consumed_samples += t.global_batch_size
            self.state.consumed_tokens += tokens_per_step
            window_steps, run_steps = window_steps + 1, run_steps + 1
            if self.state.step % cfg.logging.log_interval == 0 or self.state.step == t.steps:
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps
                self.log_step(
                    loss,
                    grad_norm,
                    step_time,
                    tokens_per_step,
                    flops_per_step,
                    eta=(now - run_start) / run_steps * (t.steps - self.state.step),
                )
                window_start, window_steps = time.perf_counter(), 0
            if t.eval_interval and (self.state.step % t.eval_interval == 0 or self.state.step == t.steps):
                self.log_eval()
            if self.agreed_to_stop():
                preempted = True
                break
            if cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0:
                self.checkpointer.save()
        if profiler is not None:
            profiler.stop()
        if preempted or cfg.checkpoint.save_final:
            self.checkpointer.save(final=True)
        self.checkpointer.wait()
        if preempted:
            self.metrics.info(
                f"preempted: stopped at step {self.state.step} after a stop signal; checkpoint saved "
                f"in {cfg.checkpoint_dir}; rerun the same command to resume"
            )
        self.metrics.close()

    def start_profiler(self) -> torch.profiler.profile | None:
        """torch.profiler traces (TensorBoard/Chrome JSON) of a few steps, on rank 0 and the logging rank."""
        prof = self.cfg.profiler
        if not prof.export_path or not (self.ctx.rank == 0 or self.is_logging_rank):
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=prof.wait_steps, warmup=1, active=prof.active_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                prof.export_path, worker_name=f"rank{self.ctx.rank}"
            ),
            record_shapes=True,
            profile_memory=True,
        )
        profiler.start()
        return profiler

    def log_step(
        self,
        loss: float | None,
        grad_norm: float,
        step_time: float,
        tokens_per_step: int,
        flops_per_step: float,
        eta: float,
    ) -> None:
        if not self.is_logging_rank:
            return
        tflops = flops_per_step / step_time / self.ctx.world_size / 1e12
        record = {
            "step": self.state.step,
            "loss": loss,
            "lr": self.step_lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_step / step_time,
            "tokens_per_sec_per_device": tokens_per_step / step_time / self.ctx.world_size,
            "step_time_sec": step_time,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else 0.0,
            "memory_gib": peak_memory_gib(self.ctx.device),
            "consumed_samples": self.state.consumed_samples,
            "eta_sec": eta,
        }
        self.metrics.log(record, step_line(record, self.cfg.training.steps))

    def announce(self) -> None:
        cfg, p, t = self.cfg, self.cfg.parallelism, self.cfg.training
        if self.ctx.rank == 0:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
        self.metrics.info(
            f"nanotron | {num_params(cfg.model) / 1e6:.2f}M params | dp={p.dp} tp={p.tp} pp={p.pp} "
            f"({p.pp_engine}, tp_mode={p.tp_mode}, zero_stage={p.zero_stage}) on {self.ctx.world_size} x "
            f"{self.ctx.device.type} | global batch {t.global_batch_size} x {t.seq_len} tokens "
            f"(micro_batch_size={t.micro_batch_size}, grad_accum_steps={t.grad_accum_steps}) | "
            f"{self.corpus.num_train_samples} train / {self.corpus.num_val_samples} val samples | "
            f"run dir {cfg.run_dir} | start step {self.state.step}"
        )


def prepare_data(cfg: Config) -> Corpus:
    """Tokenizer and tokenized corpus (cached on disk, so a second call only maps the cache)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, {cfg.data.tokenizer}); raise model.vocab_size"
        )
    return load_corpus(cfg.data, tokenizer, seq_len=cfg.training.seq_len, seed=cfg.job.seed)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; logging wants the plain value."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def spawn_local(nproc: int, argv: list[str]) -> int:
    """Re-runs this module under torchrun with `nproc` processes on this machine."""
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    try:
        torchrun(["--standalone", f"--nproc_per_node={nproc}", "-m", "nanotron.train", *argv])
    except Exception:  # torchrun has already reported which rank failed and why
        return 1
    return 0


def _forward_to_workers(signum: int, frame: object) -> None:
    """torchrun would die of SIGUSR1 (it doesn't handle it) and its workers run in their own sessions:
    hand the signal to the workers, which checkpoint and exit 0, and so does torchrun."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if stat.read_text().rpartition(")")[2].split()[1] == me:
                os.kill(int(stat.parent.name), signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__ + "\nKeys (set in the TOML file or as --section.key=value):\n" + help_text())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        nproc = _pop_nproc(argv)
        path, overrides = parse_overrides(argv)
        cfg = load_config(path, overrides, world_size=nproc or launched_world_size())
        checkpoint.preflight(cfg)
        if nproc:
            prepare_data(cfg)  # data errors surface here as one line, and the ranks find the cache ready
            return spawn_local(nproc, argv)
        Trainer(cfg).train()
    except UserError as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    finally:
        destroy_distributed()
    return 0


def _pop_nproc(argv: list[str]) -> int:
    """Removes `--nproc_per_node N` (or `=N`) from argv and returns N (0 when absent)."""
    for i, arg in enumerate(argv):
        if arg == "--nproc_per_node" or arg.startswith("--nproc_per_node="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in arg else 2)]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--nproc_per_node: expected a positive integer, got {value!r}")
            return int(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
