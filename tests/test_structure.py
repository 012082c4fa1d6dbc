"""The package's shape: no import cycles, a model that knows nothing of parallelism, files you can hold in
your head. Read from the source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nanotron"
MAX_LINES = 400


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
    assert {"nanotron.checkpoint", "nanotron.config", "nanotron.parallel"} <= graph["nanotron.trainer"]
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


def test_no_file_over_400_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long
