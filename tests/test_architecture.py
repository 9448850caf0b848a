"""The shape of the code, checked over its source: no import cycles (a lazy import inside a function
counts: it only hides one), no file over 500 lines, no class over 250, and no two modules with one
name (a newcomer searching for `ring.py` finds one file)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ravnest", "coordinator", "node")
GENERATED = ("ravnest/v1/", "coordinator/migrations/")
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 250
SHARED_NAMES = {"__init__.py", "__main__.py", "cli.py", "registry.py"}  # names every package may have


def sources() -> dict[str, Path]:
    """module name -> file, for every hand-written module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(GENERATED):
                parts = relative[:-3].split("/")
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `module` imports anywhere in its file, `if TYPE_CHECKING:` included (a
    cycle of types is still a cycle a reader has to untangle)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """Edges from a module to the modules it imports; a package's __init__ re-exporting its own modules
    is not an edge back into it (importing `a.b` runs `a` first anyway)."""
    modules = sources()
    graph = {module: imports_of(module, path, set(modules)) for module, path in modules.items()}
    for module, edges in graph.items():
        edges -= {other for other in edges if module.startswith(other + ".")}
    return graph


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_file_or_class_too_long() -> None:
    too_long = []
    for module, path in sources().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_no_two_modules_share_a_name() -> None:
    by_name = defaultdict(list)
    for path in sources().values():
        if path.name not in SHARED_NAMES:
            by_name[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
