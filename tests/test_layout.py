"""The three packages' layout rules, read from the source (the kvcache package's own rules are
in ``test_kvcache_structure.py``):

- no import circle anywhere in the project: the modules of ``kvcache``, ``events`` and
  ``router_sim`` import each other in one direction only, counting every import (top level,
  inside functions, under ``TYPE_CHECKING``, ``importlib.import_module`` of a constant name);
- each native extension is imported by one module of the packages, the one place it is loaded;
- no reference twin beside the code it mirrors (no ``*_py`` function in the packages: the pure
  references live in ``tests/_reference.py``), and no ``except ImportError`` switch between a
  native path and a Python one: such a handler guards an optional library only;
- one writer of msgpack payloads, ``events.wire.codec`` (``encode_payload``), and no wire
  event written as a dict (``{"type": "BlockStored", ...}``): every writer's events are the
  Structs of ``events.wire.structs.writer_types``.

Each check is also run on a small tree written here that breaks its rule, so that a check that
read nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layout_helpers import cycle, extensions, import_graph, module_files, named

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvcache", "events", "router_sim")


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_no_import_circle_in_the_project() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100 and "router_sim.router.routing" in graph  # it read the tree
    assert "kvcache.hashing" in graph["router_sim.router.routing"]
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_circle_check_follows_every_kind_of_import(tmp_path: Path) -> None:
    """A circle made of a relative import, a ``from package import submodule``, an import
    inside a function and one under TYPE_CHECKING is found; without its last link it is not."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from pkg.sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "pkg/d.py": "import importlib\nimportlib.import_module('pkg.a')\n",
    }
    graph = import_graph(_write(tmp_path, files), ("pkg",))
    assert cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.a"]
    (tmp_path / "pkg" / "d.py").write_text("")
    assert cycle(import_graph(tmp_path, ("pkg",))) is None


def _loaders(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    graph = import_graph(root, packages)
    return {
        ext: {name for name, edges in graph.items() if ext in edges}
        for ext in sorted(extensions(root, packages))
    }


def test_each_native_extension_is_loaded_in_one_place() -> None:
    loaders = _loaders(ROOT, PACKAGES)
    assert set(loaders) == {
        "kvcache._v1hash",
        "events.wire._wire",
        "router_sim.router._match",
        "router_sim.sim._prefetch",
    }
    assert {ext: len(names) for ext, names in loaders.items()} == dict.fromkeys(loaders, 1), loaders


def test_the_loading_check_sees_a_second_loader(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/_fast.c": "PyMODINIT_FUNC PyInit__fast(void) { return 0; }\n",
        "pkg/one.py": "from pkg import _fast\n",
        "pkg/two.py": "def f():\n    import pkg._fast\n",
    }
    assert _loaders(_write(tmp_path, files), ("pkg",)) == {"pkg._fast": {"pkg.one", "pkg.two"}}


def _twins_and_switches(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``*_py`` functions, and ``except ImportError`` handlers whose ``try`` imports a project
    module (a switch between two implementations), as ``file:line``."""
    found = []
    files = module_files(root, packages)
    known = set(files) | extensions(root, packages)
    for name, path in files.items():
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith(
                "_py"
            ):
                found.append(f"{where}:{node.lineno} {node.name}")
            if not isinstance(node, ast.Try):
                continue
            guards = {
                n.id
                for h in node.handlers
                if h.type is not None
                for n in ast.walk(h.type)
                if isinstance(n, ast.Name)
            }
            if not guards & {"ImportError", "ModuleNotFoundError"}:
                continue
            for inner in (n for stmt in node.body for n in ast.walk(stmt)):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and named(
                    name, path, inner, known
                ):
                    found.append(f"{where}:{inner.lineno} import switch")
    return found


def test_no_reference_twin_or_import_switch_in_the_packages() -> None:
    assert _twins_and_switches(ROOT, PACKAGES) == []


def test_the_twin_check_sees_a_twin_and_a_switch(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/_fast.c": "PyMODINIT_FUNC PyInit__fast(void) { return 0; }\n",
        "pkg/one.py": (
            "try:\n    from pkg._fast import run\nexcept ImportError:\n    run = None\n"
            "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n"
            "def run_py():\n    pass\n"
        ),
    }
    assert _twins_and_switches(_write(tmp_path, files), ("pkg",)) == [
        "pkg/one.py:2 import switch",
        "pkg/one.py:9 run_py",
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_of_the_packages_is_read(package: str) -> None:
    """The checks above read every module: each package's files are in the graph."""
    files = set((ROOT / package).rglob("*.py"))
    graph = import_graph(ROOT, PACKAGES)
    assert len(files) == sum(1 for name in graph if name.split(".")[0] == package)


_WIRE_KINDS = frozenset(
    {"BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockUpdated", "CacheCreated"}
)
_ENCODERS = frozenset({"Encoder", "encode", "packb", "Packer"})


def _writers(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Where a module builds a msgpack writer or writes with one (msgspec's ``Encoder`` /
    ``encode``, msgpack's ``packb`` / ``Packer``), and dict displays of a wire event (a
    ``"type"`` key holding an event type's name), as ``module:line what``."""
    found = []
    for name, path in module_files(root, packages).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _ENCODERS:
                base = ast.unparse(node.value)
                if base.endswith("msgpack"):
                    found.append(f"{name}:{node.lineno} {base}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("msgpack"):
                for alias in node.names:
                    if alias.name in _ENCODERS:
                        found.append(f"{name}:{node.lineno} {node.module}.{alias.name}")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "type"
                        and isinstance(value, ast.Constant)
                        and value.value in _WIRE_KINDS
                    ):
                        found.append(f"{name}:{node.lineno} {value.value} as a dict")
    return found


def test_one_writer_of_payloads_and_no_wire_event_as_a_dict() -> None:
    # the writer's one Encoder, wherever its line
    found = [f"{w.split(':')[0]} {w.split(' ', 1)[1]}" for w in _writers(ROOT, PACKAGES)]
    assert found == ["events.wire.codec msgspec.msgpack.Encoder"]


def test_the_writer_check_sees_a_second_writer_and_a_dict_event(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/one.py": (
            "import msgspec\nfrom msgpack import packb\n"
            "E = msgspec.msgpack.Encoder()\n"
            "def f():\n    return msgspec.msgpack.encode({'type': 'BlockRemoved', 'x': 1})\n"
            "READ = {'type': 'other'}\n"
        ),
    }
    assert _writers(_write(tmp_path, files), ("pkg",)) == [
        "pkg.one:2 msgpack.packb",
        "pkg.one:3 msgspec.msgpack.Encoder",
        "pkg.one:5 msgspec.msgpack.encode",
        "pkg.one:5 BlockRemoved as a dict",
    ]
