"""The layers of the repository hold: no module imports a higher layer, no import cycle exists, and
importing bigconv's index math loads nothing of the distributed stack.

The layers are ``bigconv``'s (bottom to top, ``LAYERS``), then ``multidsn`` (a user of bigconv),
``plots`` (figures and tables from saved results files) and ``experiments`` (the scripts that run
things and write those files; they may draw right after a run by calling ``plots``, never the other
way: a figure needs the results' format, not the code that measured them). Inside bigconv's packages
that have an order, ``SUBLAYERS`` holds it.

Every import counts, function-local ones included: a cycle hidden inside a function is still one, and
so is one closed by an import under ``if TYPE_CHECKING:`` (it is a dependency of the annotations, and the
two modules cannot be understood apart). Importing ``a.b.c`` from outside ``a.b`` also runs ``a.b``'s
``__init__``, so that counts as an import of ``a.b`` too.

A failure names the import that breaks a layer or closes a cycle: move what both sides need down.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bigconv", "multidsn", "plots", "experiments")

LAYERS = [
    ("utilities", ["bigconv.compat", "bigconv.import_guard", "bigconv.provenance", "bigconv.progress", "bigconv.saving", "bigconv.memory",
                   "bigconv.losses", "bigconv.models"]),
    ("geometry", ["bigconv.geometry"]),
    ("data", ["bigconv.data"]),
    ("transport", ["bigconv.transport"]),
    ("op rules", ["bigconv.ops"]),
    ("engine", ["bigconv.engine"]),
    ("runtime", ["bigconv.runtime"]),
    ("front ends", ["bigconv.parallel", "bigconv.prediction", "bigconv.capture", "bigconv.planning", "bigconv.input_checks",
                    "bigconv.spmd", "bigconv.halo_adjoint", "bigconv.lightning"]),
    ("harness", ["bigconv.harness", "bigconv.verify", "bigconv.sabotage", "bigconv.check"]),
    ("multidsn", ["multidsn"]),
    ("plots", ["plots"]),
    ("experiments", ["experiments"]),
]
"""Bottom to top. Data sits low because workers read their own boxes of a slide (the runtime reads
sources)."""
ROOT_LAYER = [name for name, _ in LAYERS].index("harness")
"""The package root (``bigconv/__init__``: the public names, loaded lazily) belongs with the harness:
only the harness and what is outside the package may use ``import bigconv``'s names."""

SUBLAYERS = {
    "bigconv.geometry": [["bigconv.geometry.boxes", "bigconv.geometry.index_maps"], ["bigconv.geometry"]],
    "bigconv.data": [
        ["bigconv.data.readers", "bigconv.data.views", "bigconv.data.synthetic", "bigconv.data.outputs"],
        ["bigconv.data.sources", "bigconv.data.pyramid"],
        ["bigconv.data.dataset", "bigconv.data.prefetch"],
        ["bigconv.data"],
    ],
    "bigconv.transport": [
        ["bigconv.transport.comm_checks", "bigconv.transport.mesh", "bigconv.transport.roll_call"],
        ["bigconv.transport"],
        ["bigconv.transport.p2p", "bigconv.transport.rpc"],
    ],
    "bigconv.engine": [
        ["bigconv.engine.buckets", "bigconv.engine.executor", "bigconv.engine.plan"],
        ["bigconv.engine.checkpointing", "bigconv.engine.dry_run", "bigconv.engine.shard"],
        ["bigconv.engine.step", "bigconv.engine.capture"],
        ["bigconv.engine"],
    ],
    "bigconv.runtime": [
        ["bigconv.runtime.agent", "bigconv.runtime.host", "bigconv.runtime.launch_env", "bigconv.runtime.netbind",
         "bigconv.runtime.model_part", "bigconv.runtime.spmd_outputs"],
        ["bigconv.runtime.spmd_world", "bigconv.runtime.worker"],
        ["bigconv.runtime.world"],
        ["bigconv.runtime.spmd_launch"],
        ["bigconv.runtime"],
    ],
    "bigconv.spmd": [["bigconv.spmd.agreement", "bigconv.spmd.native"], ["bigconv.spmd.model"], ["bigconv.spmd"]],
    "bigconv.harness": [
        ["bigconv.harness.cli", "bigconv.harness.model_spec", "bigconv.harness.recorder", "bigconv.harness.records",
         "bigconv.harness.registry", "bigconv.harness.shard_profile", "bigconv.harness.attention_cost"],
        ["bigconv.harness.workload", "bigconv.harness.devices", "bigconv.harness.op_table"],
        ["bigconv.harness.spmd_workload", "bigconv.harness.cost_model"],
        ["bigconv.harness.runner", "bigconv.harness.plan_search"],
        ["bigconv.harness.plan_report"],
        ["bigconv.harness"],
    ],
}
"""Bottom to top, inside a package: a module imports only modules of lower rows of its own package, and
the modules of one row do not import each other.

geometry: the two index-math modules, then the package's names. data: formats (``readers``), views
and the synthetic slides, then what a worker reads (``sources``: a box of a slide), then iteration
(``dataset``, ``prefetch``), then the package's names. transport: the NCCL-rule test modes, the mesh, the roll call, the
``Link`` interface and the worker's transport state (``__init__``), then the two links. engine: the
gradient buckets, the executor and the plan, then what runs on them (checkpoint replay, the dry run, a
shard's engine), then the step every front end runs on it.
runtime: processes, sockets, the RPC agent, a worker's host and the model part installed on it, a store SPMD
ranks write together (``spmd_outputs``), then the two worlds' workers (``worker``, ``spmd_world``), the
driver's ``World``, the local launcher of SPMD ranks. spmd: the plan agreement, the front end. harness: leaves (and the shard profile of a dry run), then the workloads and the device and op
tables, then the cost model, then the runner and the plan search, then the planner's report.
``bigconv.ops`` has no row order here: its rules call each other directly (``tests/test_seams.py`` keeps
ops free of circles and of the concrete mode)."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
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


def _nodes(tree: ast.AST):
    """(node, whether it sits under ``if TYPE_CHECKING:``) for every node of ``tree``."""
    stack = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        yield node, typing_only
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend((n, True) for n in child.body)
                stack.extend((n, typing_only) for n in child.orelse)
            else:
                stack.append((child, typing_only))


def imported_names(module: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """Every dotted name ``module`` imports, anywhere in its file -> whether only under ``TYPE_CHECKING``.
    ``from a import b`` gives ``a.b`` where that is a module of the repository, else ``a``."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    found: dict[str, bool] = {}
    for node, typing_only in _nodes(ast.parse(path.read_text())):
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
            found[target] = found.get(target, True) and typing_only
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """The repository's modules ``module`` imports, with the packages whose ``__init__`` they run (the
    root package aside) -> whether only under ``TYPE_CHECKING``."""
    found: dict[str, bool] = {}
    for target, typing_only in imported_names(module, path, known).items():
        if target.split(".")[0] not in PACKAGES:
            continue
        parts = target.split(".")
        # The package itself where it is the target, and the packages above the target whose __init__
        # runs first (those holding this module are already running theirs).
        runs = [target] if target in PACKAGES else []
        runs += [p for p in (".".join(parts[:i]) for i in range(2, len(parts) + 1))
                 if p in known and (p == target or not module.startswith(p + "."))]
        for p in runs:
            found[p] = found.get(p, True) and typing_only
    found.pop(module, None)
    return found


def graph(known: dict[str, Path] | None = None) -> dict[str, dict[str, bool]]:
    known = known or modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def _layer_name(module: str) -> str:
    return LAYERS[layer_of(module)][0] if module != "bigconv" else "the package root, with the harness"


def upward_imports(edges: dict[str, dict[str, bool]]) -> list[str]:
    return [f"{m} ({_layer_name(m)}) imports {t} ({_layer_name(t)})"
            for m, targets in edges.items() for t in sorted(targets) if layer_of(t) > layer_of(m)]


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(graph())
    assert not upward, "\n".join(upward)


def sublayer_breaks(edges: dict[str, dict[str, bool]]) -> list[str]:
    found = []
    for package, rows in SUBLAYERS.items():
        row_of = {m: i for i, row in enumerate(rows) for m in row}
        inside = [m for m in edges if m == package or m.startswith(package + ".")]
        found += [f"{m} is in no row of SUBLAYERS[{package!r}]: add it to one" for m in inside if m not in row_of]
        for m in inside:
            for t in sorted(edges[m]):
                if m in row_of and t in row_of and row_of[t] >= row_of[m]:
                    found.append(f"{m} (row {row_of[m]} of {package}) imports {t} (row {row_of[t]})")
    return found


def test_every_package_keeps_its_order():
    breaks = sublayer_breaks(graph())
    assert not breaks, "\n".join(breaks)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
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


def cycle_edges(edges: dict[str, dict[str, bool]]) -> dict[str, set[str]]:
    """Every import, type-only ones included: a circle closed by an annotation is still a circle."""
    return {m: set(targets) for m, targets in edges.items()}


def package_of(module: str) -> str:
    """The unit a cycle between packages is counted in: a subpackage or top-level module of bigconv, the
    root package, or a top-level package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "bigconv" else parts[0]


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        out.setdefault(package_of(m), set()).update(package_of(t) for t in targets if package_of(t) != package_of(m))
    return out


def test_no_import_cycle():
    found = cycles(cycle_edges(graph()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_cycle_between_packages():
    found = cycles(package_edges(cycle_edges(graph())))
    assert not found, "cycles between packages:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    """The check itself can fail (a cycle-free verdict from a broken finder would prove nothing)."""
    assert cycles(edges) == expected


def test_type_only_imports_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` is an edge, marked type-only; one beside it is not."""
    (tmp_path / "bigconv").mkdir()
    path = tmp_path / "bigconv" / "a.py"
    path.write_text("from typing import TYPE_CHECKING\nimport bigconv.c\nif TYPE_CHECKING:\n"
                    "    from bigconv.b import B\n    import bigconv.c\n")
    known = {"bigconv.a": path, "bigconv.b": path, "bigconv.c": path}
    assert imports("bigconv.a", path, known) == {"bigconv.b": True, "bigconv.c": False}


def test_importing_geometry_loads_nothing_of_the_distributed_stack():
    """``import bigconv.geometry.boxes`` in a fresh interpreter loads no ``torch.distributed`` module
    that ``import torch`` did not already load, and of bigconv only the root, ``compat``, ``import_guard`` and geometry.

    ``torch.distributed.rpc`` itself is in ``sys.modules`` after a bare ``import torch`` (torch 2.13:
    ``torch._jit_internal`` imports it), so "not in sys.modules" cannot be asked of any module that
    imports torch; what bigconv adds can."""
    code = ("import json, sys, torch; before = set(sys.modules); import bigconv.geometry.boxes; "
            "print(json.dumps(sorted(m for m in set(sys.modules) - before "
            "if m.startswith(('torch.distributed', 'bigconv')))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    allowed = {"bigconv", "bigconv.compat", "bigconv.import_guard"}
    extra = [m for m in loaded if m not in allowed and not m.startswith("bigconv.geometry")]
    assert not extra, f"import bigconv.geometry.boxes also loads {len(extra)} modules: {extra}"


WORKER_INTERNALS = ("bigconv.runtime.worker", "bigconv.runtime.host", "bigconv.runtime.model_part",
                    "bigconv.transport", "torch.distributed.rpc")
"""What an experiment reaching into the workers imports: the worker process, its host and the model part
on it, the transport, RPC itself. Experiments use ``World`` (``on_hosts``, ``memory``, ``traffic``, ...),
``ParallelModel`` and the harness instead."""
NEEDS_A_PUBLIC_API = {
    "experiments.memory_probe": "patches the workers' ModelPart.forward to note which threads run forwards",
}
"""The experiments that still reach into the workers, because no public API does what they do yet."""


def experiments_reaching_into_workers() -> dict[str, list[str]]:
    known = modules()
    found = {}
    for module, path in known.items():
        if module.split(".")[0] == "experiments":
            names = [n for n in imported_names(module, path, known)
                     if any(n == p or n.startswith(p + ".") for p in WORKER_INTERNALS)]
            if names:
                found[module] = sorted(names)
    return found


def test_experiments_use_public_apis():
    found = experiments_reaching_into_workers()
    new = {m: names for m, names in found.items() if m not in NEEDS_A_PUBLIC_API}
    assert not new, f"experiments importing the workers' internals {WORKER_INTERNALS}: {new}"
    stale = sorted(set(NEEDS_A_PUBLIC_API) - set(found))
    assert not stale, f"these no longer reach into the workers: delete them from NEEDS_A_PUBLIC_API: {stale}"
