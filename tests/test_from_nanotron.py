"""`nanotron config from-nanotron`: the original nanotron's YAML config becomes TOML this project trains from; every
key is mapped in this project's units or named in a note; bad input is one error line naming the file and key."""

from __future__ import annotations

import math
import re
import sys

import pytest
from conftest import read_metrics, run_train

from nanotron.commands.config import main
from nanotron.config import load_config
from nanotron.errors import ConfigError
from nanotron.optim import lr_at

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The original's full example shape (every section, as its save_as_yaml writes them), values made up for a tiny
# Llama at dp=2 x tp=2 x pp=2, with two data stages.
ORIGINAL = """\
checkpoints:
  checkpoint_interval: 250
  checkpoints_path: /scratch/ckpt/tiny-llama
  checkpoints_path_is_shared_file_system: false
  load_lr_scheduler: true
  load_optimizer: true
  resume_checkpoint_path: null
  save_final_state: true
  save_initial_state: true
data_stages:
- data:
    dataset:
      dataset_overwrite_cache: false
      dataset_processing_num_proc_per_process: 8
      hf_dataset_config_name: null
      hf_dataset_or_datasets: stas/openwebtext-10k
      hf_dataset_splits: train
      text_column_name: content
    num_loading_workers: 2
    seed: 1234
  name: Stable Training Stage
  start_training_step: 1
- data:
    dataset:
      hf_dataset_or_datasets: HuggingFaceTB/cosmopedia-100k
      text_column_name: text
    num_loading_workers: 2
    seed: 1234
  name: Annealing Phase
  start_training_step: 900
general:
  benchmark_csv_path: null
  consumed_train_samples: null
  ignore_sanity_checks: true
  project: tiny-llama-ablations
  run: tiny_llama_%date_%jobid
  seed: 1234
  step: null
lighteval: null
logging:
  iteration_step_info_interval: 10
  log_level: info
  log_level_replica: info
metrics_logging: null
model:
  ddp_bucket_cap_mb: 25
  dtype: bfloat16
  init_method:
    std: 0.025
  make_vocab_size_divisible_by: 64
  model_config:
    bos_token_id: 1
    eos_token_id: 2
    hidden_act: silu
    hidden_size: 64
    initializer_range: 0.02
    intermediate_size: 256
    is_llama_config: true
    max_position_embeddings: 512
    num_attention_heads: 4
    num_hidden_layers: 4
    num_key_value_heads: 2
    pad_token_id: null
    pretraining_tp: 1
    rms_norm_eps: 1.0e-05
    rope_interleaved: false
    rope_scaling: null
    rope_theta: 500000.0
    tie_word_embeddings: false
    use_cache: true
    vocab_size: 50257
optimizer:
  accumulate_grad_in_fp32: true
  clip_grad: 1.0
  learning_rate_scheduler:
    learning_rate: 0.0006
    lr_decay_starting_step: null
    lr_decay_steps: 900
    lr_decay_style: cosine
    lr_warmup_steps: 100
    lr_warmup_style: linear
    min_decay_lr: 6.0e-05
  optimizer_factory:
    adam_beta1: 0.9
    adam_beta2: 0.95
    adam_eps: 1.0e-08
    name: adamW
    torch_adam_is_fused: true
  weight_decay: 0.1
  weight_decay_exclude_named_params: []
  zero_stage: 1
parallelism:
  context_parallel_size: 1
  dp: 2
  expert_parallel_size: 1
  pp: 2
  pp_engine: 1f1b
  recompute_layer: true
  tp: 2
  tp_linear_async_communication: false
  tp_mode: REDUCE_SCATTER
  tp_recompute_allgather: true
profiler:
  active: 2
  export_chrome_trace: false
  profile_memory: false
  profiler_export_path: ./tb_logs
  record_shapes: false
  repeat: 1
  skip_first: 3
  wait: 1
  warmup: 1
  with_stack: true
s3_upload:
  remove_after_upload: true
  s5cmd_concurrency: null
  s5cmd_numworkers: null
  s5cmd_path: null
  upload_s3_path: s3://my-bucket/tiny-llama
tokenizer:
  tokenizer_max_length: null
  tokenizer_name_or_path: gpt2
  tokenizer_revision: null
tokens:
  batch_accumulation_per_replica: 8
  limit_test_batches: 0
  limit_val_batches: 16
  micro_batch_size: 4
  sequence_length: 256
  train_steps: 1000
  val_check_interval: 100
"""


MODEL = "model:\n  model_config: {num_attention_heads: 4, num_key_value_heads: 2}\n"


def convert(tmp_path, capsys, yaml: str) -> tuple[int, str, str]:
    """Runs the command on `yaml` written to a file: (exit code, the TOML written, stderr)."""
    source, out = tmp_path / "old.yaml", tmp_path / "new.toml"
    source.write_text(yaml)
    code = main(["from-nanotron", str(source), "--out", str(out)])
    return code, out.read_text() if out.exists() else "", capsys.readouterr().err


def named(note: str) -> str:
    """The original key a note names (its first word, up to '=' or ':')."""
    return re.match(r"[\w.\[\]]+", note).group()


def test_the_originals_full_example_converts_key_by_key(tmp_path, capsys):
    code, text, err = convert(tmp_path, capsys, ORIGINAL)
    assert code == 0
    assert tomllib.loads(text) == {
        "job": {"seed": 1234, "name": "tiny_llama"},
        "model": {
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_layers": 4,
            "num_heads": 4,
            "max_seq_len": 512,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "num_kv_heads": 2,
            "vocab_size": 50304,  # padded as the original does: to a multiple of 64 x tp
            "attention": "causal",
            "init_std": 0.025,
        },
        "parallelism": {
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "cp": 1,
            "ep": 1,
            "pp_engine": "1f1b",
            "tp_mode": "reduce_scatter",
            "tp_linear_async_communication": False,
            "recompute": "full",
            "zero_stage": 1,
        },
        "training": {
            "dtype": "bfloat16",
            "seq_len": 256,
            "steps": 1000,
            "micro_batch_size": 4,
            "global_batch_size": 64,  # micro_batch_size 4 x batch_accumulation_per_replica 8 x dp 2
            "grad_accum_steps": 0,
            "eval_interval": 100,
            "eval_steps": 2,  # 16 microbatches per dp rank = 2 global batches
            "clip_grad": 1.0,
        },
        "optimizer": {
            "weight_decay": 0.1,
            "lr": 0.0006,
            "warmup_steps": 100,
            "decay_style": "cosine",
            "min_lr": 6e-05,
            "decay_steps": 900,
            "betas": [0.9, 0.95],
            "eps": 1e-08,
            "fused": True,
        },
        "data": {"tokenizer": "gpt2", "num_workers": 2, "path": "data/tokenized/stas_openwebtext-10k"},
        "checkpoint": {
            "dir": "/scratch/ckpt/tiny-llama",
            "interval": 250,
            "save_initial_state": True,
            "save_final": True,
        },
        "logging": {"wandb_project": "tiny-llama-ablations", "log_interval": 10},
        "profiler": {"export_path": "./tb_logs", "wait_steps": 4, "active_steps": 2},
    }
    notes = [line.removeprefix("note: ") for line in err.splitlines()]
    assert all(line.startswith("note: ") for line in err.splitlines())
    assert [named(note) for note in notes] == [
        "data_stages[0].data.dataset.hf_dataset_or_datasets",
        "data_stages[1]",
        "general.run",
        "profiler.with_stack",
        "s3_upload",
        "tokenizer.tokenizer_name_or_path",
    ]
    assert notes[0].endswith(
        "nanotron tokenize stas/openwebtext-10k --tokenizer gpt2 --out data/tokenized/stas_openwebtext-10k "
        "--text_column content"
    )
    assert [named(note) for note in notes if "not carried over" in note] == [
        "data_stages[1]",
        "profiler.with_stack",
        "s3_upload",
    ]
    assert [f"# note: {note}" for note in notes] == [line for line in text.splitlines() if line.startswith("# note")]
    cfg = load_config(tmp_path / "new.toml", world_size=8)
    assert (cfg.training.grad_accum_steps, cfg.training.global_batch_size) == (8, 64)


# Other shapes the original writes: a Qwen2 mixture of experts, a Nanoset blend, AdamW's keys directly in
# [optimizer] (before April 2024), keys left to the original's defaults, a max_position_embeddings it ignores.
QWEN_MOE = """\
general: {project: moe-ablation}
parallelism: {dp: 2, tp: 1, pp: 1, expert_parallel_size: 2}
model:
  init_method: {std: 0.02}
  model_config:
    is_qwen2_config: true
    hidden_size: 64
    intermediate_size: 128
    num_hidden_layers: 4
    num_attention_heads: 4
    num_key_value_heads: 2
    vocab_size: 1000
    max_position_embeddings: 128
    _use_doc_masking: true
    moe_config: {num_experts: 4, top_k: 2, moe_intermediate_size: 32, layers: [1, 2, 3], enable_shared_expert: true,
                 shared_expert_intermediate_size: 64, router_aux_loss_coef: 0.01}
tokens: {sequence_length: 256, train_steps: 10, micro_batch_size: 2, batch_accumulation_per_replica: 1}
optimizer:
  zero_stage: 0
  weight_decay: 0.0
  clip_grad: null
  accumulate_grad_in_fp32: true
  adam_beta1: 0.9
  adam_beta2: 0.99
  adam_eps: 1.0e-06
  torch_adam_is_fused: false
  learning_rate_scheduler: {learning_rate: 0.001, lr_warmup_steps: 2}
data_stages:
- name: blend
  start_training_step: 1
  data:
    dataset: {dataset_folder: [/data/web/tokenized, /data/code/tokenized], dataset_weights: [0.7, 0.3]}
"""


def test_a_moe_nanoset_config_with_the_originals_defaults_converts(tmp_path, capsys):
    code, text, err = convert(tmp_path, capsys, QWEN_MOE)
    assert code == 0
    tables = tomllib.loads(text)
    assert tables["job"] == {"name": "moe-ablation"}
    assert tables["model"]["max_seq_len"] == 256  # the original ignores a shorter max_position_embeddings
    assert tables["model"]["attention"] == "document"
    assert tables["model"]["moe"] == {
        "num_experts": 4,
        "top_k": 2,
        "moe_intermediate_size": 32,
        "router": "softmax_topk",
        "renormalize": False,  # the original keeps the softmax over all experts for the chosen k
        "first_dense_layers": 1,
    }
    assert tables["parallelism"] | {"ep": 2, "pp_engine": "afab", "tp_mode": "all_reduce"} == tables["parallelism"]
    assert tables["training"]["dtype"] == "bfloat16" and tables["training"]["clip_grad"] == 0.0
    assert tables["optimizer"] == {
        "weight_decay": 0.0,
        "lr": 0.001,
        "warmup_steps": 2,
        "decay_style": "linear",
        "min_lr": 0.001,
        "decay_steps": 0,
        "betas": [0.9, 0.99],
        "eps": 1e-06,
        "fused": False,
    }
    assert tables["data"]["datasets"] == [
        {"path": "data/tokenized/data_web_tokenized", "weight": 0.7},
        {"path": "data/tokenized/data_code_tokenized", "weight": 0.3},
    ]
    assert [named(line.removeprefix("note: ")) for line in err.splitlines()] == [
        "model.model_config.max_position_embeddings",
        "model.model_config.moe_config.enable_shared_expert",
        "data_stages[0].data.dataset.dataset_folder",
    ]


def test_the_data_section_before_data_stages_is_read_as_the_one_stage(tmp_path, capsys):
    data = (
        "data: {seed: 42, num_loading_workers: 3, dataset: {hf_dataset_or_datasets: a/b, hf_dataset_splits: train}}\n"
    )
    code, text, err = convert(tmp_path, capsys, "parallelism: {dp: 1, tp: 1, pp: 1}\n" + MODEL + data)
    assert code == 0
    assert tomllib.loads(text)["data"] == {"num_workers": 3, "path": "data/tokenized/a_b"}
    assert [named(line.removeprefix("note: ")) for line in err.splitlines()] == ["data.dataset.hf_dataset_or_datasets"]


TINY = """\
general: {project: converted, run: from_yaml, seed: 7}
parallelism: {dp: 1, tp: 1, pp: 1, pp_engine: 1f1b, tp_mode: ALL_REDUCE}
model:
  dtype: float32
  init_method: {std: 0.02}
  model_config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2,
                 num_key_value_heads: 1, vocab_size: 512, max_position_embeddings: 64, tie_word_embeddings: false}
tokens: {sequence_length: 32, train_steps: 100, micro_batch_size: 2, batch_accumulation_per_replica: 2}
optimizer:
  zero_stage: 0
  weight_decay: 0.01
  clip_grad: 1.0
  accumulate_grad_in_fp32: true
  learning_rate_scheduler: {learning_rate: 0.001, lr_warmup_steps: 1, lr_decay_style: cosine}
  optimizer_factory: {name: adamW, adam_beta1: 0.9, adam_beta2: 0.95, adam_eps: 1.0e-08, torch_adam_is_fused: false}
logging: {iteration_step_info_interval: 1}
data_stages:
- name: only
  start_training_step: 1
  data: {seed: 7, dataset: {hf_dataset_or_datasets: some/corpus}}
"""
TINY_SCHEDULE = "{learning_rate: 0.001, lr_warmup_steps: 1, lr_decay_style: cosine}"
assert TINY_SCHEDULE in TINY


def original_lr(step: int, lr: float, min_lr: float, warmup: int, start: int, length: int) -> float:
    """The original's linear-decay schedule past warmup, by its documented phases: lr until lr_decay_starting_step,
    linear to min_decay_lr over lr_decay_steps, then min_decay_lr (`step` as its scheduler counts, from 0)."""
    assert step > warmup
    if step < start:
        return lr
    if step < start + length:
        return min_lr + (lr - min_lr) * (length - (step - start)) / length
    return min_lr


@pytest.mark.parametrize("decay_steps, length", [("lr_decay_steps: 20", 20), ("lr_decay_steps: null", 100 - 10 - 60)])
def test_a_warmup_stable_decay_schedule_converts_to_decay_start_and_keeps_the_originals_lrs(
    tmp_path, capsys, decay_steps, length
):
    """lr_decay_starting_step (SmolLM3's stage configs decay from step 4198001 of 4720000) is optimizer.decay_start;
    with lr_decay_steps null the original decays over train_steps - warmup - start steps, which is carried as
    decay_steps with a note. Past warmup the converted schedule gives the original's learning rate at every step."""
    schedule = (
        "{learning_rate: 0.01, lr_warmup_steps: 10, lr_decay_starting_step: 60, "
        f"{decay_steps}, lr_decay_style: linear, min_decay_lr: 0.001}}"
    )
    code, text, err = convert(tmp_path, capsys, TINY.replace(TINY_SCHEDULE, schedule))
    assert code == 0
    optimizer = tomllib.loads(text)["optimizer"]
    assert (optimizer["decay_start"], optimizer["decay_steps"], optimizer["decay_style"]) == (60, length, "linear")
    notes = [named(line.removeprefix("note: ")) for line in err.splitlines()]
    schedule_notes = [note for note in notes if note.startswith("optimizer.learning_rate_scheduler")]
    assert schedule_notes == ([] if length == 20 else ["optimizer.learning_rate_scheduler.lr_decay_steps"])
    cfg = load_config(str(tmp_path / "new.toml"))
    ours = [lr_at(step, cfg.optimizer, cfg.training.steps) for step in range(11, 100)]
    theirs = [original_lr(step, 0.01, 0.001, 10, 60, length) for step in range(11, 100)]
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_a_decay_start_inside_warmup_is_a_note_not_a_key(tmp_path, capsys):
    schedule = "{learning_rate: 0.01, lr_warmup_steps: 10, lr_decay_starting_step: 5}"
    code, text, err = convert(tmp_path, capsys, TINY.replace(TINY_SCHEDULE, schedule))
    assert code == 0 and "decay_start" not in tomllib.loads(text)["optimizer"]
    assert "lr_decay_starting_step=5 not carried over: it falls inside warmup" in err


@pytest.mark.parametrize(
    "extra, nope_layers, z_loss",
    [
        ("no_rope_layer: 4, z_loss_enabled: true, z_loss_coefficient: 0.0002", [3, 7], 2e-4),
        ("no_rope_layer: 3, z_loss_enabled: true", [2, 5], 1e-4),  # the original's default coefficient
        ("no_rope_layer: null, z_loss_enabled: false, z_loss_coefficient: 0.5", [], 0.0),
    ],
)
def test_smollm3s_nope_layers_and_the_z_loss_convert(tmp_path, capsys, extra, nope_layers, z_loss):
    """SmolLM3's no_rope_layer (RoPE skipped where (layer + 1) % no_rope_layer == 0, the original's rule) becomes
    model.nope_layers; an enabled z-loss its weight, with a note on how the original's differs."""
    yaml = TINY.replace("num_hidden_layers: 2,", f"num_hidden_layers: 8, {extra},")
    code, text, err = convert(tmp_path, capsys, yaml)
    tables = tomllib.loads(text)
    assert code == 0 and tables["model"].get("nope_layers", []) == nope_layers, err
    assert tables.get("training", {}).get("z_loss", 0.0) == z_loss
    assert ("squares log Z after subtracting each token's largest logit" in err) == (z_loss > 0)
    assert "not carried over" not in err or "no_rope_layer" not in err and "z_loss" not in err


@pytest.mark.slow
def test_a_converted_config_trains(tiny_data, tmp_path, capsys):
    code, _, _ = convert(tmp_path, capsys, TINY)
    assert code == 0
    args = ["--config", str(tmp_path / "new.toml"), *tiny_data.overrides(), f"--job.out_dir={tmp_path}"]
    run_train([*args, "--training.steps=2", "--training.eval_interval=0"])
    losses = [r["loss"] for r in read_metrics(tmp_path / "from_yaml") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize(
    ("yaml", "error"),
    [
        ("general: [unclosed\n", "not valid YAML at line 2"),
        ("- general\n- model\n", "expected a mapping of the original nanotron's sections (general, parallelism, model"),
        ("parallelism: {dp: two, tp: 1, pp: 1}\n" + MODEL, 'parallelism.dp: expected an integer, got "two"'),
        ("parallelism: {dp: 1, tp: 1, pp: 1}\nmodel: {model_config: [64]}\n", "model.model_config: expected a mapping"),
        ("parallelism: {dp: 1, tp: 1, pp: 1, pp_engine: zb}\n" + MODEL, "parallelism.pp_engine: expected one of afab"),
        (
            "parallelism: {dp: 1, tp: 4, pp: 1}\n" + MODEL,
            "parallelism.tp, model.model_config.num_key_value_heads: refused by this project: parallelism.tp=4 "
            "must divide model.num_kv_heads=2",
        ),
        (
            "parallelism: {dp: 1, tp: 1, pp: 1}\nmodel: {make_vocab_size_divisible_by: 0, model_config: {}}\n",
            "model.make_vocab_size_divisible_by: expected an integer >= 1, got 0",
        ),
        (
            "parallelism: {dp: 1, tp: 1, pp: 1}\nmodel: {make_vocab_size_divisible_by: -3, model_config: {}}\n",
            "model.make_vocab_size_divisible_by: expected an integer >= 1, got -3",
        ),
        ("parallelism: {dp: 1, tp: 0, pp: 1}\n" + MODEL, "parallelism.tp: refused by this project: parallelism.tp"),
    ],
    ids=[
        "not-yaml",
        "not-a-mapping",
        "wrong-type",
        "not-a-table",
        "unknown-engine",
        "refused-here",
        "vocab-multiple-zero",
        "vocab-multiple-negative",
        "tp-zero",
    ],
)
def test_bad_input_is_one_error_line_naming_the_file_and_key(tmp_path, capsys, yaml, error):
    code, text, err = convert(tmp_path, capsys, yaml)
    assert (code, text) == (2, "")
    assert err.startswith(f"error: {tmp_path / 'old.yaml'}: ") and err.count("\n") == 1
    assert error in err


@pytest.mark.parametrize(
    ("out", "error"),
    [
        ("old.yaml", "--out: 'old.yaml' is also an input; choose a new path"),
        ("link.yaml", "--out: 'link.yaml' is also an input; choose a new path"),
        ("", "--out: '.' is a folder; give the path of a file to write"),
        ("sub", "--out: 'sub' is a folder; give the path of a file to write"),
    ],
    ids=["the-input", "a-link-to-it", "empty", "a-folder"],
)
def test_an_out_that_is_the_input_or_a_folder_is_one_line_and_keeps_the_yaml(tmp_path, capsys, monkeypatch, out, error):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.yaml").write_text(TINY)
    (tmp_path / "link.yaml").symlink_to("old.yaml")
    (tmp_path / "sub").mkdir()
    assert main(["from-nanotron", "old.yaml", "--out", out]) == 2
    assert capsys.readouterr().err == f"error: {error}\n"
    assert (tmp_path / "old.yaml").read_text() == TINY and sorted(p.name for p in tmp_path.iterdir()) == [
        "link.yaml",
        "old.yaml",
        "sub",
    ]


def test_a_yaml_config_given_to_training_names_the_converter(tmp_path):
    yaml = tmp_path / "config.yaml"
    yaml.write_text(TINY)
    with pytest.raises(ConfigError) as error:
        load_config(yaml)
    assert f"convert the original nanotron's YAML with `nanotron config from-nanotron {yaml} > new.toml`" in str(
        error.value
    )
