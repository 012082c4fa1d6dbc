"""What would fail in the queue, checked on the login node before submitting.

A job can wait hours for its nodes; a path it cannot resolve, a Python without nanotron, a corpus too small for one
validation pass or a string that breaks the written files should cost a second here instead.
"""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from nanotron.config import Config
from nanotron.errors import ConfigError, LaunchError
from nanotron.tokenize.sources import is_hub_name

# Filesystems one node can't share with another: each node reads its own copy of what is written here.
if TYPE_CHECKING:
    from nanotron.data import Corpus

NODE_LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay", "vfat", "exfat"}
SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "wekafs", "panfs", "afs"}
SHARED_FS |= {"pvfs2", "orangefs", "gfs2", "ocfs2", "fuse.glusterfs", "fuse.ceph", "fuse.juicefs", "fuse.sshfs"}
SHARED_FS |= {"fuse.weka", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.lustre"}
NOT_PATHS = {"auto", "latest", "none", ""}
_DATASET_PATH = re.compile(r"data\.datasets\[(\d+)\]\.path")


def check_printable(argv: list[str]) -> None:
    """No control characters in what the launcher writes: a newline in a value would end the comment line of
    submit.sh (and run what follows) or a line of config.toml."""
    flag = "argument"
    for arg in argv:
        if arg.startswith("--"):
            flag = arg.partition("=")[0]
        bad = next((c for c in arg if unicodedata.category(c) == "Cc"), None)
        if bad is not None:
            raise ConfigError(
                f"{flag}: {arg!r} contains the control character {bad!r}; the launcher writes its values into "
                "submit.sh and config.toml: use printable characters only"
            )


def check_config_strings(cfg: Config) -> None:
    """The same for every string of the resolved config, wherever it came from (a --config file too)."""
    for section, table in cfg.to_dict().items():
        for key, value in table.items():
            items = [(f"{section}.{key}", value)]
            if key == "datasets":  # [[data.datasets]] tables
                items = [(f"data.datasets[{i}].{k}", v) for i, entry in enumerate(value) for k, v in entry.items()]
            for name, item in items:
                if isinstance(item, str) and any(unicodedata.category(c) == "Cc" for c in item):
                    raise ConfigError(f"{name}: {item!r} contains a control character; use printable ones")


def path_keys(cfg: Config) -> dict[str, str]:
    """Config keys holding local paths the job opens (a hub dataset name is not one)."""
    d, c = cfg.data, cfg.checkpoint
    keys = {"job.out_dir": cfg.job.out_dir, "data.tokenizer": d.tokenizer}
    keys |= {"checkpoint.dir": c.dir, "checkpoint.init_from": c.init_from}
    keys["profiler.export_path"] = cfg.profiler.export_path
    if c.resume_from not in NOT_PATHS:
        keys["checkpoint.resume_from"] = c.resume_from
    datasets = (
        [("data.path", d.path)]
        if not d.datasets
        else [(f"data.datasets[{i}].path", e.path) for i, e in enumerate(d.datasets)]
    )
    keys |= {key: path for key, path in datasets if not is_hub_name(path)}
    return {key: value for key, value in keys.items() if value not in NOT_PATHS}


def make_paths_absolute(cfg: Config) -> None:
    """Writes absolute paths into the run's config: the job resolves them wherever it starts, and the config
    means the same when reused from another directory. Symlinks are kept (a `current` link stays one)."""
    for key, value in path_keys(cfg).items():
        absolute = os.path.abspath(os.path.expanduser(value))
        if entry := _DATASET_PATH.fullmatch(key):
            cfg.data.datasets[int(entry[1])].path = absolute
            continue
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, absolute)


def job_python() -> str:
    """The interpreter running this launcher: the job runs the trainer with it (NANOTRON_PYTHON)."""
    if "," in sys.executable:  # sbatch --export separates variables with commas
        raise LaunchError(f"the Python path '{sys.executable}' contains ',', which sbatch --export can't pass")
    return sys.executable


def mount_table() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this machine's mounts; empty where /proc is not Linux's."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    unescape = lambda text: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), text)  # noqa: E731
    return [(unescape(parts[1]), parts[2]) for parts in (line.split() for line in lines) if len(parts) >= 3]


def filesystem_of(path: Path, mounts: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The (mount point, type) holding `path`, or its nearest existing parent."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    real = os.path.realpath(path)
    under = [(mount, kind) for mount, kind in mounts if real == mount or real.startswith(mount.rstrip("/") + "/")]
    return max(under, key=lambda m: len(m[0]), default=None)


def shared_filesystem_notes(paths: dict[str, Path], mounts: list[tuple[str, str]] | None = None) -> list[str]:
    """Says which of the job's paths its nodes can't share (node-local filesystems), and where this can't tell."""
    mounts = mount_table() if mounts is None else mounts
    local: dict[tuple[str, str], list[str]] = {}
    unknown: dict[tuple[str, str], list[str]] = {}
    for name, path in paths.items():
        fs = filesystem_of(path, mounts)
        kind = fs[1] if fs else "unknown"
        if kind in SHARED_FS:
            continue
        (local if kind in NODE_LOCAL_FS else unknown).setdefault(fs or ("?", kind), []).append(name)
    notes = [
        f"warning: {', '.join(names)} on a node-local filesystem ({kind} at {mount}): the job's nodes read and "
        "write their own copies, not this node's (and rank 0's checkpoints stay on its node); "
        "use a filesystem every node mounts (NFS, Lustre, GPFS, ...) unless the job runs on this machine"
        for (mount, kind), names in local.items()
    ]
    notes += [
        f"note: cannot tell whether {', '.join(names)} ({kind} at {mount}) is shared by the job's nodes; "
        "it must be, for the tokenized data and checkpoints"
        for (mount, kind), names in unknown.items()
    ]
    return notes


def job_paths(cfg: Config, environment: str, workdir: Path) -> dict[str, Path]:
    """Everything the job reads or writes on a filesystem, by the name a user knows it by."""
    paths = {"the Python environment": Path(environment), "the working directory": workdir}
    return paths | {key: Path(value) for key, value in path_keys(cfg).items()}


def check_data(cfg: Config) -> Corpus:
    """Tokenizer, tokenized dirs (shards checked against meta.json) and split sizes, as the trainer will find them."""
    from nanotron.data import open_corpus

    return open_corpus(cfg)
