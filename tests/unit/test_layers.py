"""The layers of docs/architecture.md, checked statically (with `ast`, importing nothing) over kvbench/ and
backends/ (installed as kvbench.backends): the core imports no backend; a backend imports no other backend; no
private name is imported from another module; the import graph of the core has no cycle, function-level imports
included (a function-level import may defer a heavy module's cost, but must not hide a cycle)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"kvbench": REPO / "kvbench", "kvbench.backends": REPO / "backends"}

# Cycles left in the core's import graph, each as the sorted set of its modules, with why it stays. Empty: a
# cycle found is a failure, and one that goes away must be removed from here too.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# `from M import _name` across modules left for now (importer, M, name) with why; same rule as KNOWN_CYCLES.
KNOWN_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {
    ("kvbench.trace.compute", "pyarrow", "_compute"): "pyarrow.compute's kernels without the 70 ms import of its "
    "wrappers (kvbench/trace/compute.py); pyarrow.compute where it moves",
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name of the importing module
    target: str  # dotted name of the module imported (for `from P import x`: P.x when that is a module, else P)
    names: tuple[str, ...]  # names taken with `from M import ...` (empty for `import M`)
    line: int
    top_level: bool  # False: inside a function (run when called)


def module_name(path: Path, prefix: str, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts])


def modules(roots: dict[str, Path] = ROOTS) -> dict[str, Path]:
    """Every module of the trees, by dotted name."""
    return {
        module_name(path, prefix, root): path
        for prefix, root in roots.items()
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _in_function(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside a function (at any depth)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    inside = _in_function(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        top = id(node) not in inside
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, (), node.lineno, top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = sub if sub in known else base
                out.append(Import(name, target, () if sub in known else (a.name,), node.lineno, top))
    return out


def all_imports(roots: dict[str, Path] = ROOTS) -> list[Import]:
    known = modules(roots)
    return [i for name, path in known.items() for i in imports(name, path, known)]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _backend(module: str) -> str | None:
    """The backend a module belongs to (kvbench.backends.X...), else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvbench", "backends"] else None


def core_imports_of_backends(found: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in found
        if _backend(i.importer) is None and (i.target == "kvbench.backends" or _backend(i.target) is not None)
    ]


def backend_imports_of_other_backends(found: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in found
        if _backend(i.importer) is not None
        and _backend(i.target) is not None
        and _backend(i.target) != _backend(i.importer)
    ]


# The layers of the core, bottom first (docs/architecture.md, Layers): a module may import its own layer and those
# below, never one above. The trace schema is the bottom; the catalogue of model geometries and accelerators sits
# on it, and the cache model (which sizes capacities with a geometry) on both; the metrics' definitions read the
# trace and the cache; the runner (and the local engines it starts) makes runs; the live client sends requests;
# the report reads run directories; the command line and the Python API are the top. The modules outside every
# layer (errors, options, registry, redact, the package itself) import none of them; `kvbench.testing` is
# imported by no layer at all.
LAYERS: list[tuple[str, ...]] = [
    ("kvbench.trace",),
    ("kvbench.models",),
    ("kvbench.cache",),
    ("kvbench.metrics",),
    ("kvbench.run", "kvbench.engines"),
    ("kvbench.live",),
    ("kvbench.report",),
    ("kvbench.cli", "kvbench.api"),
]
TESTING = "kvbench.testing"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int | None:
    """The rank of the core layer `module` is in (0 = trace), None outside every layer."""
    for rank, packages in enumerate(LAYERS):
        if any(_within(module, p) for p in packages):
            return rank
    return None


def upward_imports(found: list[Import]) -> list[str]:
    """Imports from a layer of the core into a higher one, from a module outside every layer into any layer,
    and of kvbench.testing from anywhere but itself."""
    out = []
    for i in found:
        if _backend(i.importer) is not None or not _within(i.target, "kvbench") or _backend(i.target) is not None:
            continue
        if _within(i.target, TESTING):
            if not _within(i.importer, TESTING):
                out.append(f"{i.importer}:{i.line} imports {i.target}")
            continue
        low, high = layer_of(i.importer), layer_of(i.target)
        if high is not None and (low is None and i.importer != "kvbench" or low is not None and high > low):
            out.append(f"{i.importer}:{i.line} imports {i.target}")
    return out


def backends_import_no_testing(found: list[Import]) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.target}" for i in found
            if _backend(i.importer) is not None and _within(i.target, TESTING)]  # fmt: skip


def _same_package(importer: str, private_module: str) -> bool:
    """A private module (`pkg._x`) may be imported from within `pkg` (its package), by `pkg` or its modules."""
    pkg = private_module.rpartition(".")[0]
    return importer == pkg or importer.startswith(pkg + ".")


def private_imports(found: list[Import]) -> list[tuple[str, str, str]]:
    """(importer, module, name) for each private name or private module taken from outside where it lives."""
    bad = []
    for i in found:
        if i.importer == i.target:
            continue
        bad += [(i.importer, i.target, n) for n in i.names if _private(n)]
        parts = i.target.split(".")
        for k, part in enumerate(parts):
            if _private(part) and not _same_package(i.importer, ".".join(parts[: k + 1])):
                bad.append((i.importer, ".".join(parts[:k]), part))
                break
    return sorted(set(bad))


def private_attributes(roots: dict[str, Path] = ROOTS) -> list[tuple[str, str, str]]:
    """(module, other module, name) for each `other._name` read through a module imported whole (`import a.b as
    m` or `from a import b`, b a module): the same reach into another module's privates as `from a.b import _x`."""
    known = modules(roots)
    bad = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        bound = {}  # local name -> module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if f"{node.module}.{a.name}" in known:
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
                and bound[node.value.id] != name
            ):
                bad.append((name, bound[node.value.id], node.attr))
    return sorted(set(bad))


def cycles(found: list[Import], within: str = "kvbench") -> list[frozenset[str]]:
    """The import cycles among the modules named `within`... (not backends): the strongly connected components
    of more than one module (Tarjan's algorithm), function-level imports counted."""
    graph: dict[str, set[str]] = {}
    for i in found:
        if i.importer.startswith(within) and i.target.startswith(within) and i.target != i.importer:
            if _backend(i.importer) is None and _backend(i.target) is None:
                graph.setdefault(i.importer, set()).add(i.target)
                graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def found() -> list[Import]:
    return all_imports()


def test_the_trees_are_read(found):
    """A guard for the checks below: they saw the modules they are about."""
    names = modules()
    assert "kvbench.trace.files" in names and "kvbench.backends.sim" in names
    assert any(i.importer == "kvbench.trace.scan" and i.target == "kvbench.trace.files" for i in found)


def test_the_core_imports_no_backend(found):
    assert core_imports_of_backends(found) == []


def test_a_backend_imports_no_other_backend(found):
    assert backend_imports_of_other_backends(found) == []


def test_lower_layers_import_no_higher_one(found):
    assert upward_imports(found) == []


def test_every_core_package_is_in_a_layer():
    """A new package of the core must be placed in LAYERS (or be one of the few outside them)."""
    outside = {"kvbench", "kvbench.backends", "kvbench.errors", "kvbench.options", "kvbench.registry", "kvbench.redact"}
    placed = {m for m in modules() if _backend(m) is None and (layer_of(m) is not None or _within(m, TESTING))}
    assert {m for m in modules() if _backend(m) is None} - placed - outside == set()


def test_no_backend_imports_the_test_fixtures(found):
    assert backends_import_no_testing(found) == []


def test_no_private_name_is_imported_from_another_module(found):
    bad = {b for b in private_imports(found) if b not in KNOWN_PRIVATE_IMPORTS}
    assert bad == set(), "make the name public where it is defined, or move it"
    stale = set(KNOWN_PRIVATE_IMPORTS) - set(private_imports(found))
    assert stale == set(), "fixed: remove these from KNOWN_PRIVATE_IMPORTS"


def test_no_private_name_is_read_through_another_module():
    assert private_attributes() == [], "make the name public where it is defined, or move it"


def test_the_core_has_no_import_cycle(found):
    got = set(cycles(found))
    assert {tuple(sorted(c)) for c in got - set(KNOWN_CYCLES)} == set()
    assert {tuple(sorted(c)) for c in set(KNOWN_CYCLES) - got} == set(), "gone: remove from KNOWN_CYCLES"


# The checks, shown to fail: each on a small tree with the fault it looks for.


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"kvbench": tmp_path / "kvbench", "kvbench.backends": tmp_path / "backends"}


def test_the_checks_catch_what_they_look_for(tmp_path):
    roots = _tree(
        tmp_path,
        {
            "kvbench/__init__.py": "",
            "kvbench/trace/__init__.py": "",
            "kvbench/trace/files.py": "def _open(): ...\ndef f():\n    from kvbench.trace import scan\n",
            "kvbench/trace/scan.py": "from kvbench.trace.files import _open\n",
            "kvbench/trace/_helper.py": "",
            "kvbench/trace/ok.py": "from kvbench.trace._helper import x\nfrom .files import open_file\n",
            "kvbench/trace/peek.py": "from kvbench.trace import files\n\nfiles._open()\n",
            "kvbench/cache/__init__.py": "from kvbench.trace._helper import y\n",
            "kvbench/run/runner.py": "import kvbench.backends.sim\n",
            "kvbench/cache/prepared.py": "from kvbench.run.results import NO_LABEL\n",
            "backends/__init__.py": "",
            "backends/sim/__init__.py": "from kvbench.backends.torchkv import tiers\n",
            "backends/torchkv/__init__.py": "from kvbench.trace import files\n",
            "backends/torchkv/tiers.py": "",
        },
    )
    found = all_imports(roots)
    assert core_imports_of_backends(found) == ["kvbench.run.runner:1 imports kvbench.backends.sim"]
    assert upward_imports(found) == ["kvbench.cache.prepared:1 imports kvbench.run.results"]
    assert backend_imports_of_other_backends(found) == ["kvbench.backends.sim:1 imports kvbench.backends.torchkv.tiers"]
    assert private_imports(found) == [
        ("kvbench.cache", "kvbench.trace", "_helper"),
        ("kvbench.trace.scan", "kvbench.trace.files", "_open"),
    ]
    assert cycles(found) == [frozenset({"kvbench.trace.files", "kvbench.trace.scan"})]
    assert private_attributes(roots) == [("kvbench.trace.peek", "kvbench.trace.files", "_open")]
