"""The layers of ``bigconv`` hold: no module imports a higher layer, and no import cycle exists.

Every import counts, function-local ones included: a cycle hidden inside a function is still one.
Importing ``a.b.c`` from outside ``a.b`` also runs ``a.b``'s ``__init__``, so that counts as an import
of ``a.b`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("utilities", ["bigconv.compat", "bigconv.provenance", "bigconv.progress", "bigconv.saving", "bigconv.memory",
                   "bigconv.losses", "bigconv.models"]),
    ("geometry", ["bigconv.geometry"]),
    ("data", ["bigconv.data"]),
    ("transport", ["bigconv.transport"]),
    ("op rules", ["bigconv.ops"]),
    ("engine", ["bigconv.engine"]),
    ("runtime", ["bigconv.runtime"]),
    ("front ends", ["bigconv.parallel", "bigconv.planning", "bigconv.checks", "bigconv.spmd", "bigconv.diagnostics"]),
    ("harness", ["bigconv.harness", "bigconv.verify", "bigconv.sabotage", "bigconv.check"]),
]
"""Bottom to top. Data sits low because workers read their own boxes of a slide (the runtime reads
sources)."""
ROOT_LAYER = len(LAYERS) - 1
"""The package root (``bigconv/__init__``: the public names) belongs with the harness: only the
harness and what is outside the package may use ``import bigconv``."""


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "bigconv").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int:
    if module == "bigconv":
        return ROOT_LAYER
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it to one")


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The bigconv modules ``module`` imports, anywhere in its file, with the packages whose
    ``__init__`` they run (the root package aside)."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "bigconv":
                continue
            if target == "bigconv":
                found.add(target)
            parts = target.split(".")
            # The packages above the target whose __init__ runs first; those holding this module
            # are already running theirs.
            found.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts) + 1))
                         if p in known and (p == target or not module.startswith(p + ".")))
    found.discard(module)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    def name(module: str) -> str:
        return LAYERS[layer_of(module)][0] if module != "bigconv" else "the package root, with the harness"

    upward = [f"{m} ({name(m)}) imports {t} ({name(t)})"
              for m, targets in graph().items() for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    """The check itself can fail (a cycle-free verdict from a broken finder would prove nothing)."""
    assert cycles(edges) == expected
