"""Property tests: the tree's sibling scans and the token packing against plain reference code.

The tree keeps a node's only full child inline and counts full children by first token so that
partial matching can skip whole nodes; these tests build random sibling sets (full and partial
children, some removed again) and compare every scan with a direct reading of its documented
rule over the siblings in scan order (partial children, then full ones, each in the order they
joined). ``token_array_bytes`` is compared with an int-by-int packing.
"""

from __future__ import annotations

import struct
from array import array

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvcache import ReuseScope
from kvcache.tokens import token_array, token_array_bytes, tokens_to_bytes
from kvcache.tree import Block, RadixTree, ScopeRoot, full_children

TPB = 4
# a small alphabet, so that siblings often share first tokens and longer prefixes
TOKENS = st.integers(0, 3)
CHILD = st.lists(TOKENS, min_size=1, max_size=TPB)


def _siblings_in_scan_order(node: Block | ScopeRoot) -> list[Block]:
    partials = list(node.partials.values()) if node.partials else []
    return partials + list(full_children(node))


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ref_match_partial(
    node: Block | ScopeRoot, rest: list[int], limit: int, max_scan: int
) -> tuple[Block | None, int]:
    best: Block | None = None
    best_len = 0
    for child in _siblings_in_scan_order(node)[: max(0, max_scan)] if limit > 0 else []:
        n = _common(list(child.tokens), rest[:limit])
        if n > best_len:
            best, best_len = child, n
    return best, best_len


def ref_is_useless(node: Block | ScopeRoot, tokens: list[int]) -> bool:
    return any(list(s.tokens[: len(tokens)]) == tokens for s in _siblings_in_scan_order(node))


def ref_extended(node: Block | ScopeRoot, tokens: list[int]) -> Block | None:
    for s in node.partials.values() if node.partials else []:
        if len(s.tokens) < len(tokens) and tokens[: len(s.tokens)] == list(s.tokens):
            return s
    return None


def _build(
    children: list[list[int]], removed: list[int], under_block: bool
) -> tuple[RadixTree, Block | ScopeRoot]:
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    node: Block | ScopeRoot = root
    if under_block:  # the parent is a block, not a scope root
        parent = Block(0, root.scope, 0, 0, 35)
        tree.attach_chain(root, [parent], array("i", [9] * TPB), TPB)
        node = parent
    added: list[Block] = []
    seen: set[tuple[int, ...]] = set()
    for i, toks in enumerate(children, 1):
        if tuple(toks) in seen:
            continue  # the same tokens under the same parent are the same block
        seen.add(tuple(toks))
        b = Block(i, root.scope, 0, i, 35)
        if len(toks) == TPB:
            tree.attach_chain(node, [b], array("i", toks), TPB)
        else:
            tree.attach_partial(b, node, array("i", toks))
        added.append(b)
    for i in sorted({r % len(added) for r in removed} if added else (), reverse=True):
        if added[i].in_tree:
            tree.detach(added[i])
    return tree, node


@settings(max_examples=300, deadline=None)
@given(
    children=st.lists(CHILD, max_size=12),
    removed=st.lists(st.integers(0, 20), max_size=6),
    under_block=st.booleans(),
    query=st.lists(TOKENS, min_size=1, max_size=TPB),
    limit=st.integers(0, TPB),
    max_scan=st.one_of(st.integers(0, 3), st.integers(0, 14)),
)
def test_scans_agree_with_the_reading_of_their_rules(
    children: list[list[int]],
    removed: list[int],
    under_block: bool,
    query: list[int],
    limit: int,
    max_scan: int,
) -> None:
    _tree, node = _build(children, removed, under_block)
    rest = array("i", query[:limit])
    assert RadixTree.match_partial(node, rest, len(rest), max_scan) == ref_match_partial(
        node, query, len(rest), max_scan
    )
    q = array("i", query)
    assert RadixTree.is_useless_partial(node, q) == ref_is_useless(node, query)
    assert RadixTree.extended_partial(node, q) is ref_extended(node, query)
    # the inline child, the dict and the first-token counts say the same thing
    full = list(full_children(node))
    if node.children is None:
        assert node.firsts is None and len(full) <= 1
    else:
        assert node.child is None
        counts: dict[int, int] = {}
        for c in full:
            counts[c.tokens[0]] = counts.get(c.tokens[0], 0) + 1
        assert node.firsts == counts
    partial_counts: dict[int, int] = {}
    for c in node.partials.values() if node.partials else ():
        partial_counts[c.tokens[0]] = partial_counts.get(c.tokens[0], 0) + 1
    assert node.partial_firsts == (None if node.partials is None else partial_counts)


def test_partial_children_count_towards_the_scan_limit_even_when_skipped() -> None:
    """Two partial children that cannot match use up a scan limit of 2: the full child that
    would match is past the limit (the partial ones are scanned first)."""
    _tree, root = _build([[2], [2, 2], [1, 1, 1, 1]], [], False)
    query = array("i", [1, 1, 1])
    assert RadixTree.match_partial(root, query, 3, 2) == (None, 0)
    full = next(iter(full_children(root)))
    assert RadixTree.match_partial(root, query, 3, 3) == (full, 3)


def test_a_second_full_child_keeps_the_first_one_first() -> None:
    tree, root = _build([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]], [], False)
    assert [c.tokens[0] for c in full_children(root)] == [1, 2, 3]
    first = next(iter(full_children(root)))
    tree.detach(first)
    assert [c.tokens[0] for c in full_children(root)] == [2, 3]
    assert root.firsts == {2: 1, 3: 1}


def test_the_last_child_leaving_takes_an_inline_child_away() -> None:
    tree, root = _build([[1, 1, 1, 1]], [], False)
    assert isinstance(root, ScopeRoot) and root.child is not None and root.children is None
    tree.detach(root.child)
    assert tree.roots == {}  # a scope root goes with its last child


INT32 = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(INT32, max_size=40), st.booleans())
def test_packing_checks_signs_and_gives_the_key_bytes(values: list[int], as_array: bool) -> None:
    tokens = array("i", values) if as_array else values
    if any(v < 0 for v in values):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
            token_array_bytes(tokens)
        with pytest.raises(ValueError):
            token_array(tokens)
        return
    arr, data = token_array_bytes(tokens)
    assert arr.tolist() == values
    assert data == b"".join(struct.pack("<i", v) for v in values) == tokens_to_bytes(arr)


@pytest.mark.parametrize("bad", [-1, -(2**31), -256, -(2**24)])
def test_every_negative_high_byte_is_caught(bad: int) -> None:
    with pytest.raises(ValueError):
        token_array_bytes(array("i", [5, 0x7FFFFFFF, bad, 7]))
