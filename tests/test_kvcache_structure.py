"""The package's structure rules, read from the source: one writer per kind of block state, and
modules that import each other in one direction only (no circle, not even for type checking)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache

PACKAGE = Path(kvcache.__file__).parent
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


def _imports(tree: ast.Module) -> set[str]:
    """kvcache modules imported anywhere in a module (top level, functions, TYPE_CHECKING)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcache."):
            out.add(node.module.split(".")[1] + ".py")
        elif isinstance(node, ast.Import):
            out |= {
                a.name.split(".")[1] + ".py" for a in node.names if a.name.startswith("kvcache.")
            }
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("kvcache."):
                out.add(str(arg.value).split(".")[1] + ".py")
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_no_import_circle_inside_the_package() -> None:
    graph = {name: _imports(tree) - {"__init__.py"} for name, tree in _modules().items()}
    assert _cycle(graph) is None, _cycle(graph)
    assert "manager.py" not in graph["sequence.py"] | graph["verify.py"]


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycle({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}}) == [
        "a.py",
        "b.py",
        "c.py",
        "a.py",
    ]
    assert _cycle({"a.py": {"b.py"}, "b.py": set()}) is None
