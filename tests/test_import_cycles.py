"""No import cycles among the project's modules, and the layering the engine relies on.

Every module under localllm/, tui/, quant/ and models_registry/ is parsed (not imported: nothing
runs, nothing optional needs to be installed) and every import of a project module counts,
module-level or inside a function, absolute or relative; only `if TYPE_CHECKING:` blocks are
left out (they never run). The graph is at module granularity: a package's `__init__` is a node
of its own, `import a.b.c` also runs `a` and `a.b`, and `from a.b import c` names the submodule
`a.b.c` when there is one (else an attribute of `a.b`). A module's own packages have run before
it, so reaching a sibling through them is no edge back to them (`localllm.load` imports the engine
in a function, and the engine is inside `localllm`); naming one for what it defines (`from localllm
import __version__`) is. A cycle is a strongly connected component of more than one module.

Runners (localllm/backends/) import neither the engine nor the model registry: the engine drives
them and resolves model and draft-model files for them.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder → the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"localllm": "localllm", "tui": "localllm.tui", "quant": "localllm.quant",
            "models_registry": "localllm.models_registry"}  # fmt: skip


def modules() -> dict[str, Path]:
    """Every project module by dotted name (a package by its own name, for its `__init__`)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def parents(name: str) -> list[str]:
    """The packages importing `name` runs first: a and a.b for a.b.c (the project's only)."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts))) if m in MODULES]


def imports_of(name: str, path: Path) -> set[str]:
    """The project modules `name` imports.

    A module's own packages have run before it, so importing through them (`from localllm.x
    import y` inside localllm/z.py) is no edge to `localllm`; naming one for what it defines
    (`from localllm import __version__`) is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    mine = {*parents(package), package} if package in MODULES else set(parents(package))
    found: set[str] = set()
    for node in import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            named = [(alias.name, True) for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs)
            named = [(target, len(subs) < len(node.names))]  # False: only submodules taken
        for target, for_itself in named:
            found.update(p for p in parents(target) if p not in mine)
            if target in MODULES and (for_itself or target not in mine):
                found.add(target)
    found.discard(name)  # a module importing itself gets itself back: no cycle
    return found


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and self loops (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g[v]:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(comp: list[str], g: dict[str, set[str]]) -> str:
    """One cycle: its modules, and each import edge inside it."""
    edges = [f"    {a} -> {b}" for a in comp for b in sorted(g[a]) if b in comp]
    return f"  {' , '.join(comp)}\n" + "\n".join(edges)


def test_the_scan_finds_the_project() -> None:
    g = graph()
    assert "localllm.engine.core" in g and "localllm.tui.app" in g
    assert "localllm.quant" in g and "localllm.models_registry.catalog" in g
    # a package's own __init__ is a node: llamacpp takes LLAMACPP_KV_TYPES from it
    assert "localllm.backends" in g["localllm.backends.llamacpp"]


def test_what_counts_as_an_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = """
from typing import TYPE_CHECKING
import p.a
from p.b import c, thing
from . import d
from .d import x
if TYPE_CHECKING:
    import p.hidden
def later():
    from p.q.r import y
"""
    (tmp_path / "m.py").write_text(source)
    (tmp_path / "__init__.py").write_text("VERSION = 1\nfrom p.m import f\n")
    names = ["p", "p.a", "p.b", "p.b.c", "p.d", "p.hidden", "p.q", "p.q.r", "p.m"]
    monkeypatch.setattr(sys.modules[__name__], "MODULES", dict.fromkeys(names, tmp_path / "x.py"))
    # inside p: p's own __init__ has run, so going through it is no edge; p.q's is
    assert imports_of("p.m", tmp_path / "m.py") == {"p.a", "p.b", "p.b.c", "p.d", "p.q", "p.q.r"}
    assert imports_of("p", tmp_path / "__init__.py") == {"p.m"}
    # naming a package for what it defines is an edge to it, even from inside
    (tmp_path / "m.py").write_text("from p import VERSION\n")
    assert imports_of("p.m", tmp_path / "m.py") == {"p"}


def test_no_import_cycles() -> None:
    g = graph()
    found = cycles(g)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(c, g) for c in found)


@pytest.mark.parametrize("forbidden", ["localllm.engine", "localllm.models_registry"])
def test_runners_never_import_the_engine_or_the_registry(forbidden: str) -> None:
    """A backend is a runner: the engine drives it and resolves models (and draft models) for it."""
    g = graph()
    bad = sorted(f"{m} -> {t}" for m in g if m.startswith("localllm.backends")
                 for t in g[m] if t == forbidden or t.startswith(forbidden + "."))  # fmt: skip
    assert not bad, "\n".join(bad)


def test_cycle_finder() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(g) == [["a", "b", "c"], ["e"]]
