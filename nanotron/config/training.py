"""The [training] section (steps, batch, sequence, dtype, device) and the [optimizer] it steps with."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.config.option import opt

# Float8 matmul kernels (torch._scaled_mm) take dimensions that are multiples of this (training.float8's rules).
FLOAT8_KERNEL_MULTIPLE = 16


@dataclass
class TrainingConfig:
    steps: int = opt(300, "optimizer steps", min=1)
    micro_batch_size: int = opt(8, "samples per microbatch per data-parallel rank", min=1)
    grad_accum_steps: int = opt(
        1, "microbatches per step per dp rank (= pipeline microbatches); 0 derives it from global_batch_size", min=0
    )
    global_batch_size: int = opt(
        0, "samples per optimizer step across all ranks; 0 = micro_batch_size * grad_accum_steps * dp", min=0
    )
    seq_len: int = opt(128, "tokens per sample", min=1)
    dtype: str = opt(
        "float32",
        "compute dtype (bfloat16: FSDP mixed precision, bf16 compute with fp32 master weights and reductions)",
        ("float32", "bfloat16"),
    )
    clip_grad: float = opt(1.0, "max global grad norm; 0 disables clipping", min=0.0)
    mtp_loss_weight: float = opt(
        0.3,
        "lambda of multi-token prediction (model.mtp_depth > 0): loss = main + lambda / mtp_depth x the sum of the "
        "MTP modules' losses (DeepSeek-V3 used 0.3, then 0.1); the MTP loss is logged as mtp_loss and is not part "
        "of the eval loss",
        min=0.0,
    )
    z_loss: float = opt(
        0.0,
        "z-loss weight (PaLM, OLMo; 1e-4 is usual): training adds z_loss x the mean over loss tokens of log(Z)^2, "
        "Z the softmax's normaliser, which keeps the output logits from drifting; logged as z_loss (before the "
        "weight), not part of the loss or the eval loss; 0 = off",
        min=0.0,
    )
    max_skipped_steps: int = opt(
        0, "steps with a non-finite loss or gradient skipped (not applied) before the run stops", min=0
    )
    eval_interval: int = opt(50, "steps between validation passes; 0 disables", min=0)
    eval_steps: int = opt(4, "global batches per validation pass", min=1)
    compile: bool = opt(False, "torch.compile each decoder layer")
    float8: str = opt(
        "off",
        "float8 matmuls for the decoder layers' linears (torchao): tensorwise or rowwise scaling; emulated, and "
        "said so, on devices without float8 matmuls; the embedding, head, MoE routers and experts stay as they are",
        ("off", "tensorwise", "rowwise", "mxfp8"),
    )
    tf32: bool = opt(True, "on CUDA, float32 matmuls on TF32 tensor cores (MFU vs the TF32 peak); false = full fp32")
    device: str = opt("auto", "auto (cuda if available), cuda or cpu", ("auto", "cuda", "cpu"))
    preflight: bool = opt(
        False,
        "run nanotron doctor's checks (compute, links, checkpoint disk, clocks) before step 1; bad nodes stop "
        "the job with exit code 75",
    )


@dataclass
class OptimizerConfig:
    name: str = opt(
        "adamw",
        "adamw, or muon: Nesterov momentum orthogonalised by Newton-Schulz for the decoder layers' hidden matrices "
        "(each expert's and each of gate/up's own), AdamW for the embedding, head, norms, routers and biases; "
        "the lr and weight_decay keys serve both (docs/configuration.md#muon)",
        ("adamw", "muon"),
    )
    lr: float = opt(3e-3, "peak learning rate", min=0.0)
    min_lr: float = opt(3e-4, "learning rate at the end of decay", min=0.0)
    warmup_steps: int = opt(20, "linear warmup steps", min=0)
    decay_style: str = opt("cosine", "decay after warmup", ("cosine", "linear", "1-sqrt", "constant"))
    decay_steps: int = opt(0, "steps of decay; 0 = until training.steps", min=0)
    decay_start: int = opt(
        0,
        "step the decay starts at; 0 = when warmup ends. Later, the LR holds at lr from warmup's end until then: "
        'warmup-stable-decay (WSD), e.g. decay_start = 0.9 x training.steps with decay_style = "linear" or '
        '"1-sqrt"',
        min=0,
    )
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms and embeddings)", min=0.0)
    weight_decay_mode: str = opt(
        "coupled",
        "µP: coupled (AdamW's lr x weight_decay with each matrix's µP LR, so wider matrices decay less per step) "
        "or independent (weight_decay x each matrix's width LR divisor, so lr x weight_decay does not shrink "
        "with width: microsoft/mup's MuAdam and CompleteP's reference code)",
        ("coupled", "independent"),
    )
    betas: list[float] = opt([0.9, 0.95], "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0)
    eps_mode: str = opt(
        "scaled",
        "µP: scaled (CompleteP's rule: eps / m for the embedding, head and final norm, eps / (m r^alpha) for "
        "each layer's parameters, following their gradients' scale) or fixed (eps everywhere)",
        ("scaled", "fixed"),
    )
    fused: bool = opt(True, "fused AdamW kernel where the device has one")
    muon_momentum: float = opt(0.95, "Muon: momentum of the gradient's running average", min=0.0, below=1.0)
    muon_nesterov: bool = opt(True, "Muon: orthogonalise the Nesterov look-ahead g + momentum x buffer")
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations per matrix and step", min=1)
    muon_ns_dtype: str = opt(
        "auto",
        "Muon: the Newton-Schulz iteration's dtype: auto (bfloat16 on CUDA, float32 elsewhere), float32 or bfloat16 "
        "(tensor cores, about half the orthogonalisation's time; the quintic is built to stay stable in bf16, but "
        "the layouts then agree only to bf16 rounding, not to 1e-5: docs/configuration.md#muon)",
        ("auto", "float32", "bfloat16"),
    )
    muon_coefficients: str = opt(
        "jordan",
        "Muon: the Newton-Schulz polynomial a X + b (X X^T) X + c (X X^T)^2 X: jordan (3.4445, -4.7750, 2.0315), "
        "Keller Jordan's quintic, or cubic (1.5, -0.5, 0), the classic iteration (slower, converges exactly)",
        ("jordan", "cubic"),
    )
    muon_update_rms: float = opt(
        0.2,
        "Muon: each orthogonalised update times update_rms x sqrt(max(rows, cols)) (Moonlight's rule), so its RMS "
        "is about AdamW's and AdamW's lr and weight_decay carry over",
        min=0.0,
    )
    muon_adamw_names: list[str] = opt(
        ["mlp.gate.weight"],
        "Muon: decoder-layer matrices left to AdamW, by a part of their name (default: the MoE routers); an entry "
        "that is part of no parameter's name is refused at start-up",
    )
