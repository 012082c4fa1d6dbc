"""What the original nanotron's run trained on (its tokenizer and data stages) as this project's [data]: the first
stage only, and the `nanotron tokenize` commands that write the datasets it names (see `from_nanotron`)."""

from __future__ import annotations

import re
from pathlib import Path

from nanotron.config.conversion import Conversion, show
from nanotron.errors import ConfigError

TOKENIZED = "data/tokenized"  # where the notes' `nanotron tokenize` commands write


def tokenizer(c: Conversion) -> None:
    name = c.copy("tokenizer.tokenizer_name_or_path", "data.tokenizer", str)
    if name is not None and not Path(name).expanduser().exists():
        c.note(
            "tokenizer.tokenizer_name_or_path",
            f"tokenizer.tokenizer_name_or_path={show(name)}: tokenizers are read from local files here; fetch its "
            f"tokenizer.json and tokenizer_config.json into {name}/ (`huggingface-cli download {name} tokenizer.json "
            f"tokenizer_config.json --local-dir {name}`)",
        )


def data_stages(c: Conversion) -> None:
    """The first stage becomes [data]; a run here trains on one data mix, so each later stage is a note. Before
    April 2024 the original had one top-level `data` section instead."""
    stages = c.src.peek("data_stages", list) or []
    starts = [c.required(f"data_stages[{i}].start_training_step", int) for i in range(len(stages))]
    for index in sorted(range(len(stages)), key=starts.__getitem__)[1:]:
        name = c.src.take(f"data_stages[{index}]").get("name")
        c.note(
            f"data_stages[{index}]",
            f"data_stages[{index}] ({show(name)}, from step {starts[index]}) not carried over: a run here trains on "
            "one data mix; train the stage as a run of its own",
        )
    if not stages:
        if c.src.peek("data") is not None:
            _data(c, "data")
        return
    first = f"data_stages[{starts.index(min(starts))}]"
    c.src.get(f"{first}.name", str)
    c.copy(f"{first}.sequence_length", "training.seq_len", int)
    _data(c, f"{first}.data")


def _data(c: Conversion, data: str) -> None:
    seed = c.src.get(f"{data}.seed", int)
    if seed is not None and seed != c.src.get("general.seed", int, 42):
        c.note(f"{data}.seed", f"{data}.seed={seed} not carried over: job.seed orders the data here")
    c.copy(f"{data}.num_loading_workers", "data.num_workers", int, 1)
    dataset = f"{data}.dataset"
    keys = c.src.peek(dataset) or {}
    if "hf_dataset_or_datasets" in keys:
        _hub_dataset(c, dataset)
    elif "dataset_folder" in keys:
        _nanoset(c, dataset)
    elif not keys:
        c.note(dataset, f"{dataset}=null (random tokens) not carried over: point data.path at a tokenized dataset")


def _hub_dataset(c: Conversion, dataset: str) -> None:
    """A hub dataset the original tokenized while training (its "train" split): `nanotron tokenize` writes it first."""
    key = f"{dataset}.hf_dataset_or_datasets"
    name = c.src.get(key, (str, dict, list))
    if not isinstance(name, str):
        c.src.take(dataset)
        c.note(
            key,
            f"{key}={show(name)} not carried over: a mix of hub datasets (a fraction of each one's documents there); "
            "tokenize each and blend them with [[data.datasets]] weights",
        )
        return
    path = f"{TOKENIZED}/{_slug(name)}"
    c.set("data.path", path, key)
    column = c.src.get(f"{dataset}.text_column_name", str)
    config = c.src.get(f"{dataset}.hf_dataset_config_name", str)
    flags = f" --text_column {column}" if column not in (None, "text") else ""
    flags += f" --hub_config {config}" if config else ""
    c.note(key, f"{key}={show(name)}: tokenize it before training here: {_tokenize(c, name, path)}{flags}")


def _nanoset(c: Conversion, dataset: str) -> None:
    """Datatrove-tokenized folders (a Nanoset): the same blend here, of `nanotron tokenize` dirs."""
    key, weights_key = f"{dataset}.dataset_folder", f"{dataset}.dataset_weights"
    folders, weights = c.src.get(key, (str, list, dict)), c.src.get(weights_key, list)
    if isinstance(folders, dict):  # {folder: weight}, the older spelling
        weights = list(folders.values())
        folders = list(folders)
        weights_key = key
    folders = [folders] if isinstance(folders, str) else folders
    if not all(isinstance(folder, str) for folder in folders):
        raise ConfigError(f"{c.file}: {key}: expected a folder or a list of folders, got {show(folders)}")
    if weights is None and len(folders) > 1:
        c.note(
            key,
            f"{key}: no dataset_weights: shares proportional to the datasets' sizes there, equal weights here; set "
            "each [[data.datasets]] weight to its dataset's share",
        )
    weights = [1.0] * len(folders) if weights is None else weights
    if len(weights) != len(folders) or not all(_number(weight) for weight in weights):
        raise ConfigError(f"{c.file}: {weights_key}: expected a number for each folder, got {show(weights)}")
    paths = [f"{TOKENIZED}/{_slug(folder)}" for folder in folders]
    if len(paths) == 1:
        c.set("data.path", paths[0], key)
    else:
        blend = [{"path": path, "weight": float(weight)} for path, weight in zip(paths, weights)]
        c.set("data.datasets", blend, key, weights_key)
    commands = "; ".join(_tokenize(c, "DOCUMENTS", path) for path in paths)
    c.note(key, f"{key}: datatrove token files are not read here; tokenize the documents again: {commands}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tokenize(c: Conversion, source: str, path: str) -> str:
    return (
        f"nanotron tokenize {source} --tokenizer {c.tables.get('data', {}).get('tokenizer', 'TOKENIZER')} --out {path}"
    )


def _slug(name: str) -> str:
    """A dataset's name or folder as one path component: stas/openwebtext-10k -> stas_openwebtext-10k."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("._")
