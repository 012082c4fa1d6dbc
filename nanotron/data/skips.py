"""Windows of the global sample order that training never reads: set by hand (`data.skip_samples`) or by a
rollback past a loss spike (`<run dir>/skipped_samples.json`, and every checkpoint).

The order stays a pure function of the sample index: the k-th trained sample is the k-th data position outside
every window, found by walking the (few, sorted, disjoint) windows: O(windows) per sample, never O(corpus). A
window only ever starts at or after the position training has reached, so the samples already trained keep
their positions and every layout and every resume agrees on what comes next.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanotron import records
from nanotron.config.validate import sample_windows
from nanotron.errors import DataError
from nanotron.io import write_atomic

SKIPPED_SAMPLES = "skipped_samples.json"


class SampleSkips:
    """Sorted, disjoint, merged half-open windows [start, end) of data positions."""

    def __init__(self, windows: list[tuple[int, int]] = ()) -> None:
        self.windows: list[tuple[int, int]] = []
        for start, end in windows:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        merged = sorted([*self.windows, (start, end)])
        self.windows = []
        for a, b in merged:
            if self.windows and a <= self.windows[-1][1]:
                self.windows[-1] = (self.windows[-1][0], max(self.windows[-1][1], b))
            else:
                self.windows.append((a, b))

    def update(self, other: SampleSkips) -> None:
        for start, end in other.windows:
            self.add(start, end)

    def position(self, k: int) -> int:
        """The data position of the k-th trained sample."""
        for start, end in self.windows:
            if k < start:
                break
            k += end - start
        return k

    def __len__(self) -> int:
        return sum(end - start for start, end in self.windows)

    def to_list(self) -> list[list[int]]:
        return [[start, end] for start, end in self.windows]

    @classmethod
    def parse(cls, entries: list[str]) -> SampleSkips:
        """`data.skip_samples` entries, START:END each (checked by the config's validation)."""
        return cls(sample_windows(entries))


def read_run_skips(run_dir: Path) -> SampleSkips:
    """The windows a rollback of this run recorded (none if it never rolled back)."""
    path = run_dir / SKIPPED_SAMPLES
    if not path.exists():
        return SampleSkips()
    hint = "restore it, or delete it to forget its skipped windows"
    return SampleSkips(records.read(path, records.SKIPPED_WINDOWS, DataError, hint)["windows"])


def write_run_skips(run_dir: Path, skips: SampleSkips) -> None:
    write_atomic(run_dir / SKIPPED_SAMPLES, json.dumps({"windows": skips.to_list()}) + "\n")
