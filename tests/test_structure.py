"""The package's shape: imports only go down the layers, a training process loads only what trains, private torch
names only behind two doors, no import cycles, a model that knows nothing of parallelism, files you can hold in
your head (functions of at most ~80 lines; a file over ~500 lines a smell to discuss, not a wall to pack code
under). Read from the source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_MODEL

PACKAGE = Path(__file__).resolve().parents[1] / "nanotron"
REPO = PACKAGE.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[str]:
    """Every module name an import statement in `path` can load, relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def import_graph() -> dict[str, set[str]]:
    """nanotron module -> the nanotron modules it imports (the deepest existing module of each name)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in imported_names(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_nanotron():
    graph = import_graph()
    assert {"nanotron.checkpoint.manager", "nanotron.config", "nanotron.parallel.runner"} <= graph["nanotron.trainer"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_models_never_import_torch_distributed():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in (PACKAGE / "models").rglob("*.py")
        for name in imported_names(path)
        if name == "torch.distributed" or name.startswith("torch.distributed.")
    ]
    assert not offenders


def test_checkpointing_knows_nothing_of_the_trainer():
    for path in (PACKAGE / "checkpoint").rglob("*.py"):
        assert not [n for n in imported_names(path) if n.startswith("nanotron.train")], path


# trainer.py is the one module that holds the trainer; the command that builds and runs it may import it.
TRAINER = PACKAGE / "trainer.py"
TRAINER_COMMAND = PACKAGE / "commands" / "train.py"


def _names_the_trainer(annotation: ast.AST | None) -> bool:
    """An annotation that mentions `Trainer` (as a name, an attribute or inside a string)."""
    return annotation is not None and any(
        (isinstance(n, ast.Name) and n.id == "Trainer")
        or (isinstance(n, ast.Attribute) and n.attr == "Trainer")
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"\bTrainer\b", n.value))
        for n in ast.walk(annotation)
    )


def trainer_references(path: Path) -> list[str]:
    """Where `path` holds or receives the trainer: a parameter named `trainer` (whatever its type), an attribute
    `.trainer`, an annotation naming `Trainer`, an import of nanotron.trainer (the training command's aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.parent.name}/{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.arg) and (node.arg == "trainer" or _names_the_trainer(node.annotation)):
            found.append(f"{where}: parameter {node.arg}")
        elif isinstance(node, ast.Attribute) and node.attr == "trainer":
            found.append(f"{where}: attribute .trainer")
        elif isinstance(node, ast.AnnAssign) and _names_the_trainer(node.annotation):
            found.append(f"{where}: annotation {ast.unparse(node.annotation)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _names_the_trainer(node.returns):
            found.append(f"{where}: {node.name} returns {ast.unparse(node.returns)}")
        elif path != TRAINER_COMMAND and isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [f"{module}.{a.name}" if module else a.name for a in node.names] + [module or ""]
            if any(name == "nanotron.trainer" or name.startswith("nanotron.trainer.") for name in names):
                found.append(f"{where}: imports nanotron.trainer")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "class Guard:\n    def __init__(self, trainer):\n        self.trainer = trainer\n",
        "from typing import Any\ndef check(trainer: Any) -> None: ...\n",
        "def check(owner: Trainer) -> None: ...\n",
        "def check(owner: 'nanotron.trainer.Trainer') -> None: ...\n",
        "def check(state) -> int:\n    return state.trainer.step\n",
        "owner: Trainer | None = None\n",
        "from nanotron.trainer import Trainer\n",
        "import nanotron.trainer\n",
        "from nanotron import trainer\n",
    ],
)
def test_trainer_reference_check_finds_each_spelling(tmp_path, source):
    (tmp_path / "m.py").write_text(source)
    assert trainer_references(tmp_path / "m.py")


def test_trainer_reference_check_leaves_other_names_alone(tmp_path):
    (tmp_path / "m.py").write_text("def train_tokenizer(texts):\n    trainer = BpeTrainer()\n    return trainer\n")
    assert not trainer_references(tmp_path / "m.py")


def test_no_module_holds_or_receives_the_trainer():
    """Services get what they need passed in and hand back decisions the trainer carries out (a class that takes
    the trainer and reaches into its attributes hides an import cycle from the layer check)."""
    found = [ref for path in PACKAGE.rglob("*.py") if path != TRAINER for ref in trainer_references(path)]
    assert not found, "\n".join(found)


MAX_FUNCTION_LINES = 80
LONG_FILE_LINES = 500
# A file over LONG_FILE_LINES is a smell to discuss, not a wall to pack code under: one that stays long names here
# why it is still one concept (path from the repository root -> reason). The list stays true: an entry whose file
# has shrunk under the mark fails too.
LONG_FILES: dict[str, str] = {
    "nanotron/plan/memory.py": "the per-rank memory model: each function is one part of one sum over the same stage "
    "shapes (parameter shards, optimizer state, working copies, activations, logits, buffers, RoPE tables), which "
    "the report, the search and --check read together",
}


def long_functions(path: Path, root: Path) -> list[str]:
    """Every function or method of `path` longer than MAX_FUNCTION_LINES, from its `def` line to its last line
    (decorators not counted), as `path:function (N lines)`."""
    return [
        f"{path.relative_to(root)}:{node.name} ({length} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]


def long_file_findings(package: Path, long_files: dict[str, str]) -> list[str]:
    """Files over LONG_FILE_LINES that LONG_FILES does not explain, and LONG_FILES entries no longer long."""
    lengths = {str(p.relative_to(package.parent)): len(p.read_text().splitlines()) for p in package.rglob("*.py")}
    unexplained = [
        f"{path} ({n} lines): split it where a concept ends, or say in LONG_FILES why it is one concept"
        for path, n in sorted(lengths.items())
        if n > LONG_FILE_LINES and path not in long_files
    ]
    stale = [
        f"{path} is in LONG_FILES but has {lengths.get(path, 0)} lines (not over {LONG_FILE_LINES}): drop the entry"
        for path in sorted(long_files)
        if lengths.get(path, 0) <= LONG_FILE_LINES
    ]
    return unexplained + stale


def test_every_function_fits_a_screen_or_two():
    offenders = [f for path in sorted(PACKAGE.rglob("*.py")) for f in long_functions(path, PACKAGE.parent)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_a_long_file_says_why_it_is_one_concept():
    findings = long_file_findings(PACKAGE, LONG_FILES)
    assert not findings, "\n".join(findings)


# Lowest first; a module may import from its own layer and the layers below, never from a layer above. A module
# belongs to the layer of the longest prefix that names it.
LAYERS = [
    [
        "nanotron",
        "nanotron.io",
        "nanotron.errors",
        "nanotron.signals",
        "nanotron.hashing",
        "nanotron.console",
        "nanotron.config",
        "nanotron.records",
        "nanotron.step_end",  # what a step's end looks like to the services, whatever their layer
    ],
    ["nanotron.gpu", "nanotron.tokenize", "nanotron.models"],
    ["nanotron.parallel", "nanotron.optim"],
    ["nanotron.data"],
    [  # services, and the libraries that read what training wrote
        "nanotron.checkpoint",
        "nanotron.lock",
        "nanotron.watch",
        "nanotron.stability",
        "nanotron.evaluation",
        "nanotron.metrics",
        "nanotron.hf",
    ],
    ["nanotron.trainer"],
    ["nanotron.plan", "nanotron.coord_check", "nanotron.launch"],  # what only commands use
    # Entry points: every command in nanotron.commands, and the module spellings users and launchers type.
    ["nanotron.commands", "nanotron.__main__", "nanotron.train", "nanotron.launch.__main__"],
]
ENTRY_POINTS = ["nanotron.commands", "nanotron.__main__", "nanotron.train", "nanotron.launch.__main__"]
# What a training process never runs, so never loads (the local launcher, `launch.torchrun`, it does).
NOT_THE_TRAINERS = [
    "nanotron.launch.cluster",
    "nanotron.launch.flags",
    "nanotron.launch.checks",
    "nanotron.plan",
    "nanotron.coord_check",
    "nanotron.hf",
    "nanotron.metrics.report",
    "nanotron.data.demo",
    "nanotron.tokenize.bpe",
]
PRIVATE_DOORS = {PACKAGE / "parallel" / "torch_private.py", PACKAGE / "checkpoint" / "torch_private.py"}
# A private name reached through torch's modules (in code or in a pickle allow-list string), or one of the private
# methods of torch objects this project has needed (reached through a variable, so no module prefix shows).
PRIVATE_TORCH = re.compile(
    r"\b(torch|dist|dcp|c10d|distributed_c10d|inductor_config)(\.\w+)*\._[A-Za-z]"
    r"|\.(_flatten|_set_pg_timeout|_state_ctx|_fsdp_param_groups|_root_post_backward_\w+|_micro_pipeline_tp)\b"
)


def layer_of(module: str) -> int:
    matches = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer if _under(module, prefix)]
    assert matches, f"{module} is in no layer of LAYERS: add it where it belongs"
    return max(matches)[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or (prefix != "nanotron" and module.startswith(prefix + "."))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]


def test_layer_check_finds_an_upward_import():
    assert upward_imports({"nanotron.models.llama": {"nanotron.parallel.tensor"}, "nanotron.parallel.tensor": set()})
    assert not upward_imports({"nanotron.trainer": {"nanotron.parallel.runner"}, "nanotron.parallel.runner": set()})


def test_imports_only_go_down_the_layers():
    assert not upward_imports(import_graph())


@pytest.mark.slow
def test_a_training_process_loads_only_what_trains():
    """A fresh interpreter that imports the trainer's entry point holds no command it does not run."""
    loaded = modules_loaded_by("nanotron.train", "nanotron.trainer")
    assert "nanotron.launch.torchrun" in loaded
    assert not [m for m in loaded if any(_under(m, name) for name in NOT_THE_TRAINERS)]
    commands = [m for m in loaded if _under(m, "nanotron.commands")]
    assert commands == ["nanotron.commands", "nanotron.commands.train"], commands


def modules_loaded_by(*modules: str) -> list[str]:
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


# A launcher of local ranks, stopped where it would start torchrun (which imports torch itself): what it has loaded.
LAUNCHER_PROBE = """
import sys
import nanotron.launch.torchrun as torchrun
from nanotron.commands import main

def probe(args):
    print("loaded:", *[name for name in ("torch", "nanotron.trainer") if name in sys.modules], flush=True)
    return 0

torchrun.run_torchrun = probe
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "doctor"])
def test_a_launcher_of_local_ranks_checks_its_input_before_loading_torch(command, tiny_data, tmp_path):
    """`--nproc_per_node N` validates the config (and for training the corpus) in a process that then only runs
    torchrun: that process imports neither torch's model stack nor the trainer (~2 s of CPU per launch)."""
    args = [command, "--nproc_per_node", "2", "--parallelism.tp=2", *TINY_MODEL, *tiny_data.overrides()]
    args.append(f"--job.out_dir={tmp_path}")
    done = subprocess.run([sys.executable, "-c", LAUNCHER_PROBE, *args], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["loaded:"], done.stdout


# Commands that read no tensor: they run on a login node or a laptop in a blink, not after torch's ~3 s of imports.
# And those that start local ranks, whose modules import the ranks' stack where a rank runs (eval's launcher is
# checked here only at import: it needs a checkpoint).
# The watcher too: every launch starts one per node (2.6 s of CPU and ~300 MB per node with torch).
TORCH_FREE_COMMANDS = ["report", "config", "tokenize", "prepare", "launch", "torchrun", "suspects", "watcher"]
TORCH_FREE_COMMANDS += ["train", "doctor", "eval"]


@pytest.mark.slow
def test_the_commands_that_read_no_tensor_load_no_torch():
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE_COMMANDS!r}:\n"
        "    importlib.import_module('nanotron.commands.' + name)\n"
        "    print(name, 'torch' in sys.modules)\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.split() == [word for name in TORCH_FREE_COMMANDS for word in (name, "False")], loaded


def is_entry_point(path: Path) -> bool:
    """A module run as a program: a `__main__.py`, a module-level `def main`, or an `if __name__ == "__main__":`."""
    tree = ast.parse(path.read_text())
    guard = any(
        isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
        for node in tree.body
    )
    main = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
    return path.name == "__main__.py" or guard or main


def test_entry_point_check_finds_a_main_outside_the_commands(tmp_path):
    (tmp_path / "library.py").write_text("def main():\n    return 0\n")
    (tmp_path / "script.py").write_text('if __name__ == "__main__":\n    print()\n')
    (tmp_path / "plain.py").write_text("def main_loop():\n    return 0\n")
    assert [is_entry_point(tmp_path / f) for f in ("library.py", "script.py", "plain.py")] == [True, True, False]


def test_every_entry_point_is_in_the_commands_package():
    """One home per kind of thing: what runs as a program lives in nanotron.commands (and the module spellings
    launchers type, which only call into it)."""
    outside = [
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if is_entry_point(path) and not any(_under(module_name(path), name) for name in ENTRY_POINTS)
    ]
    assert not outside, f"entry points outside nanotron/commands/: {outside}"


def private_torch_uses(path: Path) -> list[str]:
    """Lines of `path` that name a private torch API (comments aside), and imports of private torch modules."""
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_TORCH.search(line.split("#")[0])
    ]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(part.startswith("_") and not part.startswith("__") for part in parts):
                found.append(f"{path.name}: imports {name}")
    return found


@pytest.mark.parametrize(
    "line",
    [
        "from torch.distributed._composable import checkpoint",
        "import torch._inductor.config",
        "dist.distributed_c10d._set_pg_timeout(timeout, group)",
        'mesh["a", "b"]._flatten("dp")',
        '"torch.serialization._get_layout",',
    ],
)
def test_private_torch_check_finds_each_spelling(tmp_path, line):
    (tmp_path / "m.py").write_text(line + "\n")
    assert private_torch_uses(tmp_path / "m.py")


def test_private_torch_names_only_behind_the_two_doors():
    uses = [use for path in PACKAGE.rglob("*.py") if path not in PRIVATE_DOORS for use in private_torch_uses(path)]
    assert not uses, "reach private torch APIs through parallel/ or checkpoint/torch_private.py:\n" + "\n".join(uses)


@pytest.mark.parametrize(
    "old, new",
    [("nanotron.doctor", "doctor"), ("nanotron.tokenize", "tokenize"), ("nanotron.launch.local", "torchrun")],
)
def test_a_retired_module_spelling_is_one_line_naming_the_command(old, new):
    proc = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: `python -m {old}` is now `nanotron {new}` (or `python -m nanotron {new}`)\n"


def test_the_documented_module_spellings_still_run():
    """`python -m nanotron.train` and `python -m nanotron.launch` (the original nanotron's) stay what they were."""
    for module, words in (("nanotron.train", "--section.key=value"), ("nanotron.launch", "--run_name")):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and words in proc.stdout, proc.stderr


def test_the_console_script_points_at_the_command_dispatcher():
    """`nanotron` (pyproject's [project.scripts]) must name a function that exists: a moved module breaks it."""
    import importlib

    from nanotron.config.parse import tomllib  # tomli before Python 3.11

    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["nanotron"].partition(":")
    assert getattr(importlib.import_module(module), function).__module__ == "nanotron.commands"
