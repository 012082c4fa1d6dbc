"""HF interop and generation: export loads in transformers with the same logits, import round-trips exactly,
an import starts training at any layout, and `generate` decodes a checkpoint."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import TINY_MODEL, TINY_MUP, run_train, train_losses
from safetensors.torch import load_file, save_file

from nanotron.checkpoint import integrity
from nanotron.checkpoint.full_model import load_model
from nanotron.checkpoint.manager import check_model_shapes
from nanotron.checkpoint.safe_io import read_metadata
from nanotron.commands.convert import main as convert_main
from nanotron.commands.generate import main as generate_main
from nanotron.config import load_config, parse_overrides, toml_text
from nanotron.data import open_corpus
from nanotron.data.loader import build_train_loader
from nanotron.errors import CheckpointError
from nanotron.hf.export import to_hf
from nanotron.models.generate import generate, sample_next
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.parametrization import multipliers
from nanotron.parallel.init import init_weights
from nanotron.tokenize.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a trained checkpoint, transformers models, subprocesses


# TINY_MODEL's shape in transformers' config keys: vocab 512, 4 layers, GQA 4/2 heads, hidden 32
TINY_HF = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=32,
)


def hf_model(tied: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random HF Llama shaped like TINY_MODEL."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY_HF, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    return {name: t for file in sorted(files) for name, t in load_file(folder / file).items()}


def assert_round_trip(original, ours, source: Path, tmp_path: Path, architecture: str):
    """Our import of `original` (saved in `source`, imported to tmp_path/ckpt) gives its logits within 1e-5; to-hf
    writes back the same tensors, loaded by transformers as `architecture` with the original's logits; greedy
    decoding gives the same tokens. Returns the exported model."""
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (original(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5
    assert convert_main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    before, after = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(exported).__name__ == architecture
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, original(tokens).logits)
    prompt = [5, 17, 42, 7]
    mine = generate(ours, prompt, 10, eos_id=None)
    theirs = original.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert mine == theirs[0, len(prompt) :].tolist()
    return exported


def refused_import(model, tmp_path: Path, capsys, edit: dict) -> str:
    """from-hf of `model` saved with `edit` merged into its config.json: exit 2, nothing written, one stderr line."""
    source = tmp_path / "source"
    model.save_pretrained(source)
    config = json.loads((source / "config.json").read_text()) | edit
    (source / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not (tmp_path / "ckpt").exists(), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A committed step dir of a briefly trained tiny model."""
    root = tmp_path_factory.mktemp("trained")
    run_train([*tiny_data.overrides(), *TINY_MODEL, f"--job.out_dir={root}", "--job.name=tiny", "--training.steps=3"])
    return root / "tiny" / "checkpoints" / "step-3"


@pytest.mark.parametrize("max_shard_size", ["5GB", "30KB"])
def test_export_loads_in_transformers_with_the_same_logits(trained, tmp_path, max_shard_size):
    out = tmp_path / "hf"
    assert convert_main(["to-hf", str(trained), str(out), "--max_shard_size", max_shard_size]) == 0
    sharded = (out / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size == "30KB") and sharded != (out / "model.safetensors").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours, _ = load_model(trained)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and hf.config.eos_token_id == tokenizer.eos_token_id


def test_an_import_is_committed_as_a_checkpoint_is(tmp_path, monkeypatch):
    """from-hf writes a temporary dir and publishes it with the checkpoint layout's commit: renamed whole into the
    (here empty) out folder, the rename made durable by syncing the parent, nothing temporary left behind."""
    from nanotron.checkpoint import layout

    synced, fsync_dir = [], layout.fsync_dir
    monkeypatch.setattr(layout, "fsync_dir", lambda path: (synced.append(path), fsync_dir(path)))
    hf_model().save_pretrained(tmp_path / "source")
    (tmp_path / "ckpt").mkdir()
    assert convert_main(["from-hf", str(tmp_path / "source"), str(tmp_path / "ckpt")]) == 0
    assert synced == [tmp_path] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "source"]
    assert (tmp_path / "ckpt" / "checksums.json").is_file() and (tmp_path / "ckpt" / ".metadata").is_file()


@pytest.mark.parametrize("tied", [False, True])
def test_import_then_export_round_trips_the_weights_exactly(tmp_path, tied):
    source = tmp_path / "source"
    hf_model(tied=tied, dtype=torch.bfloat16).save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    assert convert_main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bfloat16"]) == 0
    before, after = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after) and ("lm_head.weight" in after) == (not tied)
    for name, tensor in before.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(after[name], tensor), name
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    original, exported = (transformers.LlamaForCausalLM.from_pretrained(f).eval() for f in (source, tmp_path / "back"))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, original(tokens).logits)


def test_a_llama_with_its_own_head_dim_round_trips(tmp_path):
    """Llama's config.json may state a head_dim apart from hidden / heads (4 x 12 = 48 != 32): it imports as
    model.head_dim (without QK-norm) and exports back as Llama, bit-identical."""
    source = tmp_path / "source"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=512,
        max_position_embeddings=32,
    )
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.config.head_dim == 12 and not ours.config.qk_norm
    assert assert_round_trip(original, ours, source, tmp_path, "LlamaForCausalLM").config.head_dim == 12


# µP shapes of TINY_MODEL (hidden 32, 4 layers, head dim 8): every multiplier differs from 1 but where noted.
MUP_EXPORTS = {
    "untied": (False, TINY_MUP),
    "tied-logit-multiplier": (True, TINY_MUP),
    # The base width is the model's (logit multiplier 1): the head stays tied; attention and branches still fold.
    "tied-base-width": (
        True,
        ["--model.mup_base.head_dim=2", "--model.mup_base.kv_heads=8", "--model.mup_base.layers=1"],
    ),
    # QK-norm exports as Qwen3: the attention scale goes into q_norm (a scale on q_proj would be normalised away).
    "qk-norm": (False, [*TINY_MUP, "--model.qk_norm=true"]),
}


def mup_checkpoint(folder: Path, tied: bool, overrides: list[str]) -> Path:
    """A step dir of a randomly initialised µP model: DCP weights and its config.toml."""
    args = [*TINY_MODEL, "--model.parametrization=mup", f"--model.tie_word_embeddings={str(tied).lower()}"]
    cfg = load_config(*parse_overrides([*args, *overrides]))
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, seed=0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / "config.toml").write_text(toml_text({"model": asdict(cfg.model)}))
    integrity.write(folder, integrity.shard_checksums(folder))  # as a saved checkpoint has (unchecked: refused)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", MUP_EXPORTS, ids=MUP_EXPORTS.keys())
def test_mup_export_folds_the_multipliers_so_transformers_gives_the_same_logits(case, tiny_data, tmp_path):
    tied, overrides = MUP_EXPORTS[case]
    step_dir = mup_checkpoint(tmp_path / "mup", tied, overrides)
    ours, _ = load_model(step_dir)
    mult = multipliers(ours.config)
    assert (
        mult.attention_scale is not None
        and mult.residual != 1.0
        and (mult.logits != 1.0) == (case != "tied-base-width")
    )
    hf_dir = tmp_path / "hf"
    assert convert_main(["to-hf", str(step_dir), str(hf_dir), "--tokenizer", str(tiny_data.tokenizer)]) == 0
    untied = not tied or mult.logits != 1.0
    assert json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"] == (not untied)
    assert ("lm_head.weight" in hf_tensors(hf_dir)) == untied
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if case == "qk-norm" else "LlamaForCausalLM")
    with torch.no_grad():
        expected = ours(tokens)
        assert (hf(tokens).logits - expected).abs().max().item() <= 1e-5
    # Imported back, it is a standard-parametrization model computing the same function.
    assert convert_main(["from-hf", str(hf_dir), str(tmp_path / "back")]) == 0
    back, _ = load_model(tmp_path / "back")
    assert back.config.parametrization == "standard" and back.config.tie_word_embeddings == (not untied)
    with torch.no_grad():
        assert (back(tokens) - expected).abs().max().item() <= 1e-5


def first_global_batch(tiny_data, args: list[str]) -> torch.Tensor:
    """The samples of step 1 as the trainer sees them (same config, same sample order)."""
    cfg = load_config(*parse_overrides(args))
    corpus = open_corpus(cfg)
    loader = iter(build_train_loader(corpus, cfg.training, seed=cfg.job.seed, dp=1, dp_rank=0))
    return torch.cat([next(loader) for _ in range(cfg.training.grad_accum_steps)])


def test_init_from_an_import_at_tp2_starts_from_the_hf_weights(tiny_data, tmp_path):
    model = hf_model(seed=1)
    model.save_pretrained(tmp_path / "source")
    assert convert_main(["from-hf", str(tmp_path / "source"), str(tmp_path / "ckpt")]) == 0
    args = [
        *tiny_data.overrides(),
        *TINY_MODEL,
        f"--job.out_dir={tmp_path}",
        "--job.name=tp2",
        "--training.steps=1",
        "--checkpoint.save_final=false",
        f"--checkpoint.init_from={tmp_path / 'ckpt'}",
    ]
    run_train([*args, "--parallelism.tp=2"], nproc=2)
    batch = first_global_batch(tiny_data, args)
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert train_losses(tmp_path / "tp2") == [pytest.approx(expected, rel=1e-5, abs=0)]


def test_a_checkpoint_of_another_model_shape_is_a_clear_error(trained):
    cfg = load_config(None, [(k.removeprefix("--").split("=")[0], k.split("=")[1]) for k in TINY_MODEL])
    cfg.model.intermediate_size = 96
    with torch.device("meta"):
        state = LlamaForCausalLM(cfg.model).state_dict()
    with pytest.raises(
        CheckpointError,
        match=r"does not match the configured model: .*gate_proj.weight has shape "
        r"\[64, 32\] there but \[96, 32\] here",
    ):
        check_model_shapes(trained, read_metadata(trained), state)


def test_convert_errors_are_one_line_with_exit_code_2(tmp_path, trained, capsys):
    assert convert_main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint '{tmp_path / 'missing'}' does not exist")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert convert_main(["to-hf", str(trained), str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    source = tmp_path / "biased"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "attention_bias": True}))
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention_bias is true" in err


# ---- generate -------------------------------------------------------------------------------------


def test_greedy_generation_is_deterministic_and_matches_transformers(trained, tmp_path, capsys):
    argv = ["--checkpoint", str(trained), "--prompt", "The cat", "--max_new_tokens", "12"]
    assert generate_main(argv) == 0 and generate_main(argv) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second and first.startswith("The cat") and len(first) > len("The cat")
    to_hf(trained, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = load_tokenizer(str(trained / "tokenizer"))
    prompt = tokenizer.encode("The cat")
    ours = generate(load_model(trained)[0], prompt, 12, eos_id=tokenizer.eos_id)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == theirs[: len(ours)]
    assert len(ours) == 12 or ours[-1] == tokenizer.eos_id


def test_sampling_flags_are_seeded_and_restrict_the_choice(trained, capsys):
    argv = [
        "--checkpoint",
        str(trained.parent.parent),
        "--max_new_tokens",
        "8",
        "--temperature",
        "0.8",
        "--top_k",
        "5",
        "--top_p",
        "0.9",
        "--seed",
        "3",
    ]
    assert generate_main(argv) == 0 and generate_main(argv) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    draws = {sample_next(logits, 5.0, 2, 1.0, torch.Generator().manual_seed(i)) for i in range(50)}
    assert draws == {1, 3}  # top-k 2 keeps exactly the two best, a high temperature reaches both
    draws = {sample_next(logits, 1.0, 0, 0.01, torch.Generator().manual_seed(i)) for i in range(20)}
    assert draws == {1}  # a tiny nucleus is the single most likely token
    assert sample_next(logits, 0.0, 0, 1.0, None) == 1


@pytest.mark.parametrize(
    "temperature, top_p", [(1e-45, 1.0), (1e-300, 1.0), (5e-324, 1.0), (1.0, 1e-45), (1.0, 1e-300)]
)
def test_a_vanishing_temperature_or_nucleus_samples_the_most_likely_token(temperature, top_p):
    """What float32 rounds to 0 or overflows (logits / 1e-45, top_p 1e-300) is the limit it approaches, the greedy
    choice, not a multinomial error on inf or nan probabilities."""
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    draws = {sample_next(logits, temperature, 0, top_p, torch.Generator().manual_seed(i)) for i in range(10)}
    assert draws == {1}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint", "/nonexistent/run"], "error: checkpoint '/nonexistent/run' does not exist"),
        (["--top_k", "5"], "error: --top_k/--top_p only apply when sampling"),
        (["--top_p", "1.5", "--temperature", "1"], "error: --top_p: expected a value in (0, 1]"),
    ],
)
def test_generate_errors_are_one_line_with_exit_code_2(trained, capsys, argv, message):
    argv = argv if argv[0] == "--checkpoint" else ["--checkpoint", str(trained), *argv]
    assert generate_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_exported_files_get_the_usual_permissions(trained, tmp_path):
    """Other users of a shared cluster read an export: safetensors' own writer creates files 0600."""
    out = tmp_path / "hf"
    mask = os.umask(0o022)
    try:
        assert convert_main(["to-hf", str(trained), str(out), "--max_shard_size", "30KB"]) == 0
    finally:
        os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.rglob("*") if f.is_file()}
    assert sum(name.endswith(".safetensors") for name in modes) > 1
    assert set(modes.values()) == {0o644}, modes


# ---- mixture of experts: Mixtral ------------------------------------------------------------------


def hf_mixtral(seed: int = 0):
    """A random HF Mixtral: 4 experts, top-2, GQA 4/2 heads, hidden 32, vocab 512."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=512,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # HF's init leaves the routers near uniform: spread them so routing matters
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def test_mixtral_imports_exports_and_generates_like_transformers(tmp_path):
    """from-hf: our logits equal transformers'; to-hf: the same files back; greedy decoding is the same tokens."""
    source = tmp_path / "source"
    original = hf_mixtral()
    original.save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.config.moe.num_experts == 4 and ours.config.moe.top_k == 2
    assert_round_trip(original, ours, source, tmp_path, "MixtralForCausalLM")


def test_a_moe_model_mixtral_cannot_express_is_refused_in_one_line(tiny_data, tmp_path):
    run_train(
        [
            *tiny_data.overrides(),
            *TINY_MODEL,
            "--model.moe.num_experts=4",
            "--model.moe.router=sigmoid",
            f"--job.out_dir={tmp_path}",
            "--job.name=moe",
            "--training.steps=1",
        ]
    )
    with pytest.raises(CheckpointError, match="model.moe.router='sigmoid'.*Mixtral cannot express"):
        to_hf(tmp_path / "moe" / "checkpoints" / "step-1", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- Qwen3: QK-norm and a head_dim apart from hidden / heads ---------------------------------------------------------


def hf_qwen3(tied: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random HF Qwen3: hidden 32, 4 query heads of 12 (48 != 32), 2 K/V heads, vocab 512; its q/k norm weights
    drawn at random (HF's init leaves them at one, which would hide a q/k mix-up)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=512,
        max_position_embeddings=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.5)
    return model.to(dtype)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_imports_exports_and_generates_like_transformers(tmp_path, tied):
    """from-hf: qk_norm and head_dim read, our logits equal transformers'; to-hf: the same files back and a
    Qwen3ForCausalLM; greedy decoding is the same tokens."""
    source = tmp_path / "source"
    original = hf_qwen3(tied)
    original.save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.config.qk_norm and ours.config.head_dim == 12 and ours.config.tie_word_embeddings == tied
    assert ours.config.rope_theta == 1000000.0
    exported = assert_round_trip(original, ours, source, tmp_path, "Qwen3ForCausalLM")
    assert exported.config.head_dim == 12 and ("lm_head.weight" in hf_tensors(tmp_path / "back")) == (not tied)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window is true; nanotron's attention is full causal"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, 'layer_types holds "sliding_attention"'),
        (
            {"attention_bias": True},
            "attention_bias is true; only plain Llama, Mixtral, Qwen3, Qwen3-MoE, SmolLM3 or DeepSeek-V3",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 'rope_scaling: RoPE scaling "yarn" is set'),
        ({"head_dim": 7}, "head_dim=7: expected an even number"),
        ({"head_dim": "wide"}, 'head_dim: expected an integer, got "wide"'),
    ],
)
def test_a_qwen3_config_nanotron_cannot_carry_is_refused_in_one_line(tmp_path, capsys, edit, message):
    assert message in refused_import(hf_qwen3(tied=False), tmp_path, capsys, edit)


# ---- SmolLM3: Llama with RoPE skipped in some layers (NoPE) ----------------------------------------------------------


def hf_smollm3(no_rope_layers: list[int] | None, seed: int = 0, **overrides):
    """A random HF SmolLM3 shaped like TINY_MODEL (4 layers); `no_rope_layers` a 1 (RoPE) or 0 per layer, or None
    for transformers' own derivation from no_rope_layer_interval."""
    torch.manual_seed(seed)
    config = transformers.SmolLM3Config(
        **TINY_HF,
        pad_token_id=None,  # its default, 128004, is outside this vocabulary
        no_rope_layers=no_rope_layers,
        **overrides,
    )
    return transformers.SmolLM3ForCausalLM(config).eval()


@pytest.mark.parametrize(
    "no_rope_layers, interval, nope_layers",
    [([1, 0, 1, 0], 4, [1, 3]), (None, 2, [1, 3])],  # listed (the interval then unread), or each 2nd layer
)
def test_smollm3_imports_exports_and_generates_like_transformers(tmp_path, no_rope_layers, interval, nope_layers):
    """from-hf: no_rope_layers (or, without it, no_rope_layer_interval) read as model.nope_layers, our logits equal
    transformers'; to-hf: the same files back and a SmolLM3ForCausalLM; greedy decoding is the same tokens."""
    source = tmp_path / "source"
    original = hf_smollm3(no_rope_layers, no_rope_layer_interval=interval)
    original.save_pretrained(source)
    if no_rope_layers is None:  # transformers writes the derived list: a file may lack it (older saves)
        config = json.loads((source / "config.json").read_text())
        del config["no_rope_layers"]
        (source / "config.json").write_text(json.dumps(config))
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.config.nope_layers == nope_layers
    exported = assert_round_trip(original, ours, source, tmp_path, "SmolLM3ForCausalLM")
    assert exported.config.no_rope_layers == [int(i not in nope_layers) for i in range(4)]


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers=[1, 0, 1]: expected one 0 (no RoPE) or 1 (RoPE) per layer"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers=[1, 2, 1, 0]: expected one 0"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window is true"),
    ],
)
def test_a_smollm3_config_nanotron_cannot_carry_is_refused_in_one_line(tmp_path, capsys, edit, message):
    assert message in refused_import(hf_smollm3([1, 1, 1, 0]), tmp_path, capsys, edit)


def test_nope_layers_with_qk_norm_or_experts_are_refused_at_export_in_one_line():
    """NoPE layers export only as SmolLM3 (plain Llama otherwise)."""
    from nanotron.hf import smollm3

    cfg = load_config(*parse_overrides([*TINY_MODEL, "--model.nope_layers=3", "--model.qk_norm=true"])).model
    with pytest.raises(CheckpointError, match=r"model.nope_layers=\[3\] with model.qk_norm=true: layers without RoPE"):
        smollm3.check_exportable(cfg)


# ---- Qwen3-MoE: QK-norm and a mixture of experts after a dense first layer --------------------------------------


def roughen(model) -> None:
    """Routers and norms away from their init (near-zero routers, unit norms): a mapping that drops or transposes
    one of them then changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.5)


def hf_qwen3_moe(norm_topk_prob: bool, seed: int = 0, **overrides):
    """A random HF Qwen3-MoE: 3 layers, the first dense (mlp_only_layers), 4 experts of 24, top-2, 4 query heads
    of 12 (48 != hidden 32); routers and q/k norms spread so routing and the norms matter."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 12,
            "vocab_size": 512,
            "max_position_embeddings": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": norm_topk_prob,
            "mlp_only_layers": [0],
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    roughen(model)
    return model


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_imports_exports_and_generates_like_transformers(tmp_path, norm_topk_prob):
    """from-hf: the dense first layer, the routing and QK-norm read, our logits equal transformers'; to-hf: the same
    files back and a Qwen3MoeForCausalLM; greedy decoding is the same tokens."""
    source = tmp_path / "source"
    original = hf_qwen3_moe(norm_topk_prob)
    original.save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    moe = ours.config.moe
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.first_dense_layers) == (4, 2, 24, 1)
    assert moe.renormalize == norm_topk_prob and moe.router == "softmax_topk" and moe.num_shared_experts == 0
    assert ours.config.qk_norm and ours.config.head_dim == 12
    exported = assert_round_trip(original, ours, source, tmp_path, "Qwen3MoeForCausalLM")
    assert exported.config.norm_topk_prob == norm_topk_prob


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"decoder_sparse_step": 2, "mlp_only_layers": []}, "decoder_sparse_step=2, mlp_only_layers=[] make layers 2"),
        ({"mlp_only_layers": [1]}, "make layers 1 dense after MoE layer 0; nanotron's MoE models keep dense layers"),
        ({"use_sliding_window": True}, "use_sliding_window is true"),
        ({"num_experts": 8}, "num_experts=8 and num_local_experts=4 disagree"),
    ],
)
def test_a_qwen3_moe_layout_nanotron_cannot_carry_is_refused_in_one_line(tmp_path, capsys, overrides, message):
    assert message in refused_import(hf_qwen3_moe(False), tmp_path, capsys, overrides)


def test_a_moe_model_qwen3_moe_cannot_express_is_refused_in_one_line():
    """QK-norm MoE models export as Qwen3-MoE, which carries unnormalised gates and dense first layers (Mixtral
    does not) but no shared experts."""
    from nanotron.hf import mixtral, qwen3

    moe = ["--model.qk_norm=true", "--model.moe.num_experts=4", "--model.moe.renormalize=false"]
    model = load_config(*parse_overrides([*TINY_MODEL, *moe, "--model.moe.first_dense_layers=1"])).model
    mixtral.check_exportable(model, {}, qwen3.EXPERT_FILES)
    with pytest.raises(CheckpointError, match="model.moe.renormalize=false, model.moe.first_dense_layers=1, which"):
        mixtral.check_exportable(model, {})
    shared = load_config(*parse_overrides([*TINY_MODEL, *moe, "--model.moe.num_shared_experts=1"])).model
    with pytest.raises(CheckpointError, match="num_shared_experts=1, which Hugging Face's Qwen3-MoE cannot express"):
        mixtral.check_exportable(shared, {}, qwen3.EXPERT_FILES)


# ---- DeepSeek-V3: multi-head latent attention, its MoE after a dense first layer ----------------------------------


def hf_deepseek_v3(moe: bool, seed: int = 0, **overrides):
    """A random HF DeepSeek-V3: 3 layers of MLA (query latent 24 or one q_proj, key/value latent 16, heads of 8 + 4
    for queries/keys and 6 for values, RoPE rows interleaved as DeepSeek stores them); with `moe` the first layer
    dense, then 4 experts of 16 in 2 groups of which each token may use 1, top-2, a shared expert, gates x 2.5.
    Routers, routing biases and norms drawn at random so routing, the bias's name and every norm matter."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "vocab_size": 512,
            "max_position_embeddings": 32,
            "q_lora_rank": 24 if moe else None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
            "first_k_dense_replace": 1 if moe else 3,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "routed_scaling_factor": 2.5,
            "n_group": 2,
            "topk_group": 1,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    roughen(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense_q_proj"])
def test_deepseek_v3_imports_exports_and_generates_like_transformers(tmp_path, moe):
    """from-hf: MLA's widths, the interleaved RoPE rows, the sigmoid router with its bias, scaling and groups, the
    shared expert and the dense first layer read, our logits equal transformers'; to-hf: the same files back and a
    DeepseekV3ForCausalLM; greedy decoding is the same tokens."""
    source = tmp_path / "source"
    original = hf_deepseek_v3(moe)
    original.save_pretrained(source)
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    cfg = ours.config
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.num_kv_heads) == (16, 24 if moe else 0, 12, 4)
    if moe:
        m = cfg.moe
        assert (m.num_experts, m.top_k, m.num_shared_experts, m.first_dense_layers) == (4, 2, 1, 1)
        assert m.router == "sigmoid" and m.routed_scaling_factor == 2.5
        assert (m.num_expert_groups, m.top_expert_groups) == (2, 1)
    assert cfg.moe.enabled == moe
    assert_round_trip(original, ours, source, tmp_path, "DeepseekV3ForCausalLM")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"n_group": 3}, "n_group=3 must divide n_routed_experts=4 into groups of at least 2 experts"),
        ({"norm_topk_prob": False}, "norm_topk_prob is false; nanotron's sigmoid router always normalises"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}},
            'rope_parameters: RoPE scaling "yarn" is set',
        ),
        ({"kv_lora_rank": None}, "kv_lora_rank: missing; every deepseek_v3 config.json states it"),
    ],
)
def test_a_deepseek_v3_config_nanotron_cannot_carry_is_refused_in_one_line(tmp_path, capsys, edit, message):
    assert message in refused_import(hf_deepseek_v3(moe=True), tmp_path, capsys, edit)


def test_a_latent_attention_model_deepseek_v3_cannot_express_is_refused_in_one_line():
    """MLA models export as DeepSeek-V3, whose MoE routes by sigmoid scores without a capacity limit."""
    from nanotron.hf import deepseek_v3

    mla = ["--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4"]
    mla += ["--model.v_head_dim=8", "--model.num_kv_heads=4", "--model.moe.num_experts=4"]
    deepseek_v3.check_exportable(load_config(*parse_overrides([*TINY_MODEL, *mla, "--model.moe.router=sigmoid"])).model)
    softmax = load_config(*parse_overrides([*TINY_MODEL, *mla, "--model.moe.capacity_factor=1.5"])).model
    with pytest.raises(CheckpointError, match="router='softmax_topk', model.moe.capacity_factor=1.5 \\(drops tokens"):
        deepseek_v3.check_exportable(softmax)


def test_deepseek_v3_mtp_layers_import_and_export_as_deepseeks_layer_after_the_last(tmp_path, capsys):
    """DeepSeek-V3's MTP module is stored as layer num_hidden_layers (here 3: a MoE layer's weights, enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embedding and head): from-hf reads it into mtp.0 and to-hf writes
    the same files back, which transformers loads (skipping that layer) with the original's logits. A folder
    transformers saved has no such layer: it imports without MTP, saying so."""
    original = hf_deepseek_v3(moe=True)
    plain, source = tmp_path / "plain", tmp_path / "source"
    original.save_pretrained(plain)
    assert convert_main(["from-hf", str(plain), str(tmp_path / "plain_ckpt")]) == 0
    assert "holds no multi-token prediction layers" in capsys.readouterr().out
    assert load_model(tmp_path / "plain_ckpt")[0].config.mtp_depth == 0
    original.save_pretrained(source)
    tensors = hf_tensors(source)
    gen = torch.Generator().manual_seed(3)
    mtp = {
        n.replace("layers.2.", "layers.3."): t + 0.1 * torch.randn(t.shape, generator=gen)
        for n, t in tensors.items()
        if n.startswith("model.layers.2.")
    }
    mtp |= {f"model.layers.3.{n}.weight": 1 + 0.5 * torch.randn(32, generator=gen) for n in ("enorm", "hnorm")}
    mtp["model.layers.3.shared_head.norm.weight"] = 1 + 0.5 * torch.randn(32, generator=gen)
    mtp["model.layers.3.eh_proj.weight"] = 0.1 * torch.randn(32, 64, generator=gen)
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({n: t.contiguous() for n, t in (tensors | mtp).items()}, source / "model.safetensors", {"format": "pt"})
    config = json.loads((source / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (source / "config.json").write_text(json.dumps(config))
    assert convert_main(["from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.config.mtp_depth == 1
    assert torch.equal(ours.mtp["0"].eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])
    assert torch.equal(ours.mtp["0"].norm.weight, mtp["model.layers.3.shared_head.norm.weight"])
    assert convert_main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    before, after = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, 512, (2, 16), generator=gen)
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, original(tokens).logits)


def test_mtp_of_a_model_without_latent_attention_is_refused_at_export_in_one_line(tmp_path):
    cfg = load_config(*parse_overrides([*TINY_MODEL, "--model.mtp_depth=1"]))
    step = tmp_path / "ckpt" / "step-1"
    model = LlamaForCausalLM(cfg.model)
    step.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    (step / "config.toml").write_text(toml_text({"model": asdict(cfg.model)}))
    with pytest.raises(CheckpointError, match="multi-token prediction exports only in DeepSeek-V3's format"):
        to_hf(step, tmp_path / "out", allow_unverified=True)


def test_a_used_output_folder_is_refused_before_any_weight_is_read(trained, tmp_path, monkeypatch, capsys):
    """to-hf and from-hf refuse an output folder that holds files before they read weights (minutes at 70B), not
    after."""
    import nanotron.hf.export as export
    import nanotron.hf.importer as importer

    def unread(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(export, "read_model_weights", unread)
    monkeypatch.setattr(importer, "read_hf_weights", unread)
    hf_model().save_pretrained(tmp_path / "source")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    capsys.readouterr()
    for argv in (["to-hf", str(trained), str(used)], ["from-hf", str(tmp_path / "source"), str(used)]):
        assert convert_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "already exists and is not an empty folder" in err[0], err
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
