"""The [data] section: the tokenized datasets and their blend (`[[data.datasets]]`), the tokenizer, skipped
windows of the sample order."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.config.option import opt


@dataclass
class DatasetConfig:
    """One `[[data.datasets]]` table; on the command line `--data.datasets=PATH:WEIGHT,PATH:WEIGHT`."""

    path: str = opt("", "a `nanotron tokenize` output dir")
    weight: float = opt(1.0, "share of the training samples, relative to the other datasets' weights (> 0)")

    @staticmethod
    def from_text(text: str) -> dict[str, str]:
        path, colon, weight = text.rpartition(":")
        return {"path": path, "weight": weight} if colon else {"path": text}


@dataclass
class DataConfig:
    path: str = opt("data/tokenized/shakespeare", "a `nanotron tokenize` output dir")
    datasets: list[DatasetConfig] = opt(
        [], "weighted blend of datasets, [[data.datasets]] tables with path and weight; when given, replaces path"
    )
    tokenizer: str = opt("data/tokenizer", "tokenizer.json file or Hugging Face tokenizer dir")
    num_workers: int = opt(
        0,
        "DataLoader worker processes per rank; at most 32: each is a process (8 ranks x 32 = 256 per node, more than "
        "its cores), and a sample is a read of memory-mapped tokens, whose latency a few workers hide",
        min=0,
        max=32,
    )
    skip_samples: list[str] = opt(
        [],
        "windows of the global sample order never trained on, START:END (end excluded), e.g. 4096:8192; rollbacks "
        "add theirs to <run dir>/skipped_samples.json",
    )
