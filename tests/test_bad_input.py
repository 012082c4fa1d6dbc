"""Odd input that used to end in a traceback is one `error:` line naming the file, key or flag, exit code 2."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, run_train, train_env

import nanotron.checkpoint.integrity as integrity
import nanotron.commands.convert
import nanotron.commands.generate
import nanotron.hf.export
import nanotron.train
from nanotron.config import load_config
from nanotron.data.skips import SKIPPED_SAMPLES, read_run_skips
from nanotron.errors import DataError
from nanotron.metrics.wandb_run import STATE_FILE, WandbRun


def one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ---- config files and flags ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"[training]\nsteps = 1\n\xff\xfe\n", "is not UTF-8 text"),
        (b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n", "is not valid TOML"),
    ],
)
def test_unreadable_toml_files_are_one_line(tmp_path, capsys, content, expected):
    file = tmp_path / "job.toml"
    file.write_bytes(content)
    assert nanotron.train.main(["--config", str(file)]) == 2
    assert f"'{file}' {expected}" in one_line(capsys)


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--job.seed=18446744073709551616", "job.seed: expected a value below 2**64"),
        ("--nproc_per_node=²", "--nproc_per_node: expected a positive integer, got '²'"),
        ("--nproc_per_node=1 --nproc_per_node 2", "--nproc_per_node: given twice (1, then 2); give it once"),
        ("--training.steps=1e999", "training.steps: expected int, got '1e999'"),
    ],
)
def test_out_of_range_and_odd_numbers_are_one_line(capsys, flag, expected):
    assert nanotron.train.main(["--config", f"{REPO}/configs/tiny.toml", *flag.split(" ")]) == 2
    assert expected in one_line(capsys)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            "--nproc_per_node abc",
            "--nproc_per_node: expected a positive integer, or auto, cpu or gpu (where there are GPUs), got 'abc'",
        ),
        (
            "--nproc_per_node 0",
            "--nproc_per_node: expected a positive integer, or auto, cpu or gpu (where there are GPUs), got '0'",
        ),
        ("--nnodes 2:1", "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '2:1'"),
        ("--nnodes 1:", "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '1:'"),
        ("--max_restarts -1", "--max_restarts: expected an integer >= 0, got -1"),
        ("--monitor_interval nan", "--monitor_interval: expected a positive number of seconds, got nan"),
        (
            "--nproc_per_node 1 missing.py",
            "training_script 'missing.py': no such file; give a Python script, or -m MODULE (-m nanotron.train)",
        ),
        ("--rdzv_conf x", "torchrun: The rendezvous configuration option 'x' must have a value specified."),
        ("--local_ranks_filter a", "torchrun: --local_ranks_filter must be a comma-separated list of integers"),
        ("--tee x", "torchrun: x does not match: <^[0123]$>"),
        ("--rdzv_endpoint host:abc", "torchrun: The port number of the rendezvous endpoint 'host:abc' must be"),
        ("--log_dir /proc/x", "--log_dir '/proc/x': cannot make it ("),
    ],
)
def test_bad_torchrun_flags_are_one_line_before_torchrun_starts(argv, expected, capsys, monkeypatch):
    """torchrun raised these as tracebacks (an AssertionError for --nproc_per_node 0 or --nnodes 2:1), or started
    workers that each failed on the missing script; `nanotron torchrun` checks them before it starts anything."""
    import nanotron.commands.torchrun
    import nanotron.launch.torchrun

    monkeypatch.setattr(nanotron.launch.torchrun, "_run_once", lambda config: pytest.fail("torchrun was started"))
    args = argv.split() if argv.endswith(".py") else [*argv.split(), "-m", "nanotron.train"]
    assert nanotron.commands.torchrun.main(args) == 2
    assert one_line(capsys).startswith(f"error: {expected}")


# ---- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    common = [*TINY_MODEL, *tiny_data.overrides(), "--training.steps=2"]
    run_train([*common, f"--job.out_dir={root}", "--job.name=base"])
    return common, root / "base" / "checkpoints"


def copy_checkpoints(saved, tmp_path) -> tuple[list[str], Path]:
    common, folder = saved
    run = tmp_path / "run"
    shutil.copytree(folder, run / "checkpoints")
    return [*common, f"--job.out_dir={tmp_path}", "--job.name=run"], run / "checkpoints"


@pytest.mark.slow
def test_binary_bytes_in_latest_fall_back_to_the_newest_committed_step(saved, tmp_path):
    args, folder = copy_checkpoints(saved, tmp_path)
    (folder / "latest").write_bytes(b"\x00\xff\xfe step-\x80\n")
    proc = run_train([*args, "--training.steps=3"])
    assert f"resumed from {folder / 'step-2'}" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        ({"step": -3}, "step: expected an integer >= 0, got -3"),
        ({"consumed_samples": "many"}, "consumed_samples: expected an integer >= 0, got 'many'"),
        ({"layout": 5, "step": [2]}, "step: expected an integer >= 0, got [2]"),
    ],
)
def test_a_trainer_state_with_wrong_values_is_one_line(saved, tmp_path, capsys, change, expected):
    """Edited, then its checksum too (an edit alone is refused by the checksum)."""
    args, folder = copy_checkpoints(saved, tmp_path)
    state = folder / "step-2" / "trainer_state.json"
    state.write_text(json.dumps(json.loads(state.read_text()) | change))
    integrity.write(state.parent, {})
    assert nanotron.train.main([*args, "--training.steps=3"]) == 2
    assert f"'{state}': {expected}" in one_line(capsys)


@pytest.mark.parametrize(
    "content, expected",
    [
        ("[1, 2]", "expected a JSON object, got [1, 2]"),
        ('{"id": 5}', "id: expected a W&B run id"),
        ('{"id": "../../x"}', "id: expected a W&B run id"),
        ('{"id": "abc", ', "is not valid JSON"),
    ],
)
def test_an_unusable_wandb_json_is_one_warning_and_a_new_wandb_run(tmp_path, capsys, monkeypatch, content, expected):
    started = []
    fake = types.SimpleNamespace(init=lambda **settings: started.append(settings["id"]), Settings=dict)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, [("job.out_dir", str(tmp_path)), ("logging.wandb", "true")])
    file = cfg.run_dir / STATE_FILE
    file.parent.mkdir(parents=True)
    file.write_text(content)
    assert WandbRun.start(cfg) is not None
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"'{file}'" in warnings[0] and expected in warnings[0], warnings
    assert warnings[0].endswith("a new W&B run is started")
    assert json.loads(file.read_text()) == {"id": started[0]}


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"windows": [[5, 3]]}', "windows[0]: expected [start, end] with 0 <= start < end, got [5, 3]"),
        ('{"windows": [[1, 18446744073709551616]]}', "windows[0]: expected [start, end] with 0 <= start < end"),
        ("[]", "expected a JSON object, got []"),
        ("{}", "windows: missing"),
    ],
)
def test_an_unusable_skipped_samples_json_is_one_line(tmp_path, content, expected):
    (tmp_path / SKIPPED_SAMPLES).write_text(content)
    with pytest.raises(DataError) as raised:
        read_run_skips(tmp_path)
    assert str(raised.value).startswith(f"'{tmp_path / SKIPPED_SAMPLES}': {expected}")


# ---- tokenizers ----------------------------------------------------------------------------------


@pytest.fixture
def broken_tokenizers(tiny_data, tmp_path):
    bad_config, binary = tmp_path / "bad_config", tmp_path / "binary"
    shutil.copytree(tiny_data.tokenizer, bad_config)
    (bad_config / "tokenizer_config.json").write_text('{"eos_token": ')
    binary.mkdir()
    (binary / "tokenizer.json").write_bytes(os.urandom(256))
    return {"bad_config": (bad_config, "tokenizer_config.json' is not valid JSON"), "binary": (binary, "not UTF-8")}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["bad_config", "binary"])
def test_broken_tokenizer_files_are_one_line_for_train_generate_and_export(
    saved, tmp_path, capsys, broken_tokenizers, which
):
    tokenizer, expected = broken_tokenizers[which]
    common, folder = saved
    assert nanotron.train.main([*common, f"--job.out_dir={tmp_path}", f"--data.tokenizer={tokenizer}"]) == 2
    assert expected in one_line(capsys)
    step = tmp_path / "step-2"
    shutil.copytree(folder / "step-2", step)
    shutil.rmtree(step / "tokenizer")
    shutil.copytree(tokenizer, step / "tokenizer")
    (step / "checksums.json").unlink()  # handed over without checksums (read on request): the files are checked
    # Each command names its own source of the tokenizer, never train's data.tokenizer (issue 26 item 7).
    saved_copy = f"the tokenizer saved in {step}"
    assert nanotron.commands.generate.main(["--checkpoint", str(step), "--prompt", "the", "--allow_unverified"]) == 2
    line = one_line(capsys)
    assert expected in line and saved_copy in line and "data.tokenizer" not in line, line
    assert nanotron.commands.convert.main(["to-hf", str(step), str(tmp_path / "hf"), "--allow_unverified"]) == 2
    line = one_line(capsys)
    assert expected in line and saved_copy in line and "data.tokenizer" not in line, line
    good = folder / "step-2"
    assert (
        nanotron.commands.generate.main(["--checkpoint", str(good), "--prompt", "the", "--tokenizer", str(tokenizer)])
        == 2
    )
    line = one_line(capsys)
    assert expected in line and "--tokenizer" in line and "data.tokenizer" not in line, line
    assert (
        nanotron.commands.convert.main(["to-hf", str(good), str(tmp_path / "hf2"), "--tokenizer", str(tokenizer)]) == 2
    )
    line = one_line(capsys)
    assert expected in line and "--tokenizer" in line and "data.tokenizer" not in line, line


@pytest.mark.slow
def test_generate_refuses_a_temperature_that_is_not_a_number(saved, capsys):
    step = saved[1] / "step-2"
    for value in ("nan", "inf", "-1"):
        assert (
            nanotron.commands.generate.main(["--checkpoint", str(step), "--prompt", "a", "--temperature", value]) == 2
        )
        assert "--temperature: expected a finite number >= 0" in one_line(capsys)


@pytest.mark.parametrize("seed", [str(2**64), "99999999999999999999999", "-1"])
def test_generate_refuses_a_seed_outside_64_bits_before_loading_anything(seed, capsys):
    argv = ["--checkpoint", "/nonexistent/run", "--temperature", "1", "--seed", seed]
    assert nanotron.commands.generate.main(argv) == 2
    assert f"--seed: expected an integer in [0, 2**64), got {seed}" in one_line(capsys)


# ---- Hugging Face folders ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_export(saved, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert nanotron.commands.convert.main(["to-hf", str(saved[1] / "step-2"), str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, expected",
    [
        ([1, 2, 3], "config.json' is not a JSON object"),
        ({"num_attention_heads": 0}, "num_attention_heads: expected a value >= 1, got 0"),
        ({"hidden_size": "wide"}, 'hidden_size: expected an integer, got "wide"'),
    ],
)
def test_malformed_hf_configs_are_one_line(hf_export, tmp_path, capsys, config, expected):
    hf = tmp_path / "hf"
    shutil.copytree(hf_export, hf)
    original = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config if isinstance(config, list) else original | config))
    assert nanotron.commands.convert.main(["from-hf", str(hf), str(tmp_path / "imported")]) == 2
    assert expected in one_line(capsys)


@pytest.mark.slow
def test_from_hf_leaves_an_out_tmp_it_did_not_create(hf_export, tmp_path, capsys):
    precious = tmp_path / "imported.tmp"
    precious.mkdir()
    (precious / "notes.txt").write_text("someone else's")
    assert nanotron.commands.convert.main(["from-hf", str(hf_export), str(tmp_path / "imported")]) == 0
    assert (precious / "notes.txt").read_text() == "someone else's"
    assert (tmp_path / "imported" / "checksums.json").is_file()
    capsys.readouterr()


@pytest.mark.slow
def test_a_fifo_in_an_hf_index_is_refused_without_hanging(hf_export, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(hf_export, hf)
    from safetensors import safe_open

    with safe_open(hf / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    (hf / "model.safetensors").unlink()
    os.mkfifo(hf / "model.safetensors")  # opening it for reading would wait for a writer forever
    index = {"weight_map": {name: "model.safetensors" for name in names}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = subprocess.run(
        [sys.executable, "-m", "nanotron", "convert", "from-hf", str(hf), str(tmp_path / "imported")],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "index, expected",
    [
        ({"weight_map": [1, 2]}, "weight_map: expected an object mapping tensor names to shard file names, got [1, 2]"),
        ([1], "expected a JSON object, got [1]"),
        ({"weight_map": {"model.embed_tokens.weight": 5}}, "weight_map: expected an object mapping tensor names"),
        ({"weight_map": None}, "weight_map: expected an object mapping tensor names to shard file names, got None"),
        ({}, "weight_map: missing"),
    ],
)
def test_a_malformed_safetensors_index_is_one_line_naming_it(tmp_path, capsys, index, expected):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(own_hf_config()))
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert nanotron.commands.convert.main(["from-hf", str(hf), str(tmp_path / "imported")]) == 2
    line = one_line(capsys)
    assert f"'{hf / 'model.safetensors.index.json'}'" in line and expected in line, line
    assert not (tmp_path / "imported").exists()


def own_hf_config(**changes) -> dict:
    """config.json as the project's own `to-hf` writes it for TINY_MODEL's shape, with `changes` on top."""
    import torch

    from nanotron.config import load_config, parse_overrides
    from nanotron.hf.llama import hf_config

    model = load_config(*parse_overrides(TINY_MODEL)).model
    return hf_config(model, torch.float32, None, False) | changes


def refused_hf_config(tmp_path, capsys, config: dict) -> str:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert nanotron.commands.convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 2
    line = one_line(capsys)
    assert f"'{tmp_path / 'hf' / 'config.json'}'" in line and not (tmp_path / "imported").exists(), line
    return line


MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"num_hidden_layers": True}, "num_hidden_layers: expected an integer, got true"),
        ({"hidden_size": 128.7}, "hidden_size: expected an integer, got 128.7"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: expected a number, got NaN"),
        ({"rope_theta": -1, "rope_parameters": None}, "rope_theta: expected a value >= 1.0, got -1.0"),
        (
            {"rope_parameters": {"rope_theta": float("inf")}},
            "rope_parameters.rope_theta: expected a number, got Infinity",
        ),
        ({"rope_theta": 500000.0}, "rope_theta=500000.0 and rope_parameters.rope_theta=10000.0 disagree"),
        ({"tie_word_embeddings": "false"}, 'tie_word_embeddings: expected true or false, got "false"'),
        ({"attention_bias": "no"}, 'attention_bias: expected true or false, got "no"'),
        ({"num_key_value_heads": 0}, "num_key_value_heads: expected a value >= 1, got 0"),
        ({"vocab_size": "512"}, 'vocab_size: expected an integer, got "512"'),
        ({"num_attention_heads": None}, "num_attention_heads: missing"),
        ({"head_dim": 8.5}, "head_dim: expected an integer, got 8.5"),
        ({**MIXTRAL, "num_local_experts": 4.5}, "num_local_experts: expected an integer, got 4.5"),
        ({**MIXTRAL, "num_experts_per_tok": False}, "num_experts_per_tok: expected an integer, got false"),
    ],
)
def test_hf_config_fields_of_the_wrong_type_or_range_are_one_line_naming_the_field(tmp_path, capsys, changes, expected):
    """A foreign config.json is untrusted: a bool is no layer count, a fraction no width, NaN no epsilon."""
    assert expected in refused_hf_config(tmp_path, capsys, own_hf_config(**changes))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"rope_scaling": LLAMA3_SCALING}, 'rope_scaling: RoPE scaling "llama3"'),  # beside to-hf's rope_parameters
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 'rope_scaling: RoPE scaling "linear"'),
        ({"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 5e5}}, 'rope_parameters: RoPE scaling "llama3"'),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.factor"),
        ({"rope_scaling": [8.0]}, "rope_scaling: expected a mapping, got [8.0]"),
    ],
)
def test_rope_scaling_in_an_hf_config_is_refused_naming_the_key(tmp_path, capsys, changes, key):
    """nanotron's RoPE is unscaled: importing a scaled model would give it other positions than it was trained on."""
    assert key in refused_hf_config(tmp_path, capsys, own_hf_config(**changes))


def test_hf_configs_as_either_transformers_version_writes_them_are_read_alike():
    """transformers 4 writes rope_theta (and rope_scaling: null), 5 writes rope_parameters; to-hf writes both."""
    from nanotron.hf.llama import model_config_from_hf

    own = own_hf_config(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    v4 = {k: v for k, v in own.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in own.items() if k not in ("rope_theta", "rope_scaling", "head_dim")}
    models = [model_config_from_hf(config, Path("config.json")) for config in (own, v4, v5)]
    assert models[0] == models[1] == models[2] and models[0].rope_theta == 5e5 and models[0].num_layers == 4


def tiny_hf_folder(folder: Path) -> Path:
    """A Hugging Face Llama folder of TINY_MODEL's shape (weights as to-hf writes them) without a tokenizer."""
    import torch
    from safetensors.torch import save_file

    from nanotron.config import load_config, parse_overrides
    from nanotron.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {
            name: t.shape
            for name, t in LlamaForCausalLM(load_config(*parse_overrides(TINY_MODEL)).model).state_dict().items()
        }
    folder.mkdir()
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(own_hf_config()))
    (folder / "tokenizer_config.json").write_text("{}")  # settings without the tokenizer itself
    return folder


def test_a_tokenizer_flag_naming_nothing_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """An import without tokenizer.json says so (the weights are still of use); a --tokenizer that names nothing is
    refused before the checkpoint is read, where to-hf wrote an export without a tokenizer and exited 0."""
    hf, ckpt, missing = tiny_hf_folder(tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "nonexistent"
    assert nanotron.commands.convert.main(["from-hf", str(hf), str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert f"'{hf}' has no tokenizer.json" in err and "--data.tokenizer" in err and err.count("\n") == 1, err
    assert not (ckpt / "tokenizer").exists()

    def no_work(*args, **kwargs):
        raise AssertionError("the checkpoint was read before --tokenizer was checked")

    monkeypatch.setattr(nanotron.hf.export, "verified_checkpoint", no_work)
    monkeypatch.setattr(nanotron.commands.generate, "load_model", no_work)
    refusal = f"error: --tokenizer: '{missing}' does not exist"
    assert nanotron.commands.convert.main(["to-hf", str(ckpt), str(tmp_path / "out"), "--tokenizer", str(missing)]) == 2
    assert one_line(capsys).startswith(refusal) and not (tmp_path / "out").exists()
    assert nanotron.commands.generate.main(["--checkpoint", str(ckpt), "--tokenizer", str(missing)]) == 2
    assert one_line(capsys).startswith(refusal)


# ---- the checkpoint dir fails mid-run (read-only or full: the same OSError path) ----


@pytest.mark.slow
def test_a_checkpoint_write_that_hits_the_file_size_limit_names_the_file_and_the_os_error(tiny_data, tmp_path):
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=2"]

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # metrics fit, shards don't

    proc = subprocess.run(
        [sys.executable, "-m", "nanotron.train", *args],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.search(
        r"cannot save checkpoint '.*step-2.tmp': writing '.*/__0_\d+\.distcp' failed "
        r"\(File too large, at this process's file-size limit of 200000 bytes",
        lines[0],
    )


def test_tokenizer_errors_name_the_option_the_caller_passes(tmp_path):
    """`nanotron tokenize --tokenizer T` must be told about --tokenizer, not the trainer's data.tokenizer."""
    from nanotron.errors import DataError
    from nanotron.tokenize.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(DataError, match=r"^--tokenizer: .*not UTF-8"):
        load_tokenizer(tmp_path, what="--tokenizer")
    import tokenizers

    (tmp_path / "tokenizer.json").write_text(tokenizers.Tokenizer(tokenizers.models.BPE()).to_str())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"^--tokenizer: .*tokenizer_config.json' is not valid JSON"):
        load_tokenizer(tmp_path, what="--tokenizer")


# ---- nanotron prepare: the demo's set-up steps ----------------------------------------------------


@pytest.fixture
def prepare_inputs(tiny_data, tmp_path, monkeypatch) -> Path:
    """A folder (the working directory) holding a JSONL corpus, a text document, a tokenizer folder, a task file, a
    file that is not JSON lines and an empty folder: what `prepare` reads, and outputs it must not destroy."""
    shutil.copy(tiny_data.corpus / "docs.jsonl", tmp_path / "corpus.jsonl")
    shutil.copytree(tiny_data.tokenizer, tmp_path / "tok")
    (tmp_path / "doc.txt").write_text("A PLAY.\nSpoken words of the play.\n")
    (tmp_path / "garbage.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def contents(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize(
    "args, expected",
    [
        ("corpus folder --out c.jsonl", "TEXT_FILE: 'folder' is a folder; expected a text file"),
        ("corpus missing.txt --out c.jsonl", "TEXT_FILE: 'missing.txt' does not exist; expected a text file"),
        ("corpus doc.txt --out folder", "--out: 'folder' is a folder; give the path of a file to write"),
        ("corpus doc.txt --out=", "--out: '.' is a folder; give the path of a file to write"),
        ("corpus doc.txt task.jsonl --out task.jsonl", "--out: 'task.jsonl' is also an input; choose a new path"),
        ("tokenizer folder --out t2", "CORPUS: 'folder' is a folder; expected a JSONL corpus"),
        ("tokenizer missing.jsonl --out t2", "CORPUS: 'missing.jsonl' does not exist; expected a JSONL corpus"),
        ("tokenizer garbage.jsonl --out t2", "'garbage.jsonl' line 2 is not valid JSON"),
        ("tokenizer task.jsonl --out t2", "'text' is not a field of 'task.jsonl' line 1"),
        ("tokenizer corpus.jsonl --out corpus.jsonl", "--out: 'corpus.jsonl' is also an input; choose a new path"),
        ("tokenizer corpus.jsonl --out doc.txt", "--out: output 'doc.txt' already exists and is not an empty folder"),
        ("tokenizer corpus.jsonl --out tok", "--out: output 'tok' already exists and is not an empty folder"),
        ("tokenizer corpus.jsonl --out t2 --vocab-size -5", "--vocab-size: expected an integer from 257 to "),
        ("tokenizer corpus.jsonl --out t2 --vocab-size 10", "--vocab-size: expected an integer from 257 to "),
        ("tokenizer corpus.jsonl --out t2 --vocab-size 100000000000", "--vocab-size: expected an integer from 257"),
        ("task corpus.jsonl --tokenized folder --out t.jsonl", "--tokenized: 'folder' is not a tokenized dir"),
        ("task corpus.jsonl --tokenized missing --out t.jsonl", "--tokenized: 'missing' does not exist"),
        ("task corpus.jsonl --tokenized {tokens} --out folder", "--out: 'folder' is a folder"),
        ("task corpus.jsonl --tokenized {tokens} --out corpus.jsonl", "--out: 'corpus.jsonl' is also an input"),
        ("task folder --tokenized {tokens} --out t.jsonl", "CORPUS: 'folder' is a folder; expected a JSONL corpus"),
        ("task corpus.jsonl --tokenized {tokens} --out t.jsonl --items -3", "--items: expected an integer >= 1"),
    ],
)
def test_bad_prepare_input_is_one_line_and_changes_no_file(prepare_inputs, tiny_data, capsys, args, expected):
    from nanotron.commands.prepare import main

    before = contents(prepare_inputs)
    assert main(args.format(tokens=tiny_data.tokenized).split(" ")) == 2
    assert expected in one_line(capsys)
    assert contents(prepare_inputs) == before


def test_prepare_tokenizer_finishes_a_folder_an_interrupted_run_left(prepare_inputs, capsys):
    """The tokenizer's files are written one by one, tokenizer.json last: a run stopped between them leaves a
    folder without it, which `make data` (scripts/prepare_data.sh) trains again. That folder is no tokenizer that
    data was built with, so it is not refused as one; a folder holding anything else still is."""
    from nanotron.commands.prepare import main

    partial = prepare_inputs / "partial"
    partial.mkdir()
    (partial / "tokenizer_config.json").write_text("{}")
    (partial / ".special_tokens_map.json.tmp123").write_text("")  # write_atomic's temporary file, cut short
    assert main(["tokenizer", "corpus.jsonl", "--out", "partial", "--vocab-size", "300"]) == 0
    assert (partial / "tokenizer.json").is_file()
    (prepare_inputs / "folder" / "notes.txt").write_text("mine")
    assert main(["tokenizer", "corpus.jsonl", "--out", "folder", "--vocab-size", "300"]) == 2
    assert "--out: output 'folder' already exists and is not an empty folder" in one_line(capsys)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("--items task.jsonl", "--items: 'task.jsonl' is also an input; choose a new path"),
        ("--out task.jsonl", "--out: 'task.jsonl' is also an input; choose a new path"),
        ("--items ck/step-2/config.toml", "--items: 'ck/step-2/config.toml' lies inside the input 'ck/step-2'"),
        ("--out scores.json --items scores.json", "--items: 'scores.json' is also --out; give each its own file"),
    ],
)
def test_eval_refuses_to_write_over_a_task_or_checkpoint_file(tmp_path, monkeypatch, capsys, flags, expected):
    """Checked before any weight is read: a step dir with a .metadata and a config is all it takes here."""
    import nanotron.commands.eval

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "step-2").mkdir(parents=True)
    (tmp_path / "ck" / "step-2" / ".metadata").write_text("original")
    shutil.copy(REPO / "configs" / "tiny.toml", tmp_path / "ck" / "step-2" / "config.toml")
    (tmp_path / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    before = contents(tmp_path)
    assert nanotron.commands.eval.main(["ck/step-2", "--tasks", "mine=task.jsonl", *flags.split(" ")]) == 2
    assert expected in one_line(capsys)
    assert contents(tmp_path) == before


@pytest.mark.parametrize(
    "command, argv, out, source",
    [
        ("eval", "ck/step-2 --tasks mine=task.jsonl --out {out}", "ck/step-2/new/scores.json", "ck/step-2"),
        ("convert", "to-hf ck/step-2 {out}", "ck/step-2/hf", "ck/step-2"),
        ("convert", "from-hf hf {out}", "hf/ckpt", "hf"),
        ("tokenize", "corpus --tokenizer tok --quiet --out {out}", "corpus/tokens", "corpus"),
        ("tokenize", "corpus --tokenizer tok --quiet --out {out}", "tok/tokens", "tok"),
        ("prepare", "task corpus.jsonl --tokenized tokens --out {out}", "tokens/task.jsonl", "tokens"),
    ],
)
def test_an_output_inside_an_input_folder_is_refused_before_it_is_made(
    command, argv, out, source, tiny_data, tmp_path, monkeypatch, capsys
):
    """A new file or folder inside an input folder was accepted (only an output that existed was compared with the
    inputs): the tokenized dir inside the corpus it tokenizes, an export inside the step dir it reads, scores
    inside a checkpoint, whose manifest then holds a file it does not list. Every command checks it with
    `io.check_not_input`, before it writes anything, even a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "step-2").mkdir(parents=True)
    (tmp_path / "ck" / "step-2" / ".metadata").write_text("original")
    shutil.copy(REPO / "configs" / "tiny.toml", tmp_path / "ck" / "step-2" / "config.toml")
    (tmp_path / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    shutil.copytree(tiny_data.corpus, tmp_path / "corpus")
    shutil.copy(tiny_data.corpus / "docs.jsonl", tmp_path / "corpus.jsonl")
    shutil.copytree(tiny_data.tokenizer, tmp_path / "tok")
    shutil.copytree(tiny_data.tokenized, tmp_path / "tokens")
    before = contents(tmp_path)
    main = importlib.import_module(f"nanotron.commands.{command}").main
    assert main(argv.format(out=out).split(" ")) == 2
    assert f"'{out}' lies inside the input '{source}'; choose a path outside it" in one_line(capsys)
    assert contents(tmp_path) == before
