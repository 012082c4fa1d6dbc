"""Checkpoints: the manager (`manager.py`) over stateful components (`state.py`), the on-disk layout and
its atomic commits (`layout.py`), and safe reading of untrusted files (`safe_io.py`).

Nothing is imported here: the node's watcher and the launcher read the layout without loading torch."""
