"""The one door to private torch APIs in checkpointing (`parallel/torch_private.py` is the other).

DCP's index (`.metadata`) is a pickle whose classes include private ones; reading it safely means naming them
in an allow-list, and a load planner that loads non-tensor values weights-only writes them back with DCP's own
helper. A torch upgrade that moves any of these fails its canary in `tests/test_torch_private.py`.
"""

from __future__ import annotations

from torch.distributed.checkpoint._traverse import set_element

__all__ = ["DCP_INDEX_PRIVATE_GLOBALS", "set_element"]

# The private classes and functions a DCP index pickles (module.name, as the unpickler asks for them).
DCP_INDEX_PRIVATE_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
    }
)
