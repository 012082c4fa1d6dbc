"""The whole model of a checkpoint in one process, for the commands that read one (generate, convert, eval's
neighbours, the coordinate check): its parameter shapes from the config alone, and the model with its weights."""

from __future__ import annotations

from pathlib import Path

import torch

from nanotron.checkpoint.safe_io import read_model_weights, verified_checkpoint
from nanotron.config import ModelConfig, read_model_config
from nanotron.errors import CheckpointError, DataError
from nanotron.models.llama import LlamaForCausalLM


def expected_shapes(model: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter name and shape of the model (built on the meta device: no memory)."""
    with torch.device("meta"):
        module = LlamaForCausalLM(model)
    return {name: tensor.shape for name, tensor in module.state_dict().items()}


def load_model(
    checkpoint: Path, device: torch.device | str = "cpu", allow_unverified: bool = False
) -> tuple[LlamaForCausalLM, Path]:
    """The full model of a checkpoint in eval mode, and the step dir it came from."""
    step_dir = verified_checkpoint(checkpoint, allow_unverified)
    config = read_model_config(step_dir / "config.toml")
    weights = read_model_weights(step_dir, expected_shapes(config))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    model.init_buffers(device)  # first: the state dict then sets the buffers it holds (MoE routing biases)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"'{step_dir}' does not match its config.toml ({str(error).splitlines()[0]})") from None
    return model.eval(), step_dir


def tokenizer_source(step_dir: Path, override: Path | None) -> str:
    """How errors name the tokenizer a checkpoint reader uses (export, generate): the command's own --tokenizer,
    or the checkpoint's copy; never train's data.tokenizer, an option these commands don't have."""
    return "--tokenizer" if override else f"the tokenizer saved in {step_dir}"


def check_tokenizer_flag(override: Path | None) -> None:
    """A --tokenizer that names nothing is refused before any work: export would otherwise ship no tokenizer, and
    generate would load the model first."""
    if override is not None and not override.exists():
        raise DataError(
            f"--tokenizer: '{override}' does not exist; pass a tokenizer.json file or a folder holding one, or leave "
            "--tokenizer out to use the checkpoint's copy"
        )
