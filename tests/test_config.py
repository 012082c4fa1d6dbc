"""Config: TOML + overrides + presets resolve as documented; bad input is one clear line with exit code 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, train_env

from nanotron import commands
from nanotron.config import PRESETS, DatasetConfig, load_config, parse_overrides, to_toml
from nanotron.errors import ConfigError
from nanotron.train import main


def test_presets_fill_only_unset_fields_and_overrides_win(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text('[model]\nsize = "small"\nnum_layers = 3\n[training]\nsteps = 7\n')
    cfg = load_config(str(file), [("training.steps", "9"), ("optimizer.betas", "0.8,0.9")])
    assert cfg.model.hidden_size == PRESETS["small"]["hidden_size"] == 768
    assert cfg.model.num_layers == 3
    assert cfg.training.steps == 9
    assert cfg.optimizer.betas == [0.8, 0.9]


@pytest.mark.parametrize(
    "size, hidden, inter, layers, heads",
    [("small", 768, 3072, 12, 12), ("base", 2048, 8192, 24, 16), ("large", 4096, 11008, 32, 32)],
)
def test_presets_are_nanotrons_sizes(size, hidden, inter, layers, heads):
    m = load_config(f"{REPO}/configs/{size}.toml").model
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.vocab_size) == (
        hidden,
        inter,
        layers,
        heads,
        32000,
    )


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(f"{REPO}/configs/tiny.toml", [("parallelism.dp", "2")])
    (tmp_path / "resolved.toml").write_text(to_toml(cfg))
    assert load_config(str(tmp_path / "resolved.toml")) == cfg


def test_global_batch_size_derives_grad_accum_for_any_dp():
    for dp, accum in ((1, 4), (2, 2), (4, 1)):
        cfg = load_config(f"{REPO}/configs/tiny.toml", [("parallelism.dp", str(dp))])
        assert (cfg.training.global_batch_size, cfg.training.grad_accum_steps) == (16, accum)


def test_head_dim_defaults_to_hidden_over_heads_and_may_be_set_apart():
    """Qwen3's shape: a head_dim that is not hidden_size / num_heads (here 4 x 48 = 192 != 128, or 100 / 4 heads)."""
    assert load_config(f"{REPO}/configs/tiny.toml").model.head_dim == 128 // 4
    decoupled = load_config(f"{REPO}/configs/tiny.toml", [("model.head_dim", "48"), ("model.hidden_size", "100")])
    assert decoupled.model.head_dim == 48


MLA = [("model.kv_lora_rank", "32"), ("model.qk_nope_head_dim", "16"), ("model.qk_rope_head_dim", "8")]


def test_latent_attention_keys_resolve_the_head_shape():
    """MLA: head_dim is the query/key head (nope + rope), every head its own keys/values (the preset's 2 kv heads
    of 4 heads do not apply)."""
    model = load_config(f"{REPO}/configs/tiny.toml", [*MLA, ("model.v_head_dim", "12")]).model
    assert (model.mla, model.head_dim, model.num_kv_heads, model.rope_dim, model.value_dim) == (True, 24, 4, 8, 12)


def test_both_override_spellings_parse():
    assert parse_overrides(["--config", "a.toml", "--training.steps=3", "--model.num_layers", "2"]) == (
        "a.toml",
        [("training.steps", "3"), ("model.num_layers", "2")],
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.nun_layers=2"], "unknown key 'model.nun_layers' in command line; did you mean 'num_layers'?"),
        (["--trainig.steps=2"], "unknown section 'trainig' in command line; did you mean 'training'?"),
        (["--training.steps=three"], "training.steps: expected int, got 'three'"),
        (["--training.steps=0"], "training.steps: expected a value >= 1, got 0"),
        (["--training.dtype=fp8"], "training.dtype: expected one of 'float32', 'bfloat16', got 'fp8'"),
        (
            ["--parallelism.sp_regather=yes"],
            "parallelism.sp_regather: expected one of 'auto', 'on', 'off', got 'yes'",
        ),
        (
            ["--model.num_heads=4", "--model.num_kv_heads=3"],
            "model.num_heads=4 is not divisible by model.num_kv_heads=3",
        ),
        (["--training.global_batch_size=10"], "training.global_batch_size=10 is not divisible by"),
        (["--model.head_dim=7"], "model.head_dim=7: expected an even number (RoPE rotates pairs)"),
        (
            ["--model.head_dim=48", "--model.parametrization=mup"],
            "model.head_dim=48 x model.num_heads=4 differs from model.hidden_size=128, which "
            "model.parametrization='mup' does not support",
        ),
        (["--training.steps"], "--training.steps: missing value"),
        (["--model.nope_layers=1,4"], "model.nope_layers holds 4: expected decoder layer indices 0..3"),
        (["--model.nope_layers=1,1"], "model.nope_layers=[1, 1] names a layer twice; list each layer once"),
        (
            ["--model.nope_layers=1", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8"]
            + ["--model.qk_rope_head_dim=4", "--model.v_head_dim=8"],
            "model.nope_layers is set with multi-head latent attention",
        ),
        (["--training.z_loss=-1e-4"], "training.z_loss"),
        (
            ["--optimizer.warmup_steps=10", "--optimizer.decay_start=5"],
            "optimizer.decay_start=5 falls inside warmup (optimizer.warmup_steps=10): expected 0 (decay when warmup "
            "ends) or a step >= 10",
        ),
        (
            ["configs/small.toml"],
            "unexpected argument 'configs/small.toml': expected --section.key=value or --config "
            "FILE; did you mean --config configs/small.toml?",
        ),
        (["8"], "unexpected argument '8': expected --section.key=value or --config FILE"),
        (
            [f"--{k}={v}" for k, v in MLA],
            "model.v_head_dim: expected a value >= 1 with model.kv_lora_rank=32 (multi-head latent attention needs",
        ),
        (
            [f"--{k}={v}" for k, v in MLA] + ["--model.v_head_dim=8", "--model.num_kv_heads=2"],
            "model.num_kv_heads=2 (MLA expands keys and values for every head; unset it or set it to num_heads=4) "
            "does not go with multi-head latent attention",
        ),
        (
            [f"--{k}={v}" for k, v in MLA] + ["--model.v_head_dim=8", "--model.qk_norm=true"],
            "model.qk_norm=true (MLA normalises its latents, not its heads; set it false) does not go with",
        ),
        (
            [f"--{k}={v}" for k, v in MLA] + ["--model.v_head_dim=8", "--model.head_dim=32"],
            "model.head_dim=32 (MLA's is qk_nope_head_dim + qk_rope_head_dim = 24; unset it) does not go with",
        ),
        (
            ["--model.moe.num_experts=4", "--model.moe.num_expert_groups=2", "--model.moe.top_expert_groups=3"],
            "model.moe.top_expert_groups=3 with num_expert_groups=2: expected at most 2 groups holding at least top_k",
        ),
        (
            ["--model.q_lora_rank=16"],
            "model.q_lora_rank=16 is a multi-head latent attention width, but model.kv_lora_rank=0",
        ),
        (
            [f"--{k}={v}" for k, v in MLA[:2]] + ["--model.qk_rope_head_dim=5", "--model.v_head_dim=8"],
            "model.qk_rope_head_dim=5: expected an even number",
        ),
    ],
)
def test_bad_overrides_print_one_line_and_exit_2(args, expected, capsys):
    assert main(["--config", f"{REPO}/configs/tiny.toml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_bad_toml_files_name_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert main(["--config", str(missing)]) == 2
    assert f"--config: file '{missing}' not found" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\nsteps = 1\n")
    assert main(["--config", str(broken)]) == 2
    assert f"'{broken}' is not valid TOML" in capsys.readouterr().err
    typo = tmp_path / "typo.toml"
    typo.write_text("[training]\nstep = 1\n")
    with pytest.raises(ConfigError, match=f"unknown key 'training.step' in {typo}; did you mean 'steps'"):
        load_config(str(typo))


@pytest.mark.parametrize(
    "table, expected",
    [
        ('[training]\nsteps = "3"', "training.steps: expected int, got '3' (a quoted TOML string: drop the quotes)"),
        ('[optimizer]\nlr = "3e-3"', "optimizer.lr: expected float, got '3e-3' (a quoted TOML string: drop the"),
        ('[training]\ncompile = "false"', "training.compile: expected bool, got 'false' (a quoted TOML string"),
        ('[optimizer]\nbetas = "0.9,0.95"', "optimizer.betas: expected list, got '0.9,0.95'"),
        ('[model.moe]\nnum_experts = "4"', "model.moe.num_experts: expected int, got '4' (a quoted TOML string"),
        ('[[data.datasets]]\npath = "a"\nweight = "2"', "data.datasets[0].weight: expected float, got '2' (a"),
    ],
)
def test_a_toml_string_where_the_schema_wants_a_number_bool_or_list_is_one_line_naming_the_key(
    tmp_path, capsys, table, expected
):
    """TOML values are typed: a quoted "3" for an int key was parsed as the command line's text is (it was
    accepted); the command line's values stay text, parsed by the key's type."""
    file = tmp_path / "job.toml"
    file.write_text(table + "\n")
    assert main(["--config", str(file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {expected}"), err
    cfg = load_config(None, [("training.steps", "3"), ("optimizer.lr", "3e-3"), ("training.compile", "false")])
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.training.compile) == (3, 3e-3, False)


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["--config", f"{REPO}/configs/tiny.toml", f"--checkpoint.dir={blocker}/ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.dir: cannot write to '{blocker}/ckpt'")


def test_a_profiler_export_path_that_is_a_file_fails_before_training(tmp_path, capsys):
    """It was a traceback when the trace was written, after the profiled steps had run."""
    blocker = tmp_path / "a_file"
    blocker.write_text("kept")
    args = ["--config", f"{REPO}/configs/tiny.toml", f"--job.out_dir={tmp_path}"]
    assert main([*args, f"--profiler.export_path={blocker}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: profiler.export_path: cannot write to '{blocker}' (a file is there); choose a writable folder"
    ]
    assert blocker.read_text() == "kept"


def test_a_hub_dataset_is_one_line_naming_nanotron_tokenize(tmp_path, tiny_data, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert (
        main(
            [
                "--config",
                f"{REPO}/configs/tiny.toml",
                "--data.path=stas/openwebtext-10k",
                f"--data.tokenizer={tiny_data.tokenizer}",
                f"--job.out_dir={tmp_path}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stas/openwebtext-10k" in err[0] and "`nanotron tokenize stas/openwebtext-10k" in err[0]


@pytest.mark.slow
def test_the_documented_typo_command_exits_2_with_a_suggestion():
    """The literal command from the foundation issue, as a user types it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanotron.train",
            "--config",
            "configs/tiny.toml",
            "--training.steps=3",
            "--model.nun_layers=2",
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: unknown key 'model.nun_layers' in command line; did you mean 'num_layers'?"
    ]


def test_pipeline_schedules_that_need_pp_microbatches_say_so():
    with pytest.raises(ConfigError, match="pp_engine='1f1b' with pp=2 needs at least 2 microbatches"):
        load_config(f"{REPO}/configs/tiny.toml", [("parallelism.pp", "2"), ("training.global_batch_size", "4")])
    cfg = load_config(
        f"{REPO}/configs/tiny.toml",
        [("parallelism.pp", "2"), ("parallelism.pp_engine", "afab"), ("training.global_batch_size", "4")],
    )
    assert cfg.training.grad_accum_steps == 1


CONTROL_CHARACTERS = "".join(map(chr, [*range(0x20), 0x7F]))


def test_control_characters_in_strings_survive_the_saved_config(tmp_path):
    cfg = load_config(f"{REPO}/configs/tiny.toml", [("logging.wandb_group", f"a{CONTROL_CHARACTERS}b")])
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(str(saved)) == cfg and len(saved.read_text().splitlines()) == len(to_toml(cfg).splitlines())


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "", ".", "..", "a/b", "a\nb", "tab\there", "-flag", "x" * 101])
def test_job_names_that_would_leave_out_dir_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", f"{REPO}/configs/tiny.toml", f"--job.name={name}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: job.name {name!r}: expected ") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_resolved_config_runs_at_another_layout_with_the_same_global_batch(tmp_path):
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(load_config(f"{REPO}/configs/tiny.toml", [("parallelism.dp", "1")])))
    for dp, accum in ((1, 4), (2, 2), (4, 1)):
        training = load_config(str(saved), [("parallelism.dp", str(dp))]).training
        assert (training.global_batch_size, training.grad_accum_steps) == (16, accum)


@pytest.mark.parametrize("command", ["train", "doctor", "plan", "launch", "coord-check"])
def test_a_second_config_flag_is_one_line_naming_it(command, capsys):
    """Every command reading --config refuses a second one (the last one won without a word)."""
    tiny, small = f"{REPO}/configs/tiny.toml", f"{REPO}/configs/small.toml"
    extra = ["--run_name", "x"] if command == "launch" else []
    assert commands.main([command, *extra, "--config", tiny, "--config", small]) == 2
    assert capsys.readouterr().err == f"error: --config given twice ({tiny!r}, then {small!r}): give it once\n"


def test_nanotrons_config_file_spelling_and_yaml_get_a_one_line_hint(tmp_path, capsys):
    assert main(["--config-file", "a.toml"]) == 2
    hint = "error: --config-file is the original nanotron's spelling: use --config FILE (a TOML file)\n"
    assert capsys.readouterr().err == hint
    yaml = tmp_path / "config.yaml"
    yaml.write_text("general:\n  project: debug\n")
    assert main(["--config", str(yaml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config: '{yaml}' is YAML; nanotron configs are TOML") and err.count("\n") == 1


@pytest.mark.parametrize(
    "key, value, replacement",
    [
        ("parallelism.recompute_layer", "true", "use parallelism.recompute='full'"),
        ("model.mup_base_width", "8", "use [model.mup_base] hidden = <base width>, with heads (or head_dim) and"),
        ("model.mup_base_depth", "1", "use [model.mup_base] layers = <base depth>"),
        ("model.mup_base_head_dim", "2", "use [model.mup_base] head_dim = <base head dim>"),
        ("data.cache_dir", ".cache", "tokenize before training: `nanotron tokenize SOURCE --tokenizer T --out DIR`"),
        ("data.max_auto_tokenize_mb", "64", "`nanotron tokenize SOURCE --tokenizer T --out DIR`, then set data.path"),
        ("data.tokenize_workers", "4", "`nanotron tokenize SOURCE --tokenizer T --out DIR --workers N`"),
        ("data.text_column", "body", "`nanotron tokenize SOURCE --tokenizer T --out DIR --text_column NAME`"),
        ("data.validation_split", "0.1", "`nanotron tokenize SOURCE --tokenizer T --out DIR --validation_split"),
        ("checkpoint.async_save", "true", 'use checkpoint.async_mode = "async" (was true) or "sync" (was false)'),
    ],
)
def test_a_removed_key_is_one_line_naming_what_replaces_it(tmp_path, capsys, key, value, replacement):
    assert main(["--config", f"{REPO}/configs/tiny.toml", f"--{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key} was removed: ") and err.endswith(" (command line)\n"), err
    assert replacement in err and err.count("\n") == 1, err
    section, name = key.split(".")
    file = tmp_path / "old.toml"
    file.write_text(f"[{section}]\n{name} = {value if value[0].isdigit() or value == 'true' else repr(value)}\n")
    with pytest.raises(ConfigError, match=re.escape(replacement)):
        load_config(str(file))


def test_a_config_nanotron_saved_before_keys_were_removed_still_loads(tmp_path):
    """A run's or checkpoint's config.toml holds every key of its version, the removed ones at values that meant
    nothing then: eval, export and resume read it; typed by a user, the same keys are errors."""
    from nanotron.checkpoint.resume_policy import config_changes
    from nanotron.config import read_model_config

    cfg = load_config(f"{REPO}/configs/tiny.toml")
    old = to_toml(cfg).replace("[parallelism]\n", "[parallelism]\nrecompute_layer = false\n")
    old = old.replace("[model]\n", "[model]\nmup_base_width = 0\nmup_base_depth = 0\nmup_base_head_dim = 0\n")
    old = old.replace("[data]\n", '[data]\ncache_dir = "/tmp/cache"\nvalidation_split = 0.05\ntokenize_workers = 0\n')
    saved = tmp_path / "config.toml"
    saved.write_text(old)
    assert load_config(str(saved), saved=True) == cfg
    assert read_model_config(saved) == cfg.model
    assert config_changes(old, cfg) == {}
    with pytest.raises(ConfigError, match="model.mup_base_width was removed"):
        load_config(str(saved))


def test_a_checkpoint_saved_before_keys_were_added_resumes_with_them_at_their_defaults(tmp_path):
    """A checkpoint's config.toml lacks the keys added since it was saved (model.mtp_depth, optimizer.decay_start
    here): each reads as what the saved config loads as, its default, so an upgrade does not refuse the resume of
    a model key nor list the unchanged ones; a new key set to another value on resume is a change as any other."""
    from nanotron.checkpoint.resume_policy import check_resume, config_changes

    cfg = load_config(f"{REPO}/configs/tiny.toml")
    lines, table = [], ""
    for line in to_toml(cfg).splitlines():
        table = line if line.startswith("[") else table
        if table != "[model.moe]" and not line.startswith(("mtp_depth = ", "decay_start = ")):
            lines.append(line)  # as saved before [model.moe], model.mtp_depth and optimizer.decay_start existed
    saved = "\n".join(lines)
    assert "mtp_depth" not in saved and "decay_start" not in saved and "[model.moe]" not in saved
    (tmp_path / "config.toml").write_text(saved)
    assert config_changes(saved, cfg) == {}
    assert check_resume(cfg, tmp_path) is None
    wsd = load_config(f"{REPO}/configs/tiny.toml", [("optimizer.decay_start", "250")])
    assert config_changes(saved, wsd) == {"optimizer.decay_start": (0, 250)}
    mtp = load_config(f"{REPO}/configs/tiny.toml", [("model.mtp_depth", "1")])
    with pytest.raises(ConfigError, match="cannot honour model.mtp_depth 0 -> 1"):
        check_resume(mtp, tmp_path)


def test_a_refused_resume_names_the_changed_keys_of_a_table_not_the_whole_table(tmp_path):
    """A [model.moe] change is refused naming model.moe.top_k with both values, not both whole dicts (657 chars)."""
    from nanotron.checkpoint.resume_policy import check_resume, config_changes

    saved = load_config(f"{REPO}/configs/tiny.toml", [("model.moe.num_experts", "4")])
    (tmp_path / "config.toml").write_text(to_toml(saved))
    cfg = load_config(f"{REPO}/configs/tiny.toml", [("model.moe.num_experts", "4"), ("model.moe.top_k", "1")])
    assert config_changes(to_toml(saved), cfg) == {"model.moe.top_k": (2, 1)}
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, tmp_path)
    assert "cannot honour model.moe.top_k 2 -> 1;" in str(info.value) and "{" not in str(info.value)


def test_a_moe_layer_under_selective_recompute_is_recomputed_in_full():
    """torch 2.13's selective checkpoint fails on an MoE layer (its experts' FSDP hooks run more often in the
    rerun): those layers are recomputed in full, the dense ones as configured; recompute_every picks the layers."""
    from nanotron.parallel.recompute import recompute_mode

    moe = [("model.moe.num_experts", "4"), ("model.moe.first_dense_layers", "1")]
    selective = [("parallelism.recompute", "selective"), *moe]
    cfg = load_config(f"{REPO}/configs/tiny.toml", selective)
    assert [recompute_mode(cfg, i) for i in range(4)] == ["selective", "full", "full", "full"]
    cfg = load_config(f"{REPO}/configs/tiny.toml", [*selective, ("parallelism.recompute_every", "3")])
    assert [recompute_mode(cfg, i) for i in range(4)] == ["selective", "none", "none", "full"]
    dense = load_config(f"{REPO}/configs/tiny.toml", [("parallelism.recompute", "selective")])
    assert [recompute_mode(dense, i) for i in range(4)] == ["selective"] * 4


def test_datasets_tables_parse_round_trip_and_have_a_command_line_form(tmp_path):
    file = tmp_path / "blend.toml"
    file.write_text(
        '[data]\n[[data.datasets]]\npath = "a"\nweight = 0.7\n[[data.datasets]]\npath = "b"\nweight = 0.3\n'
    )
    cfg = load_config(str(file))
    assert [(d.path, d.weight) for d in cfg.data.datasets] == [("a", 0.7), ("b", 0.3)]
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(str(again)).data.datasets == cfg.data.datasets
    assert load_config(None, [("data.datasets", "x:2,y")]).data.datasets == [
        DatasetConfig("x", 2.0),
        DatasetConfig("y"),
    ]
    assert load_config(str(file), [("data.datasets", "")]).data.datasets == []  # back to data.path


@pytest.mark.parametrize(
    "table, message",
    [
        ('pth = "a"', "unknown key 'pth' in data.datasets[1]; did you mean 'path'?"),
        ('path = "a"\nweight = -1', "data.datasets[1].weight: expected a number > 0"),
        ('path = "a"\nweight = 0', "data.datasets[1].weight: expected a number > 0"),
        ("weight = 2", "data.datasets[1]: missing path; each [[data.datasets]] table needs path"),
        ('path = "a"\nweight = "x"', "data.datasets[1].weight: expected float, got 'x'"),
    ],
)
def test_a_bad_datasets_entry_is_one_line_naming_it(tmp_path, capsys, table, message):
    file = tmp_path / "blend.toml"
    file.write_text(f'[data]\n[[data.datasets]]\npath = "ok"\n[[data.datasets]]\n{table}\n')
    assert main(["--config", str(file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_distributed_timeouts_are_keys_with_bounds():
    cfg = load_config(None, [("distributed.timeout_minutes", "3"), ("distributed.startup_timeout_minutes", "7.5")])
    assert (cfg.distributed.timeout_minutes, cfg.distributed.startup_timeout_minutes) == (3.0, 7.5)
    assert "[distributed]\ntimeout_minutes = 3.0\nstartup_timeout_minutes = 7.5" in to_toml(cfg)
    for key in ("timeout_minutes", "startup_timeout_minutes"):
        with pytest.raises(ConfigError, match=rf"distributed.{key}: expected a value >= 0.1, got 0.0"):
            load_config(None, [(f"distributed.{key}", "0")])
        # a timedelta ends at 999999999 days (1.4e12 minutes): beyond, init_process_group's was a traceback
        with pytest.raises(ConfigError, match=rf"distributed.{key}: expected a value <= 1000000.0, got 1"):
            load_config(None, [(f"distributed.{key}", "1e13")])


def test_data_workers_are_bounded_by_what_a_node_runs():
    """Each worker is one more process per rank: any count was accepted (10**6 included), a fork storm."""
    assert load_config(None, [("data.num_workers", "32")]).data.num_workers == 32
    with pytest.raises(ConfigError, match=r"^data.num_workers: expected a value <= 32, got 33$"):
        load_config(None, [("data.num_workers", "33")])


def test_max_seq_len_is_bounded_where_the_rope_tables_float32_positions_stay_exact():
    """Any length was accepted, then failed to allocate its RoPE table at start (10**12 rows: a traceback). The table
    counts positions in float32, exact up to 2**24 (16M tokens, 16x the ~1M long-context runs train at today)."""
    assert torch.arange(2**24, dtype=torch.float32)[-1].item() == 2**24 - 1
    assert torch.tensor(2**24 + 1, dtype=torch.float32).item() == 2**24  # one more position is no longer its own
    assert load_config(None, [("model.max_seq_len", str(2**24))]).model.max_seq_len == 2**24
    with pytest.raises(ConfigError, match=r"^model.max_seq_len: expected a value <= 16777216, got 16777217$"):
        load_config(None, [("model.max_seq_len", str(2**24 + 1))])


def test_muons_momentum_is_below_one():
    """A momentum of 1 or more makes Muon's running average grow without bound (it was accepted)."""
    with pytest.raises(ConfigError, match=r"optimizer.muon_momentum: expected a value < 1.0, got 1.0"):
        load_config(None, [("optimizer.name", "muon"), ("optimizer.muon_momentum", "1")])
    assert load_config(None, [("optimizer.muon_momentum", "0.99")]).optimizer.muon_momentum == 0.99


def test_the_timeouts_reach_every_group_the_mesh_made(tmp_path):
    """Every communicator the layout creates gets the startup, then the steady, timeout, the flattened ones too
    (HSDP with cp's FSDP group "dp_shard_cp", Muon's "stage" at pp > 1): NCCL gives a group it is not told of
    10 minutes. The fake process group plays rank 0 of a pp2 x HSDP (2 x 2) x cp2 world with Muon."""
    import torch
    import torch.distributed as dist

    from nanotron.parallel.mesh import ParallelContext, build_mesh, expert_mesh
    from nanotron.parallel.torch_private import fake_process_group, submesh

    layout = {"pp": "2", "dp": "4", "dp_shard": "2", "zero_stage": "3", "cp": "2", "ep": "2"}
    keys = [*((f"parallelism.{k}", v) for k, v in layout.items()), ("model.moe.num_experts", "4")]
    keys += [
        ("model.num_layers", "4"),
        ("training.global_batch_size", "64"),
        ("training.grad_accum_steps", "0"),
        ("optimizer.name", "muon"),
    ]
    cfg = load_config(None, keys)
    fake_process_group(rank=0, world_size=cfg.world_size)
    try:
        mesh = build_mesh(cfg, "cpu")
        ctx = ParallelContext(mesh, torch.device("cpu"), 0, cfg.world_size, 0, 0, 0, expert_mesh=expert_mesh(mesh, 2))
        wanted = {"dp", "dp_cp", "dp_shard_cp", "stage", *mesh.mesh_dim_names}
        covered = {id(group) for group in ctx.groups()}
        missing = [name for name in sorted(wanted) if id(submesh(mesh, name).get_group()) not in covered]
        assert missing == []
    finally:
        dist.destroy_process_group()


def _timeouts_of_every_group(rank: int, port: int, out: str) -> None:
    """One rank of a dp=2 world: the startup timeout on every group from init, the steady one after end_startup."""
    import json
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from nanotron.parallel.mesh import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    seen = {}
    init = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: seen.update(kwargs) or init(*args, **kwargs)
    cfg = load_config(None, [("parallelism.dp", "2"), ("distributed.timeout_minutes", "3")])
    cfg.distributed.startup_timeout_minutes = 7
    ctx = init_distributed(cfg)
    minutes = lambda: [
        g._get_backend(torch.device("cpu")).options._timeout / timedelta(minutes=1) for g in ctx.groups()
    ]  # noqa: E731
    startup = minutes()
    ctx.end_startup()
    json.dump({"init": seen["timeout"] / timedelta(minutes=1), "startup": startup, "after": minutes()}, open(out, "w"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_timeouts_reach_init_process_group_and_every_mesh_group(tmp_path, forkserver):
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        forkserver.Process(target=_timeouts_of_every_group, args=(r, port, str(tmp_path / f"{r}.json"))) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["init"] == 7.0 and len(seen["startup"]) >= 2  # the world, and the tp/pp groups torch made itself
        assert seen["startup"] == [7.0] * len(seen["startup"]) and seen["after"] == [3.0] * len(seen["startup"])


@pytest.mark.parametrize(
    ("text", "steps"), [("1e3", 1000), ("1.5e3", 1500), ("2_000", 2000), ("1.5", None), ("1e400", None), ("nan", None)]
)
def test_an_integer_written_in_exponent_form_reads_on_the_command_line_as_in_a_toml_file(text, steps):
    """`steps = 1e3` in a TOML file read as 1000 while `--training.steps=1e3` was refused; a fraction, an overflow
    or nan stays one line naming the key."""
    argv = ["--config", "configs/tiny.toml", f"--training.steps={text}"]
    if steps is None:
        with pytest.raises(ConfigError, match=f"^training.steps: expected int, got '{text}'$"):
            load_config(*parse_overrides(argv))
    else:
        assert load_config(*parse_overrides(argv)).training.steps == steps
