"""The seams of ``bigconv.ops`` are declared, and the code keeps to them.

- No import circle inside ``bigconv/ops/``, counting imports under ``if TYPE_CHECKING:`` and inside
  functions: a type-only import that closes a circle is still a circle (``tests/test_architecture.py``
  counts only the imports that run).
- No name starting with ``_`` is imported from another bigconv module anywhere in ``bigconv/ops/`` and
  ``bigconv/engine/``: a helper two modules use is public in the module that owns it.
- The rules see the mode only as a ``RuleContext`` and the executor only as an ``Executor``
  (``bigconv.ops.context``): every member they read is declared there and every declared member is read;
  ``ShardMode`` and ``ShardExecutor`` provide every member, methods with parameters that accept the
  protocol's calls. There is no type checker in the dev environment, so these checks are the type check of
  the seams.

A failure names the module and the name: declare the member, make the helper public where it lives, or
cut the import. ``python tests/test_seams.py`` prints the counts these checks keep at zero.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_architecture import cycles

ROOT = Path(__file__).resolve().parents[1]
OPS = "bigconv.ops"
MODE_HOLDERS = {"bigconv.ops.mode", "bigconv.ops.whole", "bigconv.ops.sync_norm"}
"""The modules that hold the concrete ``ShardMode``: the mode itself, and the module hooks above it that
find it with ``active_mode()``. Every other module of ops is a rule module (or below the rules) and sees
the mode as a ``RuleContext`` only."""
CONTEXT_NAME = "mode"
"""The parameter name rules give their ``RuleContext``: the attribute reads on it are what they use."""


# -- reading the source ---------------------------------------------------------------------------
def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def every_module() -> dict[str, Path]:
    return modules("bigconv")


def imported(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, ast.AST]]:
    """``(bigconv module, name taken from it or None, node)`` for every import anywhere in the file:
    under ``if TYPE_CHECKING:`` and inside functions too."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node) for a in node.names if a.name.split(".")[0] == "bigconv"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "bigconv":
                continue
            for a in node.names:  # ``from . import layout`` takes a module, ``from .shards import mark`` a name
                found.append((f"{base}.{a.name}", None, node) if f"{base}.{a.name}" in known
                             else (base, a.name, node))
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    """Imports among the modules of ``package``, type-only and function-local ones included."""
    known = every_module()
    inside = modules(package)
    return {m: {target for target, _, _ in imported(m, p, known) if target in inside and target != m}
            for m, p in inside.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (the layer test's Tarjan)."""
    return cycles(edges)


def private_crossings(packages: tuple[str, ...] = ("bigconv.ops", "bigconv.engine")) -> list[str]:
    """Names starting with ``_`` that a module of ``packages`` takes from another bigconv module."""
    known = every_module()
    return [f for package in packages for m, p in modules(package).items() for f in crossings_in(m, p, known)]


def crossings_in(module: str, path: Path, known: dict[str, Path]) -> list[str]:
    """Private names ``module`` imports from a bigconv module (``from .layout import _sizes``) or reads
    off one it imported (``layout._sizes``)."""
    found = []
    bound = {}  # local name -> bigconv module, for ``from . import layout`` and ``import bigconv.x as y``
    for target, name, node in imported(module, path, known):
        last = (name or target).rsplit(".", 1)[-1]
        if _private(last):
            found.append(f"{module}:{node.lineno} imports {last} from {target}")
        if name is None and isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if target.endswith("." + a.name))
            bound[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            bound.update({a.asname: target for a in node.names if a.asname and a.name == target})
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr)):
            found.append(f"{module}:{node.lineno} reads {node.attr} off {bound[node.value.id]}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def rule_modules() -> dict[str, Path]:
    return {m: p for m, p in modules(OPS).items() if m not in MODE_HOLDERS}


def context_reads() -> dict[str, set[str]]:
    """Each attribute rules read off their ``RuleContext`` (``mode.X``), with where."""
    reads: dict[str, set[str]] = {}
    for module, path in rule_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == CONTEXT_NAME:
                reads.setdefault(node.attr, set()).add(f"{module}:{node.lineno}")
    return reads


def executor_reads() -> tuple[dict[str, set[str]], list[str]]:
    """Each attribute ops reads off an executor (``<mode>.executor.X``, the mode's own reads included),
    and every place the executor is taken as a whole (then its reads elsewhere would go unseen)."""
    reads: dict[str, set[str]] = {}
    escapes = []
    for module, path in modules(OPS).items():
        tree = ast.parse(path.read_text())
        under_attribute = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "executor" and id(node) not in under_attribute
                    and not _is_assignment_target(tree, node)):
                escapes.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "executor":
                reads.setdefault(node.attr, set()).add(f"{module}:{node.lineno}")
    return reads, escapes


def _is_assignment_target(tree: ast.AST, node: ast.Attribute) -> bool:
    """``self.executor = executor`` (the mode storing it) and ``self.executor: Executor`` are no escape."""
    return any(isinstance(n, (ast.Assign, ast.AnnAssign)) and node in (n.targets if isinstance(n, ast.Assign)
                                                                      else [n.target]) for n in ast.walk(tree))


def context_parameters() -> list[str]:
    """Rule functions whose context parameter is not ``mode: RuleContext``, and parameters annotated
    ``RuleContext`` under another name (their reads would go unseen)."""
    wrong = []
    for module, path in rule_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                note = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if (arg.arg == CONTEXT_NAME) != (note == "RuleContext"):
                    wrong.append(f"{module}:{node.lineno} {node.name}({arg.arg}: {note})")
    return wrong


def protocol_members(protocol: type) -> set[str]:
    getter = getattr(typing, "get_protocol_members", None)  # Python 3.13+
    if getter is not None:
        return set(getter(protocol))
    return {n for n in (*vars(protocol), *getattr(protocol, "__annotations__", {})) if not n.startswith("_")}


def mismatch(impl, declared) -> str | None:
    """Why ``impl`` (a bound method) cannot take every call ``declared`` (the protocol's function) allows."""
    want = list(inspect.signature(declared).parameters.values())[1:]  # without self
    have = list(inspect.signature(impl).parameters.values())
    for k, p in enumerate(want):
        if k >= len(have) or have[k].name != p.name:
            return f"parameter {k + 1} is {have[k].name if k < len(have) else 'missing'}, the protocol's is {p.name}"
        if p.default is not p.empty and have[k].default is p.empty:
            return f"{p.name} has no default, the protocol's has one"
    extra = [p.name for p in have[len(want):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                                           p.VAR_KEYWORD)]
    return f"it requires {extra}, which the protocol does not pass" if extra else None


def conformance(instance, protocol: type) -> list[str]:
    """What ``instance`` lacks of ``protocol``: members, implementations (not the protocol's own stubs,
    which a class naming the protocol as its base inherits) and parameters."""
    wrong = []
    cls = type(instance)
    for name in sorted(protocol_members(protocol)):
        if not hasattr(instance, name):
            wrong.append(f"{cls.__name__} has no {name}")
            continue
        declared = vars(protocol).get(name)
        if not inspect.isfunction(declared):
            continue
        if next(c for c in cls.__mro__ if name in vars(c)) is protocol:
            wrong.append(f"{cls.__name__}.{name} is the protocol's stub, not an implementation")
            continue
        why = mismatch(getattr(instance, name), declared)
        if why:
            wrong.append(f"{cls.__name__}.{name}: {why}")
    return wrong


def shard_executor():
    """A ``ShardExecutor`` of a 2x2 grid; its runtime has only what the constructor reads."""
    from bigconv.engine.executor import ShardExecutor

    return ShardExecutor((2, 2), 0, SimpleNamespace(link=object(), index=0, replicas=1, replica_link=None))


# -- the checks -----------------------------------------------------------------------------------
def test_no_circle_inside_ops_type_only_imports_counted():
    found = circles(import_graph(OPS))
    assert not found, "import circles in bigconv/ops (type-only imports count):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_rule_modules_do_not_import_the_mode():
    known = every_module()
    wrong = [f"{m}:{node.lineno} imports {target}" for m, p in rule_modules().items()
             for target, _, node in imported(m, p, known) if target in MODE_HOLDERS]
    assert not wrong, "rules see the mode as bigconv.ops.context.RuleContext, not ShardMode:\n" + "\n".join(wrong)


def test_no_private_name_crosses_a_module():
    found = private_crossings()
    assert not found, "private names used across modules (make them public where they live):\n" + "\n".join(found)


def test_rules_take_their_context_as_mode_rule_context():
    wrong = context_parameters()
    assert not wrong, "rule functions take the mode as `mode: RuleContext`:\n" + "\n".join(wrong)


def test_rule_context_declares_exactly_what_rules_read():
    from bigconv.ops.context import RuleContext

    reads = context_reads()
    declared = protocol_members(RuleContext)
    undeclared = {n: sorted(w)[:3] for n, w in reads.items() if n not in declared}
    assert not undeclared, f"rules read members RuleContext does not declare: {undeclared}"
    assert declared <= set(reads), f"RuleContext declares members no rule reads: {sorted(declared - set(reads))}"


def test_executor_protocol_declares_exactly_what_ops_calls():
    from bigconv.ops.context import Executor

    reads, escapes = executor_reads()
    assert not escapes, f"the executor taken as a whole (read members through `.executor.X` only): {escapes}"
    declared = protocol_members(Executor)
    undeclared = {n: sorted(w)[:3] for n, w in reads.items() if n not in declared}
    assert not undeclared, f"ops reads executor members the Executor protocol does not declare: {undeclared}"
    assert declared <= set(reads), f"Executor declares members ops never reads: {sorted(declared - set(reads))}"


def test_shard_mode_provides_the_rule_context():
    from bigconv.ops.context import RuleContext
    from bigconv.ops.mode import ShardMode

    assert not conformance(ShardMode(shard_executor()), RuleContext)


def test_shard_executor_provides_the_executor_protocol():
    from bigconv.ops.context import Executor

    assert not conformance(shard_executor(), Executor)


# -- the checks can fail --------------------------------------------------------------------------
def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_conformance_finds_missing_members_stubs_and_wrong_signatures():
    class Proto(typing.Protocol):
        grid: tuple[int, ...]

        def fits(self, shape: typing.Sequence[int]) -> bool: ...

        def gather(self, x: object, what: str = ...) -> object: ...

    class Good:
        grid = (1,)

        def fits(self, shape, extra=None):
            return True

        def gather(self, x, what="all"):
            return x

    class Bad:
        def fits(self, size):
            return True

        def gather(self, x, what, more):
            return x

    class Stub(Proto):
        grid = (1,)

        def fits(self, shape):
            return True

    assert conformance(Good(), Proto) == []
    assert conformance(Bad(), Proto) == ["Bad.fits: parameter 1 is size, the protocol's is shape",
                                         "Bad.gather: what has no default, the protocol's has one",
                                         "Bad has no grid"]
    assert conformance(Stub(), Proto) == ["Stub.gather is the protocol's stub, not an implementation"]


@pytest.mark.parametrize("source,expected", [
    ("from .layout import _sizes\n", ["imports _sizes from bigconv.ops.layout"]),
    ("from . import layout\nlayout._sizes([1])\n", ["reads _sizes off bigconv.ops.layout"]),
    ("from torch.utils._pytree import tree_map\nfrom .shards import mark\nfrom . import layout\n", []),
])
def test_the_private_name_check_finds_crossings(tmp_path, source, expected):
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found = crossings_in(f"{OPS}.planted", planted, every_module())
    assert [f.split(" ", 1)[1] for f in found] == expected


# -- the counts -----------------------------------------------------------------------------------
def counts() -> dict[str, object]:
    """What the checks keep at zero, and the sizes of the seams (works on a tree before ``context.py``)."""
    reads = context_reads()
    executor_declared = set()
    for path in modules(OPS).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Executor":
                executor_declared |= {getattr(n, "name", None) or ast.unparse(getattr(n, "target", n))
                                      for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    found = circles(import_graph(OPS))
    known = every_module()
    importing_mode = {m for m, p in rule_modules().items()
                      if any(t == "bigconv.ops.mode" for t, _, _ in imported(m, p, known))}
    return {
        "rule modules importing bigconv.ops.mode (type-only counted)": len(importing_mode),
        "mode members read by rules": len(reads),
        "reads of them": sum(len(w) for w in reads.values()),
        "executor members read in ops": len(executor_reads()[0]),
        "members declared by the Executor protocol": len(executor_declared),
        "import circles in ops (type-only counted)": len(found),
        "modules in them": sum(len(c) for c in found),
        "private names crossing modules (ops, engine)": len(private_crossings()),
    }


if __name__ == "__main__":
    for name, value in counts().items():
        print(f"{name}: {value}")
