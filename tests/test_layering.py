"""The package's layers, checked from its imports (``docs/DEVELOPING.md``, "Layout").

Every module of ``pyro_bnn`` is parsed (``ast``; imports inside functions included) and its
imports of the package's own modules are checked against :data:`LAYERS`, lowest first:

* no **upward import** — a module imports only from its own layer and the layers below;
* no **import cycle** between the package's modules (a package's ``__init__`` counts as a
  module that imports what it re-exports);
* no **deferred import** (inside a function) of the package's own modules, except those in
  :data:`DEFERRED_ALLOWED`, each there to keep a heavy optional dependency off ``import pyro_bnn``.

The rule functions are tested on synthetic graphs too, so the checks can fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "pyro_bnn"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: The layers, lowest first: ``(layer, its top-level modules/packages)``.  A module belongs to the
#: layer of its top-level entry (``pyro_bnn.training.distributed.group`` → ``training``); the
#: package root (``pyro_bnn/__init__.py``, the public API) is above every layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("arguments", "_version")),  # argument checks shared by every public function; the version
    ("model", ("model",)),              # network, BayesianNetwork protocol, priors, likelihoods
    ("contract", ("contract",)),        # the guide contract, objectives, Pyro param-store glue
    ("data", ("data",)),                # checked batches, data sets
    ("curvature", ("curvature",)),      # GGN/KFAC curvature, Laplace evidence (marglik)
    ("training", ("training",)),        # pb.fit, guard, diagnosis, checkpoints, devices, seeding
    ("invariance", ("invariance",)),    # learnable augmentations (LILA) on the evidence
    ("posterior", ("posterior",)),      # prediction, metrics, ArviZ, draws, guide density
    ("guides", ("guides",)),            # guide implementations only
    ("analysis", ("analysis",)),        # tools on a trained posterior
    ("reporting", ("reporting",)),      # pb.compare, the main job's report and command line
]

#: ``(importer, imported)`` deferred imports allowed, each with its reason (at most 3).
DEFERRED_ALLOWED: dict[tuple[str, str], str] = {}

MAX_DEFERRED = 3
MAX_TOP_LEVEL_MODULES = 8


@dataclass(frozen=True)
class Import:
    """One import of a package module by another."""

    importer: str
    imported: str
    line: int
    deferred: bool      # inside a function


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: path}`` of every module of the package (packages by their ``__init__``)."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _function_imports(tree: ast.AST) -> set[int]:
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def parse_imports(name: str, source: str, modules, is_package: bool) -> list[Import]:
    """The imports of package modules in one module's source (``from X import y`` imports
    ``X.y`` when that is a module, else ``X``)."""
    tree = ast.parse(source)
    deferred = _function_imports(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                       for alias in node.names]
        else:
            continue
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name:
                out.append(Import(name, known, node.lineno, id(node) in deferred))
    return out


def package_imports(root: Path = ROOT) -> list[Import]:
    modules = package_modules(root)
    out = []
    for name, path in modules.items():
        out += parse_imports(name, path.read_text(), modules, path.name == "__init__.py")
    return sorted(set(out), key=lambda i: (i.importer, i.imported, i.line))


def layer_of(module: str, layers=LAYERS) -> int:
    """Index of ``module``'s layer; the package root is above all layers."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(layers)
    for index, (_, entries) in enumerate(layers):
        if parts[1] in entries:
            return index
    raise KeyError(f"{module} is in no layer of LAYERS; add its top-level entry {parts[1]!r}")


def upward_imports(imports, layers=LAYERS) -> list[Import]:
    """Imports of a module in a higher layer than the importer's."""
    return [i for i in imports if layer_of(i.imported, layers) > layer_of(i.importer, layers)]


def import_cycles(imports) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.importer, set()).add(i.imported)
        graph.setdefault(i.imported, set())
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def deferred_imports(imports, allowed=DEFERRED_ALLOWED) -> list[Import]:
    """Deferred imports of the package's own modules not in ``allowed``."""
    return [i for i in imports if i.deferred and (i.importer, i.imported) not in allowed]


def top_level_modules(root: Path = ROOT) -> list[str]:
    return sorted(p.name for p in root.glob("*.py"))


def _show(imports) -> str:
    return "\n".join(f"  {i.importer} -> {i.imported} (line {i.line})" for i in imports)


# ------------------------------------------------------------------ the package
def test_every_module_is_in_a_layer():
    for name in package_modules():
        layer_of(name)


def test_no_upward_imports():
    bad = upward_imports(package_imports())
    assert not bad, "imports of a higher layer (LAYERS, lowest first):\n" + _show(bad)


def test_no_import_cycles():
    assert import_cycles(package_imports()) == []


def test_deferred_imports_only_for_heavy_optional_dependencies():
    imports = package_imports()
    bad = deferred_imports(imports)
    assert not bad, "imports of the package's own modules inside functions:\n" + _show(bad)
    assert len(DEFERRED_ALLOWED) <= MAX_DEFERRED


def test_at_most_eight_top_level_modules():
    assert len(top_level_modules()) <= MAX_TOP_LEVEL_MODULES, top_level_modules()


def test_every_package_states_its_role_and_what_it_may_import():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.parent.name}/__init__.py has no docstring"
        layer = layer_of(module_name(init))
        if layer > LAYERS.index(("posterior", ("posterior",))):
            continue        # the top layers may import every layer below (said once, in DEVELOPING.md)
        assert "May import" in doc, f"{init.parent.name}/__init__.py does not say what it may import"


# ------------------------------------------------------------------ the rules can fail
_SYNTHETIC_LAYERS = [("low", ("low",)), ("high", ("high",))]


def _synthetic(sources: dict[str, str]) -> list[Import]:
    """Imports of a synthetic package: a module is a package when others are inside it."""
    modules = set(sources)
    out = []
    for name, src in sources.items():
        is_package = any(other.startswith(name + ".") for other in modules)
        out += parse_imports(name, src, modules, is_package)
    return out


def test_rules_flag_an_upward_import():
    imports = _synthetic({"pkg.low": "from .high import f\n", "pkg.high": "x = 1\n", "pkg": ""})
    assert [(i.importer, i.imported) for i in upward_imports(imports, _SYNTHETIC_LAYERS)] == [
        ("pkg.low", "pkg.high")]
    assert upward_imports(_synthetic({"pkg.high": "from .low import f\n", "pkg.low": "", "pkg": ""}),
                          _SYNTHETIC_LAYERS) == []


def test_rules_flag_a_cycle_and_a_deferred_import():
    imports = _synthetic({
        "pkg.low.a": "from . import b\n",
        "pkg.low.b": "def f():\n    from .a import g\n",
        "pkg.low": "",
        "pkg.high": "import pkg.low.a\n",
    })
    assert import_cycles(imports) == [["pkg.low.a", "pkg.low.b"]]
    assert [(i.importer, i.imported) for i in deferred_imports(imports, {})] == [("pkg.low.b", "pkg.low.a")]
    assert deferred_imports(imports, {("pkg.low.b", "pkg.low.a"): "heavy"}) == []


@pytest.mark.parametrize("source, target", [
    ("from ..data import batches\n", "pkg.data.batches"),       # a module imported from its package
    ("from ..data import make_loader\n", "pkg.data"),           # a name from a package
    ("import pkg.data.batches as b\n", "pkg.data.batches"),
])
def test_parse_imports_resolves_relative_and_absolute_names(source, target):
    modules = {"pkg.x.y", "pkg.data", "pkg.data.batches", "pkg.x"}
    assert [i.imported for i in parse_imports("pkg.x.y", source, modules, False)] == [target]
