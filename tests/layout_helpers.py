"""Helpers of the layout tests (``test_layout.py``, ``test_kvcache_structure.py``)."""

from __future__ import annotations

import ast
from pathlib import Path


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of ``graph`` (node -> the nodes it points at) as the path round it, first node
    repeated at the end; None when there is none. Depth first, in sorted order."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted name -> file of every Python module of ``packages`` under ``root`` (a package's
    ``__init__.py`` under the package's own name)."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def extensions(root: Path, packages: tuple[str, ...]) -> set[str]:
    """Dotted names of the native extensions: the C files that define a module init."""
    out = set()
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.c")):
            if "PyMODINIT_FUNC" in path.read_text():
                out.add(".".join(path.relative_to(root).with_suffix("").parts))
    return out


def named(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The project modules (of ``known``) one import statement in module ``name`` names: the
    module itself for ``import a.b`` and ``from a.b import c``, the submodule for ``from a
    import b`` when ``a.b`` is a module."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    out = set()
    for alias in node.names:
        full = f"{base}.{alias.name}"
        out.add(full if full in known else base)
    return out & known


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere: top level, inside functions,
    under ``TYPE_CHECKING``, and ``importlib.import_module`` of a constant name."""
    files = module_files(root, packages)
    known = set(files) | extensions(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= named(name, path, node, known)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and arg.value in known:
                    edges.add(str(arg.value))
        graph[name] = edges - {name}
    return graph
