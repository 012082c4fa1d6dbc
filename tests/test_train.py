"""The training loop: loss falls, metrics and TensorBoard are written, runs are deterministic, LR shapes."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    CONSOLE_TIME,
    REPO,
    TINY_MODEL,
    console_message,
    read_metrics,
    run_train,
    shapes_of,
    train_env,
    train_losses,
)

from nanotron.checkpoint.layout import committed_steps, latest_checkpoint
from nanotron.checkpoint.safe_io import read_model_weights
from nanotron.config import OptimizerConfig
from nanotron.optim import lr_at
from nanotron.parallel.runner import IGNORE_INDEX, log_partition_squared, training_loss


@pytest.mark.slow
def test_tiny_run_learns_and_writes_metrics_tensorboard_and_config(tiny_data, tmp_path):
    run_train(
        [
            *TINY_MODEL,
            *tiny_data.overrides(),
            f"--job.out_dir={tmp_path}",
            "--job.name=learn",
            "--training.steps=40",
            "--training.eval_interval=20",
            "--training.eval_steps=2",
            "--logging.log_interval=10",
            "--logging.tensorboard=true",
        ]
    )
    run_dir = tmp_path / "learn"
    records = read_metrics(run_dir)
    evals = [r for r in records if "eval_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[0]["eval_loss"] == pytest.approx(math.log(512), rel=0.05)  # untrained: uniform over the vocab
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.5
    assert [r["step"] for r in steps] == [1, 10, 20, 30, 40]  # the first step always: the run is seen to train
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu", "memory_gib", "step_time_sec"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert all(r["tokens_per_sec"] > 0 and r["mfu"] > 0 for r in steps)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "[parallelism]" in (run_dir / "config.toml").read_text()


@pytest.mark.slow
def test_the_log_says_when_each_line_happened_each_save_and_the_runs_end_and_a_rerun_is_complete(tiny_data, tmp_path):
    """Log lines people operate on (issue 41 item 4): every console line timestamped; step 1 logged whatever the
    interval, with step time, tokens/s global and per device, tokens consumed; a line when a save starts and when it
    is committed (duration, size); a summary at the end; a finished run started again says so and trains nothing."""
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=log", "--training.steps=6"]
    args += ["--logging.log_interval=5", "--checkpoint.interval=3", "--training.eval_interval=6"]
    out = run_train(args).stdout.strip().splitlines()
    assert out and all(CONSOLE_TIME.match(line) for line in out), [line for line in out if not CONSOLE_TIME.match(line)]
    messages = [console_message(line) for line in out]
    steps = [m for m in messages if m.startswith("step ")]
    assert [m.split("/")[0] for m in steps] == ["step 1", "step 5", "step 6"]
    assert re.search(r"\| [\d.]+s/step \| tokens/s [\d,]+ \([\d,]+/device\) \|.* \| tokens 768 \| eta", steps[-1])
    checkpoints = tmp_path / "log" / "checkpoints"
    saves = [m for m in messages if m.startswith("checkpoint: sav")]
    assert saves[0] == f"checkpoint: saving step 3 to {checkpoints / 'step-3'}"
    assert re.fullmatch(rf"checkpoint: saved {checkpoints / 'step-3'} in [\d.]+s \([\d.]+ GiB\)", saves[1]), saves
    assert len(saves) == 4  # steps 3 and 6
    assert re.fullmatch(
        rf"run done: steps 1-6 \(6 this run\) \| 768 tokens in 0m\d\ds \| last loss [\d.]+ \| eval_loss [\d.]+ "
        rf"\(best [\d.]+ at step \d\) \| checkpoint {checkpoints / 'step-6'} \| "
        rf"report: nanotron report {tmp_path / 'log'}",
        messages[-1],
    ), messages[-1]
    assert all(isinstance(r["time"], float) for r in read_metrics(tmp_path / "log"))  # wall clock on every record
    again = [console_message(line) for line in run_train(args).stdout.strip().splitlines()]
    assert any(m.startswith("run already complete at step 6 (training.steps=6): nothing to train") for m in again)
    assert not [m for m in again if m.startswith(("step ", "checkpoint: sav"))]


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_other_losses(tiny_data, tmp_path):
    common = [
        *TINY_MODEL,
        *tiny_data.overrides(),
        f"--job.out_dir={tmp_path}",
        "--training.steps=3",
        "--checkpoint.save_final=false",
    ]
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_train([*common, f"--job.name={name}", f"--job.seed={seed}"])
    a, b, c = (train_losses(tmp_path / n) for n in "abc")
    assert a == b
    assert a != c


@pytest.mark.slow
def test_bf16_computes_the_same_at_dp1_and_dp2_and_differs_from_fp32(tiny_data, tmp_path):
    """bf16 is one mechanism at every layout (FSDP's mixed precision): dp=1 and dp=2 agree to fp32 noise,
    while both measurably differ from fp32, so a bf16 run that silently computed in fp32 fails."""
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=6"]
    common.append("--checkpoint.save_final=false")
    run_train([*common, "--job.name=fp32"])
    run_train([*common, "--job.name=bf16-dp1", "--training.dtype=bfloat16"])
    dp2 = ["--job.name=bf16-dp2", "--training.dtype=bfloat16", "--parallelism.dp=2", "--parallelism.zero_stage=3"]
    run_train([*common, *dp2], nproc=2)
    fp32, dp1, dp2 = (torch.tensor(train_losses(tmp_path / n)) for n in ("fp32", "bf16-dp1", "bf16-dp2"))
    assert len(dp1) == len(dp2) == 6 and dp1[-1] < dp1[0]
    assert torch.allclose(dp2, dp1, rtol=1e-5, atol=0), (dp1, dp2)
    # Measured: bf16 vs fp32 up to 1.9e-4 relative over these steps; fp32 layouts agree to ~1e-7.
    assert ((dp1 - fp32).abs() / fp32).max() > 2e-5, (dp1, fp32)


@pytest.mark.slow
def test_a_diverging_run_skips_then_stops_with_exit_3_and_keeps_only_finite_checkpoints(tiny_data, tmp_path):
    """lr=1e3 gives non-finite gradients within a few steps (which ones depend on the kernels: MKL's AVX2 and
    AVX-512 sums differ): the first such step is not applied, max_skipped_steps=1 lets it pass, the next such
    step (the one after it, or later) stops the run before a save, and every committed checkpoint is finite,
    the newest of them kept."""
    proc = run_train(
        [
            *TINY_MODEL,
            *tiny_data.overrides(),
            f"--job.out_dir={tmp_path}",
            "--job.name=diverge",
            "--training.steps=10",
            "--optimizer.lr=1e3",
            "--optimizer.min_lr=1e3",
            "--optimizer.warmup_steps=0",
            "--training.max_skipped_steps=1",
            "--checkpoint.interval=1",
            "--checkpoint.keep_last=2",
        ],
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    skipped = re.search(r"warning: non-finite loss or gradients at step (\d+): .*; step skipped", proc.stdout)
    assert skipped, proc.stdout[-3000:]
    bad = int(skipped.group(1))
    assert 2 <= bad < 9, proc.stdout  # some steps trained, and the run did not reach its end
    assert len(re.findall(r"warning: non-finite loss or gradients", proc.stdout)) == 1, proc.stdout[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, errors
    stopped = re.match(r"error: non-finite loss or gradients at step (\d+): .*\(1 earlier steps skipped; ", errors[0])
    assert stopped and bad < int(stopped.group(1)) <= 10, errors
    stop = int(stopped.group(1))
    folder = tmp_path / "diverge" / "checkpoints"
    # The skipped step changed no weight, so its interval save is still a good checkpoint; the failing one has none.
    assert [p.name for p in committed_steps(folder)] == [f"step-{stop - 2}", f"step-{stop - 1}"]
    assert latest_checkpoint(folder) == folder / f"step-{stop - 1}"
    for step_dir in committed_steps(folder):
        assert all(torch.isfinite(t).all() for t in read_model_weights(step_dir, shapes_of(step_dir)).values()), (
            step_dir
        )


@pytest.mark.parametrize("style, end", [("cosine", 0.1), ("linear", 0.1), ("1-sqrt", 0.1), ("constant", 1.0)])
def test_lr_warms_up_linearly_then_decays_to_min_lr(style, end):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style)
    assert [lr_at(s, cfg, 110) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(110, cfg, 110) == pytest.approx(end)
    mid = lr_at(60, cfg, 110)
    expected = {"cosine": 0.55, "linear": 0.55, "1-sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5)), "constant": 1.0}
    assert mid == pytest.approx(expected[style])


@pytest.mark.parametrize("style", ["linear", "1-sqrt", "cosine"])
def test_a_warmup_stable_decay_schedule_holds_lr_until_decay_start_then_decays_over_decay_steps(style):
    """WSD (optimizer.decay_start): warmup as before, lr until decay_start, then the decay over decay_steps (0: until
    training.steps) to min_lr, held there. decay_start = 0 is the schedule without a stable phase, exactly."""
    shape = {
        "linear": lambda f: 1 - f,
        "1-sqrt": lambda f: 1 - math.sqrt(f),
        "cosine": lambda f: (1 + math.cos(math.pi * f)) / 2,
    }
    wsd = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style, decay_start=80)
    assert [lr_at(s, wsd, 100) for s in (0, 9, 10, 50, 79, 80)] == pytest.approx([0.1, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert [lr_at(s, wsd, 100) for s in (85, 90, 100, 120)] == pytest.approx(
        [0.1 + 0.9 * shape[style](f) for f in (0.25, 0.5, 1.0, 1.0)]
    )
    fixed = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style, decay_start=80, decay_steps=10)
    assert [lr_at(s, fixed, 100) for s in (79, 85, 90, 99)] == pytest.approx(
        [1.0, 0.1 + 0.9 * shape[style](0.5), 0.1, 0.1]
    )
    plain = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style)
    at_warmup_end = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style=style, decay_start=10)
    assert [lr_at(s, plain, 100) for s in range(101)] == [lr_at(s, at_warmup_end, 100) for s in range(101)]


def test_clipping_scales_every_gradient_a_tp_partial_sum_and_a_shard_included():
    """Every gradient is clipped, whatever its placement: a sequence-parallel norm's weight gradient is a Partial
    DTensor (each tp rank's share of the sum). torch 2.11's in-place foreach ops leave a Partial DTensor unchanged
    at world sizes above 1 (so its `clip_grads_with_norm_` skipped those gradients: tp2 sequence-parallel runs
    drifted 1e-4 from one process once the norm passed the limit); the fake group plays rank 0 of 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from nanotron.optim import clip_grad_norm
    from nanotron.parallel.torch_private import fake_process_group

    fake_process_group(rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        params = []
        for placement in (Partial(), Replicate(), Shard(0)):
            layout = [Shard(0)] if isinstance(placement, Shard) else [Replicate()]
            param = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, layout))
            param.grad = DTensor.from_local(torch.full((4,), 3.0), mesh, [placement])
            params.append(param)
        plain = torch.nn.Parameter(torch.ones(4))
        plain.grad = torch.full((4,), 3.0)
        total = clip_grad_norm([*params, plain], max_norm=1.0, pp_group=None)
        coefficient = 1.0 / (total.item() + 1e-6)  # torch's rule: max_norm / (norm + 1e-6), at most 1
        for param in (*params, plain):
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            assert local.tolist() == pytest.approx([3.0 * coefficient] * 4, rel=1e-6), param.grad
    finally:
        dist.destroy_process_group()


def test_clipping_makes_no_tensor_off_the_gradients_device():
    """The norm is summed on the gradients' device: a CPU tensor moved to a GPU is a blocking copy, a host sync
    every step (gpu_check's host-sync row runs under torch.cuda.set_sync_debug_mode("error")). Fake CUDA
    gradients (FakeTensorMode: no GPU needed, no kernel runs) stand in: every tensor the clipping makes is on CUDA."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanotron.optim import clip_grad_norm

    made: list[str] = []

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "cuda":
                    made.append(f"{func} on {tensor.device}")
            return out

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.ones(4, device="cuda")) for _ in range(2)]
        for param in params:
            param.grad = torch.full((4,), 3.0, device="cuda")
        with Devices():
            total = clip_grad_norm(params, max_norm=1.0, pp_group=None)
    assert total.device.type == "cuda" and made == []


@pytest.mark.slow
@pytest.mark.parametrize("scaled", [False, True])
def test_the_z_loss_is_the_mean_squared_log_normaliser_over_loss_tokens_with_its_exact_gradient(scaled):
    """log(Z)^2 averaged over the tokens that carry a loss (or summed times the document-masking scale), against
    float64 logsumexp in value and gradient; training adds weight x it and logs it apart from the loss."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen, dtype=torch.float64) * 3 + 5  # log Z far from 0
    targets = torch.randint(0, 11, (2, 6), generator=gen)
    targets[0, 2] = targets[1, 5] = IGNORE_INDEX
    scale = torch.tensor(0.3) if scaled else None
    got_x, want_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = log_partition_squared(got_x, targets, scale)
    kept = targets.flatten() != IGNORE_INDEX
    squares = torch.logsumexp(want_x.flatten(0, 1), dim=-1)[kept].square()
    want = squares.sum() * 0.3 if scaled else squares.mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    got.backward()
    want.backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-5, atol=1e-9)
    assert got_x.grad.view(-1, 11)[~kept].abs().max() == 0  # tokens without a loss get no gradient
    total, parts = training_loss(logits.float(), targets, scale, z_loss=1e-2)
    assert sorted(parts) == ["loss", "z_loss"]
    torch.testing.assert_close(total, parts["loss"] + 1e-2 * parts["z_loss"], rtol=1e-7, atol=0)
    torch.testing.assert_close(parts["z_loss"].double(), want.detach(), rtol=1e-6, atol=0)


def test_console_script_dispatches_to_train():
    exe = Path(sys.executable).parent / "nanotron"  # installed by `pip install -e .` next to this Python
    assert exe.is_file(), "the nanotron console script is missing: install the project with `pip install -e .`"
    proc = subprocess.run(
        [str(exe), "train", "--help"], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert "[training]" in proc.stdout and "global_batch_size = 0" in proc.stdout


# The tensor methods that make the host wait for a GPU: reading a value (or a truth value) back, or a copy to the CPU.
HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def host_syncs_per_step(monkeypatch, overrides: list[str]) -> dict[int, list[str]]:
    """Each step's calls (method and caller) of HOST_SYNCS in a one-process run of this process, counted on CPU
    (where they cost nothing) from the second step's start on: every such call would stop a GPU run's host."""
    import traceback

    from nanotron.config import load_config, parse_overrides
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    trainer = Trainer(load_config(*parse_overrides(overrides)))
    calls: dict[int, list[str]] = {}
    step = [0]  # the step whose train_step ran last: its end (services, log) counts with it
    train_step = trainer.train_step

    def numbered_step():
        step[0] = trainer.state.step + 1
        return train_step()

    trainer.train_step = numbered_step
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, _original=original, _name=name, **kwargs):
            if step[0] >= 2:  # a GPU run's first step may sync freely (allocation, compilation)
                caller = traceback.extract_stack(limit=2)[0]
                calls.setdefault(step[0], []).append(f"{_name} {Path(caller.filename).name}:{caller.lineno}")
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        trainer.train()
    finally:
        monkeypatch.undo()
        trainer.close()
        destroy_distributed()
    return calls


@pytest.mark.slow
def test_a_training_step_syncs_the_host_once_the_step_agreement(monkeypatch, tiny_data, tmp_path):
    """Issue 47: a step's one host sync is the step agreement (`ParallelContext.agree`: stop, non-finite, loss and
    gradient norm); a logged step adds the loss and the gradient norm read for its record (every log_interval
    steps). Gradient accumulation (2 microbatches), evaluation and activation statistics off, no checkpoint."""
    overrides = [
        *TINY_MODEL,
        *tiny_data.overrides(),
        f"--job.out_dir={tmp_path}",
        "--training.steps=5",
        "--training.micro_batch_size=2",
        "--training.global_batch_size=4",
        "--logging.log_interval=4",
        "--checkpoint.save_final=false",
        "--training.device=cpu",
    ]
    calls = host_syncs_per_step(monkeypatch, overrides)
    assert {step: len(c) for step, c in calls.items()} == {2: 1, 3: 1, 4: 3, 5: 3}, calls  # 4: logged; 5: the last
    assert all(c[0].startswith("tolist mesh.py") for c in calls.values()), calls  # the agreement comes first
