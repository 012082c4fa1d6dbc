"""Every reader of user or on-disk input, fuzzed: whatever a file or flag holds, the reader loads it or refuses it
with a `UserError` of one line (one `error:` line and exit 2 at the boundary), never another exception (a traceback).

Property-based (hypothesis): each reader gets its valid input with values changed, removed or added, any JSON value,
its valid text cut short or with a byte changed, random bytes, and the hostile inputs below. `FUZZ` fixes the example
count and derandomizes, so CI runs the same examples every time, in bounded time. The readers run in this process.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import tempfile
import typing
from dataclasses import is_dataclass
from functools import reduce
from operator import getitem
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import REPO, TINY_MODEL
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanotron import records
from nanotron.config.parse import tomllib
from nanotron.errors import CheckpointError, DataError, UserError

FUZZ = settings(
    max_examples=150,
    derandomize=True,  # the same examples on every run: CI is deterministic
    deadline=None,
    database=None,  # nothing written to .hypothesis/
    suppress_health_check=[HealthCheck.too_slow],
)

# Strings a hand, another tool or bit rot puts in a file: empty, a lone surrogate (JSON's "\ud800" escape), control
# characters, a number spelled in other digits, a number too long for int(), paths that leave their folder.
ODD_TEXT = ["", " ", "\ud800", "a\udfff", "\x00", "a\nb", "²", "٣", "9" * 5000, "nan", "-1", "1_0", "../x", "/x"]
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXT))
NUMBERS = st.one_of(
    st.integers(),
    st.floats(),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
# Inputs no mutation of a valid file reaches: nesting deeper than the parser's recursion, an integer literal longer
# than int() takes, bytes that are not UTF-8 (a UTF-8-encoded surrogate among them), a NUL, nothing.
HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    b"1" * 5000,
    b'{"a": ' + b"9" * 5000 + b"}",
    b"\xff\xfe{}",
    b'{"a": "\xed\xa0\x80"}',
    b"\x00",
    b"",
]


def dump(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as JSON's extension writes them; surrogates escaped


def slots(node: Any, path: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON-like tree, the whole tree's (()) first."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [path] + [inner for key, child in children for inner in slots(child, (*path, key))]


@st.composite
def edited(draw, valid: Any, values=JSON) -> Any:
    """`valid` with one to three of its values (the whole of it included) replaced by another, removed, or given a
    new key beside them."""
    tree = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(slots(tree)))
        if not path:
            tree = draw(values)
            continue
        parent = reduce(getitem, path[:-1], tree)
        action = draw(st.sampled_from(["replace", "remove", "add"] if isinstance(parent, dict) else ["replace"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "remove":
            del parent[path[-1]]
        else:
            parent[draw(TEXT)] = draw(values)
    return tree


@st.composite
def damaged(draw, valid: bytes) -> bytes:
    """`valid` cut short, or with one byte changed."""
    at = draw(st.integers(0, max(0, len(valid) - 1)))
    if draw(st.booleans()):
        return valid[:at]
    return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1 :]


def json_files(valid: Any) -> st.SearchStrategy[bytes]:
    """What a JSON file meant to hold a record like `valid` may hold instead."""
    return st.one_of(
        edited(valid).map(dump),
        damaged(dump(valid)),
        JSON.map(dump),
        st.binary(max_size=32),
        st.sampled_from(HOSTILE),
    )


def loads_or_one_line(read, *args) -> Any:
    """What `read(*args)` returns, or None where it refused its input as the boundary needs: a UserError whose
    message is one line. Any other exception propagates: the failure hypothesis reports (a traceback for a user)."""
    try:
        return read(*args)
    except UserError as error:
        message = str(error)
        assert message and "\n" not in message and "\r" not in message, message
        return None


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One folder per module, its files rewritten by each example."""
    return tmp_path_factory.mktemp("fuzz")


def is_text(value: Any) -> bool:
    """A string a tokenizer or a UTF-8 file takes: lone surrogates are not text."""
    return isinstance(value, str) and not any("\ud800" <= c <= "\udfff" for c in value)


# ---- config: TOML files, command-line overrides, data.skip_samples ---------------------------------------------------

TINY_TOML = (REPO / "configs" / "tiny.toml").read_bytes()


def toml_value(value: Any) -> str:
    """`value` as TOML (inline tables and arrays, JSON-escaped strings and keys); None as an empty string."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(key)} = {toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # nan, inf and -inf as TOML spells them
    return json.dumps(value if value is not None else "")


def toml_document(tree: Any) -> bytes:
    """A tree's top-level keys as `key = value` lines (a section as an inline table): any tree is written."""
    pairs = tree.items() if isinstance(tree, dict) else []
    return "".join(f"{json.dumps(key)} = {toml_value(value)}\n" for key, value in pairs).encode()


def toml_files() -> st.SearchStrategy[bytes]:
    """configs/tiny.toml with values changed, removed or added, cut or with a byte changed, random text or bytes,
    and the hostile inputs."""
    return st.one_of(
        edited(tomllib.loads(TINY_TOML.decode())).map(toml_document),
        damaged(TINY_TOML),
        st.text(max_size=40).map(str.encode),
        st.binary(max_size=32),
        st.sampled_from(HOSTILE),
    )


@FUZZ
@given(content=toml_files())
@example(content=b"[training]\nsteps = 1\n\xff\xfe\n")
@example(content=b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n")
@example(content=b"[model]\nrms_norm_eps = 1" + b"0" * 400 + b"\n")
@example(content=b'[job]\n"a\\nb" = 1\n')
def test_any_toml_file_loads_or_is_one_line(folder, content):
    from nanotron.config import load_config

    (folder / "job.toml").write_bytes(content)
    loads_or_one_line(load_config, folder / "job.toml")


@functools.cache
def schema_keys() -> list[str]:
    """Every `section.key` of the config, and `section.table.key` for each key of a table such as [model.moe]
    (whose `section.table` is a key too)."""
    from nanotron.config.parse import SECTIONS

    keys = []
    for section, schema in SECTIONS.items():
        for name, hint in typing.get_type_hints(schema).items():
            inner = typing.get_type_hints(hint) if is_dataclass(hint) else {}
            keys += [f"{section}.{name}"] + [f"{section}.{name}.{key}" for key in inner]
    return keys


OVERRIDE_VALUES = st.one_of(
    TEXT,
    NUMBERS.map(str),
    st.sampled_from(["true", "off", "1e999", "0x10", "[]", "[1, 2]", "a:1", "a=b", "tiny", "mup", "none"]),
    st.lists(TEXT, max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
)


@st.composite
def command_lines(draw) -> list[str]:
    """configs/tiny.toml and one to three `--section.key=value` overrides of schema keys (or odd ones), or any
    arguments at all."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(TEXT, max_size=4))
    keys = st.one_of(st.sampled_from(schema_keys()), TEXT)
    pairs = draw(st.lists(st.tuples(keys, OVERRIDE_VALUES), min_size=1, max_size=3))
    return ["--config", str(REPO / "configs" / "tiny.toml"), *(f"--{key}={value}" for key, value in pairs)]


@FUZZ
@given(argv=command_lines())
@example(argv=["--training.steps=1e999"])
@example(argv=["--optimizer.lr=1" + "0" * 400])
@example(argv=["--job.seed=18446744073709551616"])
@example(argv=["--model.moe=4"])  # a table given a value
def test_any_command_line_loads_or_is_one_line(argv):
    from nanotron.config import load_config, parse_overrides

    parsed = loads_or_one_line(parse_overrides, argv)
    if parsed is not None:
        loads_or_one_line(load_config, *parsed)


WINDOWS = st.tuples(st.integers(0, 2**70), st.integers(0, 2**70)).map(lambda window: f"{window[0]}:{window[1]}")


@FUZZ
@given(entries=st.lists(st.one_of(WINDOWS, TEXT), min_size=1, max_size=3))
@example(entries=["0:9223372036854775808"])  # an end past 2^63 - 1, which no trainer_state.json takes back
def test_skip_samples_load_only_as_windows_a_checkpoint_takes_back_or_are_one_line(entries):
    """What data.skip_samples accepts is saved with every checkpoint: each window must be one trainer_state.json takes
    back (sample positions are int64), or a run could save a checkpoint it cannot resume from."""
    from nanotron.config import load_config
    from nanotron.data.skips import SampleSkips

    cfg = loads_or_one_line(load_config, None, [("data.skip_samples", ",".join(entries))])
    if cfg is not None:
        windows = SampleSkips.parse(cfg.data.skip_samples).to_list()
        assert records.problem(windows, [records.Window()]) is None, windows


# ---- evaluation task files (JSONL) -----------------------------------------------------------------------------------

GOLDS = st.one_of(st.integers(-1, 3), st.integers(-1, 3).map(str), st.sampled_from(["²", " 1 ", "9" * 5000]), JSON)
CHOICES = st.one_of(st.lists(TEXT, max_size=4), JSON)
ANY_TEXT = st.one_of(TEXT, JSON)
ITEMS = st.one_of(
    st.fixed_dictionaries({"context": ANY_TEXT, "choices": CHOICES, "gold": GOLDS}),
    st.fixed_dictionaries({"query": ANY_TEXT, "choices": CHOICES, "gold_index": st.one_of(GOLDS, st.lists(GOLDS))}),
    st.fixed_dictionaries({"ctx": ANY_TEXT, "endings": CHOICES, "label": GOLDS}),
    st.fixed_dictionaries(
        {
            "question": ANY_TEXT,
            "choices": st.fixed_dictionaries(
                {"text": CHOICES, "label": st.one_of(st.lists(st.sampled_from("ABCD"), max_size=4), JSON)}
            ),
            "answerKey": st.one_of(st.sampled_from("ABCDE"), JSON),
        }
    ),
    JSON,
)
VALID_ITEM = {"context": "The cat", "choices": ["runs", "sees far"], "gold": 1}
VALID_TASK = dump(VALID_ITEM) + b"\n"


def jsonl(items: list) -> bytes:
    return b"".join(dump(item) + b"\n" for item in items)


@FUZZ
@given(
    content=st.one_of(
        st.lists(ITEMS, max_size=4).map(jsonl),
        st.lists(edited(VALID_ITEM), min_size=1, max_size=3).map(jsonl),
        damaged(VALID_TASK * 2),
        st.binary(max_size=32),
        st.sampled_from(HOSTILE).map(lambda hostile: VALID_TASK + hostile + b"\n"),
    )
)
@example(content=VALID_TASK + b"\xff\xfe\n")  # not UTF-8
@example(content=VALID_TASK + b"[" * 100_000 + b"\n")  # nested deeper than the parser's recursion
@example(content=dump({"context": "a\ud800", "choices": ["b", "c"], "gold": 0}))  # a lone surrogate: no tokenizer's
@example(content=dump({"ctx": "a", "endings": ["b", "c"], "label": 1}))  # an int label
@example(content=dump({"ctx": "a", "endings": ["b", "c"], "label": "²"}))
@example(content=dump({"question": "q", "choices": {"text": ["b", "c"], "label": 5}, "answerKey": "A"}))
@example(content=dump({"context": "a" * 2**20, "choices": ["b", "c"], "gold": 0}))  # a huge line
def test_any_task_file_loads_as_items_to_score_or_is_one_line(folder, content):
    from nanotron.evaluation.tasks import load_task

    (folder / "task.jsonl").write_bytes(content)
    task = loads_or_one_line(load_task, "fuzz", folder / "task.jsonl")
    for item in task.items if task is not None else []:
        assert is_text(item.context) and all(is_text(choice) and choice for choice in item.choices), item
        assert len(item.choices) >= 2 and type(item.gold) is int and 0 <= item.gold < len(item.choices), item


# ---- meta.json of a tokenized dir ------------------------------------------------------------------------------------


def token_files() -> dict[str, bytes]:
    """The files of a tokenized dir of one document per split (uint16 tokens), as `nanotron tokenize` names them."""
    from nanotron.tokenize.format import shard_name

    files = {}
    for split, tokens in (("train", [1, 2, 0]), ("val", [3, 0])):
        files[shard_name(split, 0, "bin")] = np.array(tokens, "<u2").tobytes()
        files[shard_name(split, 0, "idx")] = np.array([len(tokens)], "<u8").tobytes()
    return files


def token_meta() -> dict:
    """meta.json of `token_files`, as `nanotron tokenize` writes it (the fields its readers use)."""
    from nanotron.tokenize.format import FORMAT, VERSION

    files = {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in token_files().items()
    }
    counts = {"train": 3, "val": 2}
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": "uint16",
        "eos_id": 0,
        "vocab_size": 4,
        "tokenizer": {"fingerprint": "f", "path": "tokenizer.json"},
        "documents": {"train": 1, "val": 1},
        "tokens": counts,
        "shards": [{"tokens": counts, "files": files}],
    }


@pytest.fixture(scope="module")
def tokens(folder) -> Path:
    (folder / "tokens").mkdir()
    for name, data in token_files().items():
        (folder / "tokens" / name).write_bytes(data)
    return folder / "tokens"


META = token_meta()
FILES = META["shards"][0]["files"]


@FUZZ
@given(content=json_files(META))
@example(content=HOSTILE[0])
@example(content=dump({key: value for key, value in META.items() if key != "documents"}))  # what --verify prints
@example(content=dump(META | {"shards": [{"tokens": META["tokens"], "files": {"x\x00": FILES["train-00000.bin"]}}]}))
@example(content=dump(META | {"shards": [{"tokens": META["tokens"], "files": {"train-00000.bin": {"bytes": 6}}}]}))
def test_any_meta_json_opens_for_training_and_verification_or_is_one_line(tokens, content):
    """Read as training opens a dir (then reads every token) and as `nanotron tokenize --verify` checks it."""
    from nanotron.commands.tokenize import verify
    from nanotron.data.tokens import open_tokenized

    (tokens / "meta.json").write_bytes(content)
    tokenizer = SimpleNamespace(fingerprint="f", path="tokenizer.json")
    data = loads_or_one_line(open_tokenized, tokens, "data.path", tokenizer, True)
    for stream in (data.train, data.val) if data is not None else ():
        if stream.total:
            loads_or_one_line(stream.read, 0, stream.total, data.meta["vocab_size"])
    loads_or_one_line(verify, tokens)


# ---- trainer_state.json, skipped_samples.json, wandb.json (nanotron.records) -----------------------------------------


@functools.cache
def tiny_config() -> Any:
    from nanotron.config import load_config

    return load_config(REPO / "configs" / "tiny.toml", [("job.out_dir", "/nonexistent/runs")])


def fresh_progress(**counters: int) -> Any:
    """The Progress (`counters` and stability state) of a fresh run of configs/tiny.toml."""
    from nanotron.stability import Stability
    from nanotron.trainer import Progress, TrainState

    cfg = tiny_config()
    return Progress(TrainState(**counters), Stability(cfg), cfg.checkpoint_dir)


def trainer_state() -> dict:
    """trainer_state.json of a checkpoint at step 8 of that run, with a skipped window, as the trainer writes it."""
    saved = fresh_progress(step=8, consumed_samples=64, consumed_tokens=8192).state_dict()
    saved["stability"]["skipped_samples"] = [[16, 24]]
    layout = {"dp": 1, "cp": 1, "ep": 1, "tp": 1, "pp": 1, "zero_stage": 0}
    return saved | {"global_batch_size": 8, "world_size": 1, "layout": layout}


# A spike statistic beyond the float range (math.isfinite of it is an OverflowError).
DETECTOR = {"observed": 8, "stats": {"loss": [10**400, 0.0, 1.0], "grad_norm": [1.0, 0.0, 1.0]}}
DETECTOR["max_z"] = {"loss": 0.0, "grad_norm": 0.0}
STABILITY = {"detector": DETECTOR, "skipped_samples": [], "rollbacks": 0}


@FUZZ
@given(content=st.deferred(lambda: json_files(trainer_state())))
@example(content=HOSTILE[0])
@example(content=dump({"step": 8, "consumed_samples": 64, "consumed_tokens": 8192, "stability": STABILITY}))
def test_any_trainer_state_json_loads_into_a_run_or_is_one_line(folder, content):
    """Read as a resume reads it: the schema's check (`records.read`), then loaded into a fresh run's progress."""
    (folder / "trainer_state.json").write_bytes(content)
    state = loads_or_one_line(records.read, folder / "trainer_state.json", records.TRAINER_STATE, CheckpointError)
    if state is not None:
        loads_or_one_line(fresh_progress().load_state_dict, state)


@FUZZ
@given(content=json_files({"windows": [[16, 24], [40, 48]]}))
@example(content=b'{"windows": [[0, 9223372036854775808]]}')
def test_any_skipped_samples_json_loads_as_windows_or_is_one_line(folder, content):
    from nanotron.data.skips import SKIPPED_SAMPLES, read_run_skips

    (folder / SKIPPED_SAMPLES).write_bytes(content)
    skips = loads_or_one_line(read_run_skips, folder)
    if skips is not None:
        assert records.problem(skips.to_list(), [records.Window()]) is None


@FUZZ
@given(content=json_files({"id": "a1b2c3d4e5f6"}))
@example(content=b"[1, 2]")
def test_any_wandb_json_loads_as_a_run_id_or_is_one_line(folder, content):
    from nanotron.metrics.wandb_run import STATE_FILE

    (folder / STATE_FILE).write_bytes(content)
    state = loads_or_one_line(records.read, folder / STATE_FILE, records.WANDB_STATE, UserError)
    assert state is None or isinstance(state["id"], str)


# ---- checksums.json of a checkpoint ----------------------------------------------------------------------------------


CHECKPOINT = {"__0_0.distcp": b"weights", "sub/config.toml": b"[model]\n"}  # a checkpoint's files, in short


def write_checkpoint(step: Path) -> dict:
    """CHECKPOINT's files and their manifest written in `step`; the manifest's record."""
    from nanotron.checkpoint import integrity

    for name, data in CHECKPOINT.items():
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(data)
    integrity.write(step, {})
    return json.loads((step / integrity.CHECKSUM_FILE).read_text())


def manifest() -> dict:
    with tempfile.TemporaryDirectory() as step:
        return write_checkpoint(Path(step))


@FUZZ
@given(content=st.deferred(lambda: json_files(manifest())), allow_missing=st.booleans())
@example(content=HOSTILE[0], allow_missing=False)
@example(content=dump({"9" * 5000: "x"}), allow_missing=True)  # a name longer than the file system takes
def test_any_checksums_json_verifies_or_is_one_line(folder, content, allow_missing):
    from nanotron.checkpoint import integrity

    step = folder / "step-8"
    if not step.is_dir():
        write_checkpoint(step)
    (step / integrity.CHECKSUM_FILE).write_bytes(content)
    loads_or_one_line(integrity.check, step, allow_missing, "--allow_unverified", True)


# ---- config.json of a Hugging Face model -----------------------------------------------------------------------------


def hf_config() -> dict:
    """config.json as `to-hf` writes it for TINY_MODEL's shape."""
    import torch

    from nanotron.config import load_config, parse_overrides
    from nanotron.hf.llama import hf_config

    return hf_config(load_config(*parse_overrides(TINY_MODEL)).model, torch.float32, None, False)


LLAMA = hf_config()
MIXTRAL = LLAMA | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}


@FUZZ
@given(content=st.sampled_from([LLAMA, MIXTRAL]).flatmap(json_files))
@example(content=HOSTILE[0])
@example(content=dump(LLAMA | {"rms_norm_eps": 10**400}))  # an integer beyond any float
@example(content=dump(LLAMA | {"rope_theta": 10**400, "rope_parameters": None}))
def test_any_hf_config_json_imports_or_is_one_line(folder, content):
    """`convert from-hf` of a folder with that config.json and no weights: refused at the config, or at the weights
    the config asks for."""
    from nanotron.hf.importer import from_hf

    (folder / "hf").mkdir(exist_ok=True)
    (folder / "hf" / "config.json").write_bytes(content)
    assert loads_or_one_line(from_hf, folder / "hf", folder / "imported") is None
    assert not (folder / "imported").exists()


def refuse(error: Exception):
    raise error


def test_the_property_holds_only_for_user_errors_of_one_line():
    """The harness itself: a UserError of two lines, or any other exception, fails the property."""
    assert loads_or_one_line(refuse, DataError("one line")) is None
    with pytest.raises(AssertionError):
        loads_or_one_line(refuse, DataError("two\nlines"))
    with pytest.raises(OverflowError):
        loads_or_one_line(math.exp, 1000)
