"""The package's shape, checked: imports point one way (no cycles, function-level imports
included), no module imports another's private names, files stay a readable size, and
``kvtier_kernels`` never imports ``kvtier``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvtier", "kvtier_kernels")
MAX_LINES = 540  # about 500: "a few hundred lines", a file a reader can hold in their head


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [alias.name for alias in node.names]
            found.append((base, names, node.lineno))
            # ``from pkg import module`` imports the module too
            found += [(f"{base}.{n}", [], node.lineno) for n in names if f"{base}.{n}" in MODULES]
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for target, _, _ in _imports(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_kernels_never_import_kvtier():
    offenders = [
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.startswith("kvtier_kernels")
        for target, _, _ in _imports(name, path)
        if target == "kvtier" or target.startswith("kvtier.")
    ]
    assert offenders == []


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for name, path in MODULES.items():
        for target, names, line in _imports(name, path):
            if target.split(".")[0] not in PACKAGES or target == name:
                continue
            private = [
                n
                for n in names
                if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in MODULES
            ]
            if private:
                offenders.append(f"{path.relative_to(ROOT)}:{line} takes {private} from {target}")
    assert offenders == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_stays_readable(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines"
