"""The one door to private torch APIs in checkpointing (`parallel/torch_private.py` is the other).

DCP's index (`.metadata`) is a pickle whose classes include private ones; reading it safely means naming them
in an allow-list, and a load planner that loads non-tensor values weights-only writes them back with DCP's own
helper. Async saves ask whether DCP's stager survives a save (it does not on torch 2.11). A torch upgrade that
moves any of these fails its canary in `tests/test_torch_private.py`.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.checkpoint._traverse import set_element

__all__ = ["DCP_INDEX_PRIVATE_GLOBALS", "set_element", "stager_keeps_its_buffers"]

# The private classes and functions a DCP index pickles (module.name, as the unpickler asks for them).
DCP_INDEX_PRIVATE_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
    }
)


@functools.cache
def stager_keeps_its_buffers() -> bool:
    """Whether DCP's DefaultStager keeps its state-dict stager (the host buffers and the copy's dispatch table)
    from one save to the next. torch 2.11 closes it at the end of every stage, which empties both, so a second
    stage fails (KeyError on the first container): there each save takes a fresh stager and allocates its
    buffers again."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        stager.stage({"probe": torch.zeros(1)})
        return bool(stager._state_dict_stager._deepcopy_dispatch)
    finally:
        stager.close()
