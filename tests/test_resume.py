"""A resume lists every key that differs from the checkpoint's config, honours what it can (schedule, AdamW
settings, layout) and refuses in one line what it cannot (model shape, tokenizer, seq_len, global batch)."""

from __future__ import annotations

import pytest
from conftest import TINY_MODEL, console_messages, run_train, synthetic_documents

import nanotron.train
from nanotron.config import load_config, parse_overrides
from nanotron.parallel.mesh import destroy_distributed
from nanotron.trainer import Trainer

pytestmark = pytest.mark.slow  # every test resumes a real training run


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    """A 2-step run with its final checkpoint; the tests resume from it."""
    root = tmp_path_factory.mktemp("resume")
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={root}", "--training.steps=2"]
    run_train([*common, "--job.name=base"])
    return common, root / "base" / "checkpoints" / "step-2"


def resume(saved, tmp_path, *changes: str) -> list[str]:
    common, step = saved
    return [*common, f"--job.out_dir={tmp_path}", f"--checkpoint.resume_from={step}", *changes]


def test_changed_adamw_settings_and_lr_are_listed_and_honoured(saved, tmp_path, capsys):
    changes = ["--optimizer.betas=0.8,0.9", "--optimizer.eps=1e-6", "--optimizer.weight_decay=0.01"]
    path, overrides = parse_overrides(resume(saved, tmp_path, *changes, "--optimizer.lr=1e-3", "--parallelism.pp=1"))
    trainer = Trainer(load_config(path, overrides))
    try:
        trainer.resume()
        groups = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
        assert {(group["betas"], group["eps"]) for group in groups} == {((0.8, 0.9), 1e-6)}
        assert {group["weight_decay"] for group in groups} == {0.0, 0.01}  # norms and embeddings never decay
    finally:
        trainer.close()
        destroy_distributed()
    out = console_messages(capsys.readouterr().out)
    note = next(line for line in out if line.startswith("resume: config differs"))
    for expected in ("optimizer.betas [0.9, 0.95] -> [0.8, 0.9]", "optimizer.lr 0.003 -> 0.001", "optimizer.eps"):
        assert expected in note, note


@pytest.mark.parametrize(
    "change, named",
    [
        ("--model.num_heads=2", "model.num_heads 4 -> 2"),  # the same tensor shapes, another model
        ("--training.seq_len=8", "training.seq_len 16 -> 8"),
        ("--training.global_batch_size=16", "training.global_batch_size 8 -> 16"),
        ("--optimizer.name=muon", "optimizer.name 'adamw' -> 'muon'"),  # AdamW's moments are no Muon momentum
    ],
)
def test_changes_a_checkpoint_cannot_honour_are_one_line_errors(saved, tmp_path, capsys, change, named):
    assert nanotron.train.main(resume(saved, tmp_path, change)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: resume from ") and named in errors[0], errors


def test_a_global_batch_change_is_accepted_when_asked_and_listed(saved, tmp_path, capsys):
    args = resume(
        saved, tmp_path, "--training.global_batch_size=16", "--checkpoint.allow_global_batch_size_change=true"
    )
    assert nanotron.train.main([*args, "--training.steps=3"]) == 0
    assert "training.global_batch_size 8 -> 16" in capsys.readouterr().out


def test_another_tokenizer_is_refused(saved, tiny_data, tmp_path, capsys):
    """The corpus tokenized again with the other tokenizer: the data matches it, the checkpoint does not."""
    from nanotron.tokenize.bpe import train_tokenizer
    from nanotron.tokenize.writer import tokenize_paths

    train_tokenizer(synthetic_documents(20, seed=7), tmp_path / "other", vocab_size=300)
    tokenize_paths([str(tiny_data.corpus)], tmp_path / "other", tmp_path / "tokens", progress=False)
    changes = f"--data.tokenizer={tmp_path / 'other'}", f"--data.path={tmp_path / 'tokens'}"
    assert nanotron.train.main(resume(saved, tmp_path, *changes)) == 2
    assert "cannot honour data.tokenizer (another vocabulary)" in capsys.readouterr().err


def test_another_optimizer_starts_afresh_when_asked(saved, tmp_path, capsys):
    """checkpoint.reset_optimizer: the weights and position resume, Muon's momentum starts at zero."""
    args = resume(saved, tmp_path, "--optimizer.name=muon", "--checkpoint.reset_optimizer=true")
    assert nanotron.train.main([*args, "--training.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "optimizer.name 'adamw' -> 'muon'" in out and "resumed from" in out
