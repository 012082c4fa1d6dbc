"""The original nanotron's YAML config as this project's TOML: `nanotron config from-nanotron OLD.yaml`.

Read from huggingface/nanotron at commit 2411b022a75fb7f7561a1bb4166706da5e1b76de: the schema and its defaults in
src/nanotron/config/{config,models_config,parallelism_config,utils_config}.py, what the keys do in helpers.py (LR
schedule, vocab padding), parallel/context.py, scaling/parametrization.py, nn/moe.py, data/processing.py and
data/nanoset.py, and examples/config_tiny_llama.{py,yaml}, config_qwen.yaml, config_nanoset.yaml. Each key is mapped
in this project's units (the global batch is micro_batch_size x batch_accumulation_per_replica x dp), or changes
nothing here (`KNOWN`), or is named in a note; an absent key gets the original's default, not this project's. The
result is loaded as training would load it: what this project refuses is one error naming the original's keys.
"""

from __future__ import annotations

import re
from pathlib import Path

from nanotron.config.conversion import ANY, Conversion, Source, read_yaml, show
from nanotron.config.from_nanotron_data import data_stages, tokenizer
from nanotron.config.model import ModelConfig
from nanotron.errors import ConfigError

COMMIT = "2411b022a75fb7f7561a1bb4166706da5e1b76de"
EXPECTED = "a mapping of the original nanotron's sections (general, parallelism, model, tokens, optimizer, ...)"
MODEL = "model.model_config"
SCHEDULE = "optimizer.learning_rate_scheduler"
MODEL_KEYS = {  # model_config key -> (this project's [model] key, type, the original's default)
    "hidden_size": ("hidden_size", int, 4096),
    "intermediate_size": ("intermediate_size", int, 11008),
    "num_hidden_layers": ("num_layers", int, 32),
    "num_attention_heads": ("num_heads", int, 32),
    "max_position_embeddings": ("max_seq_len", int, 2048),
    "rms_norm_eps": ("rms_norm_eps", float, 1e-6),
    "rope_theta": ("rope_theta", float, 10000.0),
    "tie_word_embeddings": ("tie_word_embeddings", bool, False),
}
DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "bfloat16"}
DECODERS = ("is_llama_config", "is_qwen2_config")  # the original's model families this project's decoder covers
_ORIGINAL_CHECKPOINT = "a checkpoint of the original framework, which this project does not read; export it to HF"
_NO_EFFECT = (ANY, "")


def _no_effect(prefix: str, names: str) -> dict[str, tuple[None, str]]:
    return {f"{prefix}.{name}": _NO_EFFECT for name in names.split()}


_DATASET_KEYS = {  # of a data stage's dataset (hub or Nanoset)
    "dataset_max_tokens": ((), "a token budget per dataset"),
    "sft_dataloader": ((False,), "fine-tuning data here is plain text, no prompt masking"),
    "debug_max_samples": ((), "every sample of a dataset is used here"),
    **dict.fromkeys(
        "hf_dataset_splits dataset_processing_num_proc_per_process dataset_overwrite_cache dataset_read_path "
        "tokenizer_name vocab_size token_size_in_bytes return_positions skip_in_stream "
        "pad_samples_to_global_batch_size shuffle_files use_old_brrr_dataloader".split(),
        _NO_EFFECT,
    ),
}
# An original key no mapping reads (list indices left out) -> (its values that mean what this project does anyway,
# or ANY: no value changes a result here; why another value is not carried over).
KNOWN: dict[str, tuple[tuple | None, str]] = {
    "general.step": ((), "training state, not a setting: here it travels with the checkpoint"),
    "general.consumed_train_samples": ((), "training state, not a setting: here it travels with the checkpoint"),
    "general.benchmark_csv_path": ((), "throughput is written to <run dir>/metrics.jsonl here"),
    "model.init_method.scaling_method": (("num_layers",), "residual projections here start at std/sqrt(2 x layers)"),
    "model.init_method.use_mup": ((), "spectral µP; this project's µP (model.parametrization) has its own rules"),
    "model.init_method.path": ((), f"{_ORIGINAL_CHECKPOINT}, then `nanotron convert from-hf`"),
    f"{MODEL}.hidden_act": (("silu",), "the MLP here is SwiGLU (silu)"),
    f"{MODEL}.attention_bias": ((False,), "attention projections here have no bias"),
    f"{MODEL}.rope_interleaved": ((False,), "RoPE here rotates split halves (Hugging Face's rotate_half)"),
    f"{MODEL}.rope_scaling": ((), "RoPE here is not scaled"),
    f"{MODEL}.rope_seq_len_interpolation_factor": ((), "RoPE here is not interpolated"),
    f"{MODEL}.sliding_window_size": ((), "attention here sees the whole sequence (or document)"),
    f"{MODEL}.log_attn_probs": ((False,), "attention probabilities are not logged here"),
    f"{MODEL}.moe_config.enable_shared_expert": (
        (False,),
        "the original's shared expert has a sigmoid gate; this project's (model.moe.num_shared_experts) has none",
    ),
    "optimizer.accumulate_grad_in_fp32": ((True,), "gradients here accumulate in float32"),
    "optimizer.weight_decay_exclude_named_params": (([],), "weight decay here skips norms and embeddings only"),
    f"{SCHEDULE}.lr_warmup_style": (("linear",), "warmup here is linear"),
    "checkpoints.resume_checkpoint_path": ((), f"{_ORIGINAL_CHECKPOINT}, then `nanotron convert from-hf`"),
    "checkpoints.load_lr_scheduler": ((True,), "a resume here restores the schedule; checkpoint.init_from skips it"),
    "checkpoints.load_optimizer": ((True,), "a resume here restores the optimizer; checkpoint.init_from skips it"),
    "metrics_logging.log_level": ((0,), "logging.activation_stats_interval logs per-layer activations here"),
    "profiler.repeat": ((1,), "one profiling window here"),
    "profiler.with_stack": ((False,), "traces here carry no Python stacks"),
    "tokenizer.tokenizer_revision": ((), "tokenizers are read from local files here"),
    **{
        f"{data}.dataset.{key}": rule
        for data in ("data_stages.data", "data")  # `data`: the one data section before April 2024
        for key, rule in _DATASET_KEYS.items()
    },
    **_no_effect("general", "ignore_sanity_checks"),
    **_no_effect("parallelism", "tp_recompute_allgather"),
    **_no_effect("model", "ddp_bucket_cap_mb"),
    **_no_effect(
        MODEL,
        "bos_token_id eos_token_id pad_token_id initializer_range use_cache pretraining_tp is_llama_config "
        "is_qwen2_config _attn_implementation _fused_rotary_emb _fused_rms_norm _use_qkv_packed "
        "ring_attn_heads_k_stride moe_config.router_aux_loss_coef moe_config.shared_expert_intermediate_size "
        "moe_config.token_dispatcher_type",
    ),
    **_no_effect("tokens", "limit_test_batches"),
    **_no_effect("checkpoints", "checkpoints_path_is_shared_file_system"),
    **_no_effect("logging", "log_level log_level_replica"),
    **_no_effect("metrics_logging", "log_detail_interval"),
    **_no_effect("profiler", "record_shapes profile_memory export_chrome_trace"),
    **_no_effect("tokenizer", "tokenizer_max_length"),
}


def convert(path: Path) -> tuple[str, list[str]]:
    """The TOML this project trains from (checked by loading it) and the notes, in the order of the file's keys."""
    c = Conversion(Source(read_yaml(Path(path), EXPECTED), str(path)))
    for section in (
        _general,
        _parallelism,
        _model,
        _tokens,
        _optimizer,
        _checkpoints,
        _outputs,
        tokenizer,
        data_stages,
        _positions,
    ):
        section(c)
    c.finish(KNOWN, f"not a key of the original's config at {COMMIT[:8]}, nor one known here")
    text = c.text(f"Converted by `nanotron config from-nanotron` from {path} (the original nanotron's YAML).")
    c.check(text)
    return text, [note for _, note in c.notes]


def _general(c: Conversion) -> None:
    c.copy("general.seed", "job.seed", int)
    project = c.copy("general.project", "logging.wandb_project", str)
    run = c.src.get("general.run", str)
    name = re.sub(r"[_-]{2,}", "_", (run or "").replace("%date", "").replace("%jobid", "")).strip("_-") or project
    if name:
        c.set("job.name", name, "general.run")
    if run and ("%date" in run or "%jobid" in run):
        c.note(
            "general.run",
            f"general.run={show(run)}: %date and %jobid left out: a run dir here is named by job.name alone, so a "
            "requeued job finds and resumes it",
        )


def _parallelism(c: Conversion) -> None:
    for key in ("dp", "tp", "pp"):
        c.set(f"parallelism.{key}", c.required(f"parallelism.{key}", int), f"parallelism.{key}")
    c.copy("parallelism.context_parallel_size", "parallelism.cp", int, 1)
    c.copy("parallelism.expert_parallel_size", "parallelism.ep", int, 1)
    c.set("parallelism.pp_engine", c.choice("parallelism.pp_engine", ("afab", "1f1b"), "afab"), "parallelism.pp_engine")
    mode = c.choice("parallelism.tp_mode", ("all_reduce", "reduce_scatter"), "all_reduce")
    c.set("parallelism.tp_mode", mode, "parallelism.tp_mode")
    c.copy("parallelism.tp_linear_async_communication", "parallelism.tp_linear_async_communication", bool, False)
    full = c.src.get("parallelism.recompute_layer", bool, False)
    c.set("parallelism.recompute", "full" if full else "none", "parallelism.recompute_layer")


def _model(c: Conversion) -> None:
    config = c.src.peek(MODEL)
    if config is None:
        raise ConfigError(f"{c.file}: {MODEL}: missing; it holds the model's shape")
    for name, value in config.items():
        if name.startswith("is_") and name.endswith("_config") and value is True and name not in DECODERS:
            raise ConfigError(
                f"{c.file}: {MODEL}.{name}: a {name[3:-7]} model; this project trains Llama-style decoders (the "
                "original's LlamaConfig or Qwen2Config)"
            )
    for name, (ours, kind, default) in MODEL_KEYS.items():
        c.copy(f"{MODEL}.{name}", f"model.{ours}", kind, default)
    c.copy(f"{MODEL}.num_key_value_heads", "model.num_kv_heads", int, c.tables["model"]["num_heads"])
    vocab = c.src.get(f"{MODEL}.vocab_size", int, 32000)
    divisible_by = c.src.get("model.make_vocab_size_divisible_by", int, 1)
    if divisible_by < 1:
        raise ConfigError(
            f"{c.file}: model.make_vocab_size_divisible_by: expected an integer >= 1, got {show(divisible_by)}; "
            "set 1 to keep the vocab size as it is"
        )
    # a tp below 1 is refused, naming parallelism.tp, when the result is loaded (`Conversion.check`)
    multiple = divisible_by * max(c.src.get("parallelism.tp", int, 1), 1)
    padded = -(-vocab // multiple) * multiple if vocab > 0 else vocab  # the original pads to tp x this multiple
    c.set("model.vocab_size", padded, f"{MODEL}.vocab_size", "model.make_vocab_size_divisible_by")
    mask = c.src.get(f"{MODEL}.flex_attention_mask", str)
    documents = c.src.get(f"{MODEL}._use_doc_masking", bool, False) or mask in ("document", "sliding_window_document")
    c.set("model.attention", "document" if documents else "causal", f"{MODEL}._use_doc_masking")
    c.copy("model.init_method.std", "model.init_std", float)
    dtype = c.choice("model.dtype", tuple(DTYPES), "bfloat16")
    c.set("training.dtype", DTYPES[dtype], "model.dtype")
    if dtype == "float16":
        c.note("model.dtype", 'model.dtype="float16" written as bfloat16: float16 training is not supported here')
    _nope_and_z_loss(c)
    _moe(c)


def _nope_and_z_loss(c: Conversion) -> None:
    """SmolLM3's NoPE layers (the original skips RoPE in layer i when (i + 1) % no_rope_layer == 0) and the z-loss."""
    every = c.src.get(f"{MODEL}.no_rope_layer", int)
    if every is not None:
        if every < 1:
            raise ConfigError(f"{c.file}: {MODEL}.no_rope_layer: expected an integer >= 1 (or null), got {every}")
        layers = c.tables["model"]["num_layers"]
        c.set("model.nope_layers", ModelConfig.every_nth(layers, every), f"{MODEL}.no_rope_layer")
    if not c.src.get(f"{MODEL}.z_loss_enabled", bool, False):
        c.src.get(f"{MODEL}.z_loss_coefficient", float)  # read: without z_loss_enabled it changes nothing
        return
    weight = c.src.get(f"{MODEL}.z_loss_coefficient", float, 1e-4)
    c.set("training.z_loss", weight, f"{MODEL}.z_loss_enabled", f"{MODEL}.z_loss_coefficient")
    c.note(
        f"{MODEL}.z_loss_enabled",
        f"{MODEL}.z_loss_coefficient={weight} carried as training.z_loss: the original squares log Z after "
        "subtracting each token's largest logit (log sum exp(logit - max)) and logs it inside the loss; here the "
        "z-loss squares log Z itself (PaLM's, OLMo's) and is logged apart as z_loss",
    )


def _positions(c: Conversion) -> None:
    """The original ignores max_position_embeddings below the sequence length it trains on; here it bounds RoPE."""
    seq_len = c.tables.get("training", {}).get("seq_len", 0)
    positions = c.tables["model"]["max_seq_len"]
    if seq_len > positions:
        c.set("model.max_seq_len", seq_len, f"{MODEL}.max_position_embeddings", "tokens.sequence_length")
        c.note(
            f"{MODEL}.max_position_embeddings",
            f"{MODEL}.max_position_embeddings={positions} written as {seq_len}, the sequence length: the original "
            "ignores it when it is shorter",
        )


def _moe(c: Conversion) -> None:
    """The original's MoE: softmax over all experts, then the top k, whose gates are not renormalised."""
    moe = f"{MODEL}.moe_config"
    if c.src.peek(moe) is None:
        return
    for name, default in (("num_experts", 8), ("top_k", 2), ("moe_intermediate_size", 1408)):
        c.copy(f"{moe}.{name}", f"model.moe.{name}", int, default)
    c.set("model.moe.router", "softmax_topk", moe)
    c.set("model.moe.renormalize", False, moe)
    layers = c.src.get(f"{moe}.layers", list, [-1])
    total = c.tables["model"]["num_layers"]
    if not layers or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers):
        raise ConfigError(f"{c.file}: {moe}.layers: expected a list of layer indices, got {show(layers)}")
    first = 0 if layers == [-1] else min(layers)
    if layers not in ([-1], list(range(first, total))):
        c.note(
            f"{moe}.layers",
            f"{moe}.layers={show(layers)} not carried over: MoE layers here are every layer from "
            f"model.moe.first_dense_layers = {first} on",
        )
    c.set("model.moe.first_dense_layers", first, f"{moe}.layers")


def _tokens(c: Conversion) -> None:
    if c.src.peek("tokens") is None:
        return
    c.copy("tokens.sequence_length", "training.seq_len", int)
    c.copy("tokens.train_steps", "training.steps", int)
    micro = c.required("tokens.micro_batch_size", int)
    accumulation = c.required("tokens.batch_accumulation_per_replica", int)
    c.set("training.micro_batch_size", micro, "tokens.micro_batch_size")
    batch = ("tokens.micro_batch_size", "tokens.batch_accumulation_per_replica", "parallelism.dp")
    c.set("training.global_batch_size", micro * accumulation * c.src.get("parallelism.dp", int, 1), *batch)
    c.set("training.grad_accum_steps", 0, "tokens.batch_accumulation_per_replica")  # derived from the global batch
    interval = c.src.get("tokens.val_check_interval", int, -1)
    batches = c.src.get("tokens.limit_val_batches", int, 0)  # microbatches per dp rank; here: global batches
    validation = ("tokens.val_check_interval", "tokens.limit_val_batches")
    c.set("training.eval_interval", interval if interval > 0 and batches > 0 else 0, *validation)
    if batches > 0:
        c.set("training.eval_steps", -(-batches // max(accumulation, 1)), "tokens.limit_val_batches")


def _optimizer(c: Conversion) -> None:
    if c.src.peek("optimizer") is None:
        return
    c.copy("optimizer.zero_stage", "parallelism.zero_stage", int, 0)
    c.copy("optimizer.weight_decay", "optimizer.weight_decay", float)
    c.set("training.clip_grad", c.src.get("optimizer.clip_grad", float, 0.0), "optimizer.clip_grad")  # null: none
    _schedule(c)
    # AdamW's keys sit in optimizer_factory since April 2024, in [optimizer] itself before
    factory = "optimizer.optimizer_factory" if c.src.peek("optimizer.optimizer_factory") else "optimizer"
    name = c.src.get(f"{factory}.name", str, "adamW")
    if name.lower() != "adamw":
        c.note(
            f"{factory}.name", f"{factory}.name={show(name)} not carried over: the optimizers here are AdamW and Muon"
        )
        return
    betas = [c.src.get(f"{factory}.adam_beta{i}", float) for i in (1, 2)]
    if None not in betas:
        c.set("optimizer.betas", betas, f"{factory}.adam_beta1", f"{factory}.adam_beta2")
    c.copy(f"{factory}.adam_eps", "optimizer.eps", float)
    c.copy(f"{factory}.torch_adam_is_fused", "optimizer.fused", bool)


def _schedule(c: Conversion) -> None:
    """The original's schedule: linear warmup, lr until lr_decay_starting_step (null: warmup's end), then decay over
    lr_decay_steps (null: to the last step, less the warmup when the decay starts later)."""
    if c.src.peek(SCHEDULE) is None:
        return
    lr = c.required(f"{SCHEDULE}.learning_rate", float)
    c.set("optimizer.lr", lr, f"{SCHEDULE}.learning_rate")
    warmup = c.copy(f"{SCHEDULE}.lr_warmup_steps", "optimizer.warmup_steps", int, 0)
    style = c.choice(f"{SCHEDULE}.lr_decay_style", ("linear", "cosine", "1-sqrt"), "linear")
    c.set("optimizer.decay_style", style, f"{SCHEDULE}.lr_decay_style")
    c.copy(f"{SCHEDULE}.min_decay_lr", "optimizer.min_lr", float, lr)
    steps = c.src.get(f"{SCHEDULE}.lr_decay_steps", int)
    c.set("optimizer.decay_steps", steps or 0, f"{SCHEDULE}.lr_decay_steps")
    if steps == 0:
        c.note(
            f"{SCHEDULE}.lr_decay_steps",
            f"{SCHEDULE}.lr_decay_steps=0 not carried over: 0 is no decay there (min_decay_lr from the decay's "
            "start, or learning_rate throughout when there is no warmup either), until training.steps here",
        )
    start = c.src.get(f"{SCHEDULE}.lr_decay_starting_step", int)
    if start is None or start == warmup:
        return
    if start < warmup:
        c.note(
            f"{SCHEDULE}.lr_decay_starting_step",
            f"{SCHEDULE}.lr_decay_starting_step={start} not carried over: it falls inside warmup; decay here starts "
            f"when warmup ends (step {warmup}) or later",
        )
        return
    c.set("optimizer.decay_start", start, f"{SCHEDULE}.lr_decay_starting_step")  # warmup-stable-decay
    total = c.src.get("tokens.train_steps", int)
    if steps is None and total is not None:
        # The original's decay with no lr_decay_steps lasts train_steps - lr_warmup_steps - lr_decay_starting_step
        # steps (then min_decay_lr): carried as that length, not this project's "until training.steps".
        length = max(total - warmup - start, 1)
        c.set("optimizer.decay_steps", length, f"{SCHEDULE}.lr_decay_steps", f"{SCHEDULE}.lr_decay_starting_step")
        c.note(
            f"{SCHEDULE}.lr_decay_steps",
            f"{SCHEDULE}.lr_decay_steps=null with lr_decay_starting_step={start}: the original decays over "
            f"train_steps - lr_warmup_steps - lr_decay_starting_step = {total - warmup - start} steps, then holds "
            f"min_decay_lr; carried as optimizer.decay_steps={length}",
        )


def _checkpoints(c: Conversion) -> None:
    if c.src.peek("checkpoints") is None:
        return
    c.copy("checkpoints.checkpoints_path", "checkpoint.dir", str)
    c.copy("checkpoints.checkpoint_interval", "checkpoint.interval", int)
    c.copy("checkpoints.save_initial_state", "checkpoint.save_initial_state", bool, False)
    c.copy("checkpoints.save_final_state", "checkpoint.save_final", bool, True)


def _outputs(c: Conversion) -> None:
    """Logging and the profiler; the original's evaluation and upload sections have no counterpart."""
    if c.src.peek("logging") is not None:
        c.copy("logging.iteration_step_info_interval", "logging.log_interval", int, 1)
    if c.src.get("profiler.profiler_export_path", str) is None:
        c.src.take("profiler")  # the original profiles only with an export path: its other keys do nothing
    else:
        c.copy("profiler.profiler_export_path", "profiler.export_path", str)
        waits = [("skip_first", 3), ("wait", 1), ("warmup", 1)]  # here: wait_steps, then 1 warmup step
        skipped = sum(c.src.get(f"profiler.{key}", int, default) for key, default in waits) - 1
        c.set("profiler.wait_steps", max(skipped, 0), *(f"profiler.{key}" for key, _ in waits))
        c.copy("profiler.active", "profiler.active_steps", int, 1)
    for section, why in (
        ("lighteval", "downstream evaluation here runs inside training: [evaluation] tasks of JSONL items"),
        ("s3_upload", "checkpoints are written to checkpoint.dir only; copy them with a tool of your own"),
    ):
        if c.src.take(section) is not None:
            c.note(section, f"{section} not carried over: {why}")
