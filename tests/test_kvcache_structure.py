"""The package's structure rules, read from the source: one writer per kind of block state,
modules that import each other in one direction only (no circle, not even for type checking),
and the package at the bottom of the three: it imports nothing from ``events`` or ``router_sim``
(every block hash, ``kvcache.hashing``, is in it), and no C file includes another package's
header."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from layout_helpers import cycle, import_graph

import kvcache

PACKAGE = Path(kvcache.__file__).parent
ROOT = PACKAGE.parent
ABOVE = ("events", "router_sim")  # the packages above kvcache (router_sim above events too)
# Who may write which field of a block (the ownership table of kvcache.tree's docstring).
OWNERS = {
    "tree.py": {
        "key",
        "tokens",
        "is_full",
        "parent",
        "child",
        "children",
        "firsts",
        "partials",
        "partial_firsts",
        "in_tree",
    },
    "block_pool.py": {"tier", "page", "priority", "refs", "susp", "tick", "here", "gen", "uid"},
}


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _stores(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, field) of every attribute written, except ``self.x = ...`` in ``__init__`` (an
    object setting up its own fields)."""
    inits = {
        id(node)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
        for node in ast.walk(f)
    }
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Store):
            continue
        own = isinstance(node.value, ast.Name) and node.value.id == "self" and id(node) in inits
        if not own:
            out.append((node.lineno, node.attr))
    return out


def _writers(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name, tree in modules.items():
        for _, attr in _stores(tree):
            found.setdefault(attr, set()).add(name)
    return found


def test_each_block_field_has_one_writing_module() -> None:
    writers = _writers(_modules())
    for owner, fields in OWNERS.items():
        for field in fields:
            assert writers.get(field, {owner}) <= {owner}, (field, writers[field])


def test_the_ownership_check_sees_a_foreign_write() -> None:
    """The check itself: a sequence that set a page by hand would be caught."""
    modules = _modules()
    modules["sequence.py"] = ast.parse("def f(b):\n    b.page = 3\n    b.here += 1\n")
    writers = _writers(modules)
    assert "sequence.py" in writers["page"] and "sequence.py" in writers["here"]


def test_no_import_circle_inside_the_package() -> None:
    graph = {
        name: edges - {"kvcache"}
        for name, edges in import_graph(ROOT, ("kvcache",)).items()
        if name != "kvcache"
    }
    assert "kvcache.hashing" in graph["kvcache.tree"]  # it read the package
    assert cycle(graph) is None, cycle(graph)
    assert "kvcache.manager" not in graph["kvcache.sequence"] | graph["kvcache.verify"]


def test_the_circle_check_finds_a_circle() -> None:
    assert cycle({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}}) == [
        "a.py",
        "b.py",
        "c.py",
        "a.py",
    ]
    assert cycle({"a.py": {"b.py"}, "b.py": set()}) is None


def _imports_above(tree: ast.Module) -> set[str]:
    """Modules of :data:`ABOVE` imported anywhere in a module (as ``import_graph`` looks)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant):
                names.add(str(arg.value))
    return {n for n in names if n.split(".")[0] in ABOVE}


def test_kvcache_imports_nothing_from_the_packages_above() -> None:
    found = {name: _imports_above(tree) for name, tree in _modules().items()}
    assert not any(found.values()), {name: got for name, got in found.items() if got}
    assert "hashing.py" in found  # every block hash is down here


def test_the_layer_check_sees_an_import_from_above() -> None:
    code = "import events.wire\ndef f():\n    from router_sim.router import indexer\n"
    assert _imports_above(ast.parse(code)) == {"events.wire", "router_sim.router"}


# The import, run on the source (the child takes each .py file first: scripts/pure_python.py's
# finder) and on the build as installed (the compiled modules load the mypyc group's library,
# kvcache._compiled__mypyc, which lives at the bottom too).
_LOADS = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
    if sys.argv[2] == "source":
        from pure_python import source_first
        source_first()
    above = ("events", "router_sim")
    def loaded():
        return sorted(m for m in sys.modules if m.split(".")[0] in above)
    import kvcache.hashing
    assert not loaded(), ("kvcache.hashing", loaded())
    import kvcache
    for info in pkgutil.iter_modules(kvcache.__path__, "kvcache."):
        importlib.import_module(info.name)
        assert not loaded(), (info.name, loaded())
    assert kvcache.hashing.chain_hashes.__module__ == "kvcache.hashing"
    print("ok", len([m for m in sys.modules if m.startswith("kvcache")]))
    """
)


@pytest.mark.parametrize("build", ["source", "installed"])
def test_importing_kvcache_loads_nothing_from_the_packages_above(build: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOADS, str(ROOT), build],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")


def test_c_files_include_only_their_own_package_headers() -> None:
    """A C file's quoted includes are headers beside it, in its own (sub)package's folder: one
    package's extension never builds from another's header (an extension of another package
    that needs its code calls it through a capsule, as router_sim.sim._prefetch calls
    kvcache._v1hash's V1 hash)."""
    sources = [p for pkg in ("kvcache", *ABOVE) for p in sorted((ROOT / pkg).rglob("*.[ch]"))]
    assert ROOT / "kvcache" / "_v1hash.c" in sources
    for source in sources:
        for header in re.findall(r'^\s*#\s*include\s*"([^"]+)"', source.read_text(), re.M):
            found = (source.parent / header).resolve()
            assert found.is_file(), (source, header)
            assert found.parent == source.parent, f"{source.relative_to(ROOT)} includes {header}"
