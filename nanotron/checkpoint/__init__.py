"""Checkpoints: the manager (`manager.py`) over stateful components (`state.py`), the on-disk layout and
its atomic commits (`layout.py`), and safe reading of untrusted files (`safe_io.py`)."""

from nanotron.checkpoint.layout import (
    check_writable,
    committed_steps,
    find_checkpoint,
    is_committed,
    latest_checkpoint,
)
from nanotron.checkpoint.manager import CheckpointManager, load_states, resolve_source
from nanotron.checkpoint.safe_io import load_dcp, read_metadata, read_model_weights, verified_checkpoint
from nanotron.checkpoint.state import ModelState, OptimizerState

__all__ = [
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "check_writable",
    "committed_steps",
    "find_checkpoint",
    "is_committed",
    "latest_checkpoint",
    "load_dcp",
    "load_states",
    "read_metadata",
    "read_model_weights",
    "resolve_source",
    "verified_checkpoint",
]
