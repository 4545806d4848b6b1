"""The package's shape, checked: imports point one way (no cycles, function-level imports
included; a declared layer order, modules named by string in registries included), no
module imports another's private names, files stay a readable size (the packages, the tests
and the benchmarks), ``kvtier_kernels`` never imports ``kvtier``, and docs/architecture.md's
module map is the one the modules' docstrings give."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import module_map

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvtier", "kvtier_kernels")
MAX_LINES = 540  # about 500: "a few hundred lines", a file a reader can hold in their head
MAX_TEST_LINES = 800  # tests and benchmarks: one area per file, its cases may run longer

# Bottom up: a module imports (or names by string, as registries do) only modules of its
# own layer or of the layers below. A module belongs to the longest entry that prefixes it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernels", ("kvtier_kernels",)),
    (
        "foundation",
        (
            "kvtier.warn",
            "kvtier.logs",
            "kvtier.config",
            "kvtier.hashing",
            "kvtier.keys",
            "kvtier.chunker",
            "kvtier.observability",
            "kvtier.metrics",
            "kvtier.prometheus",
            "kvtier.machine",
            "kvtier.tasks",
        ),
    ),
    ("memory", ("kvtier.extents", "kvtier.memory")),
    ("storage", ("kvtier.storage",)),
    ("engine", ("kvtier.paged_io", "kvtier.transfers", "kvtier.engine", "kvtier.warmup")),
    ("routing", ("kvtier.routing",)),
    ("node", ("kvtier.web", "kvtier.server", "kvtier.proxy")),
    (
        "integration",
        (
            "kvtier.integration",
            "kvtier.integration.sglang",
            "kvtier.integration.vllm.common",
            "kvtier.integration.vllm.facts",
            "kvtier.integration.vllm.rpc",
            "kvtier.integration.vllm.kv_events",
            "kvtier.integration.vllm.kv_probe",
        ),
    ),
    ("features", ("kvtier.blend",)),
    ("connector", ("kvtier.integration.vllm",)),
    ("commands", ("kvtier", "kvtier.commands", "kvtier.cli", "kvtier.demo", "kvtier.demo_vllm")),
)


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


def _named_modules(path: Path) -> list[tuple[str, int]]:
    """Modules a file names by a string that is exactly a dotted module path (a registry's
    ``"kvtier.storage.redis_store"``), with the line."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.value, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "." in node.value
        and node.value in MODULES
    ]


def _layer_of(name: str) -> int:
    best, layer = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    return layer


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


def test_every_module_has_a_layer():
    assert [name for name in MODULES if _layer_of(name) < 0] == []


def test_imports_follow_the_layer_order():
    offenders = []
    for name, path in MODULES.items():
        layer = _layer_of(name)
        # ``from package import module`` depends on the module (packages import lazily)
        edges = [
            (target, line, "imports")
            for target, names, line in _imports(name, path)
            if not names or not all(f"{target}.{n}" in MODULES for n in names)
        ]
        edges += [(target, line, "names") for target, line in _named_modules(path)]
        for target, line, how in edges:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if not target or target == name or name.startswith(target + "."):
                continue
            if _layer_of(target) > layer:
                offenders.append(
                    f"{path.relative_to(ROOT)}:{line} ({LAYERS[layer][0]}) {how} {target} "
                    f"({LAYERS[_layer_of(target)][0]})"
                )
    assert offenders == []


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


def _test_files() -> list[Path]:
    return sorted(p for folder in ("tests", "perf") for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_test_and_benchmark_files_stay_readable(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_TEST_LINES, f"{path.relative_to(ROOT)}: {lines} lines"


def test_every_module_says_what_it_is():
    missing = [name for name, path in MODULES.items() if module_map.summary(path) is None]
    assert missing == []


def test_the_module_map_in_the_docs_is_current():
    doc = module_map.DOC.read_text()
    assert module_map.regenerate(doc) == doc, (
        "docs/architecture.md's module map is stale: run python tests/support/module_map.py"
    )
