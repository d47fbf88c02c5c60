"""Helpers of the layout tests (``test_layout.py``, ``test_kvcache_structure.py``)."""

from __future__ import annotations


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
