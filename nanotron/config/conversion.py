"""What converting another framework's config needs: its file read key by key (each value type-checked, each key
accounted for, so none is dropped silently) and this project's tables, with the source keys behind each of its keys
so that a config this project refuses is reported in the source's terms."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanotron.config.parse import SECTIONS, load_config, toml_text
from nanotron.errors import ConfigError
from nanotron.records import finite

KeyPath = tuple[str | int, ...]
ANY = None  # in a table of known keys: no value of the key changes anything here
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
_KIND_NAMES[list] = "a list"


def key_name(path: KeyPath) -> str:
    """`data_stages[0].data.seed` for ("data_stages", 0, "data", "seed")."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def parse_key(key: str) -> KeyPath:
    return tuple(int(part[1:-1]) if part[0] == "[" else part for part in re.findall(r"\[\d+\]|[^.\[\]]+", key))


def show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def read_yaml(path: Path, expected: str) -> dict[str, Any]:
    """The file's top-level mapping (`expected` says of what); anything else is a ConfigError naming the file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read it ({error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({getattr(error, 'problem', None) or error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected {expected}, got {show(data)}")
    return data


class Source:
    """The source config as read so far: `get` returns a key's value checked against a type and marks it read."""

    def __init__(self, data: dict[str, Any], file: str):
        self.data = data
        self.file = file
        self.read = set()

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value at `key` (e.g. "data_stages[0].data.seed"), or `default` when absent or null."""
        path = parse_key(key)
        self.read.add(path)
        value = self._node(path)
        if value is None:
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if kinds == (float,) and isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not any(_is(value, k) for k in kinds):
            self.fail(path, value, kinds)
        return float(value) if kinds == (float,) else value

    def peek(self, key: str, kind: type = dict) -> Any:
        """The mapping (or list) at `key`, None when absent or null; unlike `get`, its keys are not marked read."""
        path = parse_key(key)
        value = self._node(path)
        if value is not None and not isinstance(value, kind):
            self.fail(path, value, (kind,))
        return value

    def take(self, key: str) -> Any:
        """The raw value at `key`, all of it marked read: for a part of the source that is not carried over."""
        path = parse_key(key)
        self.read.add(path)
        return self._node(path)

    def fail(self, path: KeyPath, value: Any, kinds: tuple[type, ...]) -> None:
        expected = " or ".join(_KIND_NAMES[kind] for kind in kinds)
        raise ConfigError(f"{self.file}: {key_name(path)}: expected {expected}, got {show(value)}")

    def leaves(self) -> Iterator[tuple[KeyPath, Any]]:
        yield from _leaves(self.data, ())

    def unread(self, known: dict[str, tuple[tuple | None, str]], unknown: str) -> Iterator[tuple[KeyPath, str]]:
        """A note for each key nothing read and whose value changes something here. `known`: a key (list indices
        left out) -> (its values that mean what this project does anyway, or ANY; why other values don't carry
        over); `unknown`: why a key not in it doesn't. A null value is unset: nothing to carry over."""
        for path, value in self.leaves():
            if value is None or any(path[:n] in self.read for n in range(1, len(path) + 1)):
                continue
            agrees, why = known.get(re.sub(r"\[\d+\]", "", key_name(path)), ((), unknown))
            if agrees is ANY or _normal(value) in [_normal(v) for v in agrees]:
                continue
            yield path, f"{key_name(path)}={show(value)} not carried over: {why}"

    def _node(self, path: KeyPath) -> Any:
        node = self.data
        for depth, part in enumerate(path):
            if isinstance(part, int) and isinstance(node, list) and part < len(node):
                node = node[part]
            elif isinstance(part, str) and isinstance(node, dict):
                node = node.get(part)
            elif node is not None and isinstance(part, str):
                self.fail(path[:depth], node, (dict,))
            else:
                return None
        return node


class Conversion:
    """This project's tables being filled from a `Source`, the source keys behind each key, and the notes."""

    def __init__(self, source: Source):
        self.src, self.file = source, source.file
        self.tables: dict[str, dict[str, Any]] = {}
        self.sources: dict[str, tuple[str, ...]] = {}
        self.notes: list[tuple[KeyPath, str]] = []

    def set(self, key: str, value: Any, *originals: str) -> None:
        """Sets `key` (e.g. "model.moe.top_k") to `value`, taken from the source keys `originals`."""
        *tables, name = key.split(".")
        table = self.tables
        for part in tables:
            table = table.setdefault(part, {})
        table[name] = value
        self.sources[key] = originals

    def copy(self, original: str, ours: str, kind: type, default: Any = None) -> Any:
        """Sets `ours` to the value at `original` (or `default`, the source's) when there is one; returns it."""
        value = self.src.get(original, kind, default)
        if value is not None:
            self.set(ours, value, original)
        return value

    def required(self, key: str, kind: type) -> Any:
        value = self.src.get(key, kind)
        if value is None:
            raise ConfigError(f"{self.file}: {key}: missing; the original framework requires it too")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: str) -> str:
        """An enum of the source, spelled in any case (REDUCE_SCATTER), as its lower-case name."""
        value = self.src.get(key, str, default)
        if value.lower() not in options:
            raise ConfigError(f"{self.file}: {key}: expected one of {', '.join(options)}, got {show(value)}")
        return value.lower()

    def note(self, key: str, text: str) -> None:
        self.notes.append((parse_key(key), text))

    def finish(self, known: dict[str, tuple[tuple | None, str]], unknown: str) -> None:
        """Adds a note for each key no mapping read (see `Source.unread`); orders the notes as the file's keys."""
        self.notes += self.src.unread(known, unknown)
        order = [path for path, _ in self.src.leaves()]
        first = {}
        for note, _ in self.notes:
            first[note] = next((i for i, path in enumerate(order) if path[: len(note)] == note), len(order))
        self.notes.sort(key=lambda note: first[note[0]])

    def text(self, header: str) -> str:
        """The TOML, headed by `header` and the notes, as comments."""
        lines = [f"# {header}"]
        if self.notes:
            lines.append("# Not carried over, or to do before training (each also printed on stderr):")
            lines += [f"# note: {text}" for _, text in self.notes]
        return "\n".join(lines) + "\n\n" + toml_text({s: self.tables[s] for s in SECTIONS if s in self.tables})

    def check(self, text: str) -> None:
        """Loads `text` as training would; a refusal names the source keys behind the keys its message names."""
        with tempfile.TemporaryDirectory() as folder:
            file = Path(folder) / "converted.toml"
            file.write_text(text, encoding="utf-8")
            try:
                load_config(file)
            except ConfigError as error:
                message = str(error)
                ours = [key for key in self.sources if re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message)]
                originals = ", ".join(dict.fromkeys(o for key in ours for o in self.sources[key])) or "its config"
                raise ConfigError(f"{self.file}: {originals}: refused by this project: {message}") from None


def _is(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return finite(value)
    return isinstance(value, kind)


def _normal(value: Any) -> Any:
    """Enum names are case-insensitive in the original (REDUCE_SCATTER, NUM_LAYERS); 0 is not False."""
    return value.lower() if isinstance(value, str) else (type(value), value)


def _leaves(node: Any, path: KeyPath) -> Iterator[tuple[KeyPath, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(node, list) and any(isinstance(item, dict) for item in node):
        for index, item in enumerate(node):
            yield from _leaves(item, (*path, index))
    else:
        yield path, node
