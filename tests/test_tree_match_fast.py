"""The full-block walk compares a lone child's tokens instead of hashing the query block: it
must find exactly the blocks (and the first unmatched key) that the key chain of WIRE.md
section 2 finds, on trees with lone children, many-children nodes and partial leaves."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.tree as tree_mod
from kvcache import ReuseScope
from kvcache.hashing import BlockKey, blockchain_keys
from kvcache.tokens import tokens_to_bytes
from kvcache.tree import Block, Node, RadixTree, ScopeRoot, full_children

TPB = 2
SCOPE = ReuseScope(lora_id=3)
# Few distinct ids, so chains share prefixes and nodes get one or several children; the large
# ones have bytes >= 0x80 (a byte-order or sign slip would show).
TOKEN = st.sampled_from([0, 1, 2, 200, 0x1234_5678, 2**31 - 1])
CHAIN = st.lists(TOKEN, min_size=1, max_size=4 * TPB + 1)


def oracle(
    root: ScopeRoot, query: list[int], max_blocks: int
) -> tuple[list[Block], BlockKey | None]:
    """The walk by keys alone: the query's key chain looked up among each node's full
    children (keys from ``blockchain_keys``, not from the tree's matcher)."""
    keys = blockchain_keys(SCOPE, query[: max_blocks * TPB], TPB)  # max_blocks full blocks
    node: Node = root
    found: list[Block] = []
    for k in keys:
        kids = {c.key: c for c in full_children(node)}
        if not kids:
            return found, None
        nxt = kids.get(k)
        if nxt is None:
            return found, k
        found.append(nxt)
        node = nxt
    return found, None


def build(chains: list[list[int]]) -> tuple[RadixTree, ScopeRoot]:
    """Insert each chain the way the block pool stores a sequence: the cached prefix is
    reused, the rest joins as one chain, a trailing partial block as a leaf."""
    tree = RadixTree()
    root = tree.root(SCOPE, create=True)
    assert root is not None
    uid = 0
    for chain in chains:
        nfull = len(chain) // TPB
        found, _ = oracle(root, chain, nfull)
        node: Node = found[-1] if found else root
        at = len(found) * TPB
        new = [Block(uid + i, SCOPE, 0, uid + i, 35) for i in range(nfull - len(found))]
        uid += len(new) + 1
        if new:
            tree.attach_chain(node, new, array("i", chain), TPB, start=at)
            node = new[-1]
        rest = array("i", chain[nfull * TPB :])
        if (
            rest
            and not tree.is_useless_partial(node, rest)
            and tree.extended_partial(node, rest) is None  # (the pool would replace it)
        ):
            tree.attach_partial(Block(uid, SCOPE, 0, uid, 35), node, rest)
            uid += 1
    return tree, root


@settings(max_examples=300, deadline=None)
@given(
    chains=st.lists(CHAIN, min_size=1, max_size=12),
    query=CHAIN,
    little=st.booleans(),
    scan=st.sampled_from([0, 1, 2, 8]),
)
def test_full_match_equals_the_key_walk(
    chains: list[list[int]], query: list[int], little: bool, scan: int
) -> None:
    tree, root = build(chains)
    data = tokens_to_bytes(array("i", query))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tree_mod, "_LITTLE", little and tree_mod._LITTLE)  # both walks
        m.setattr(tree_mod, "_SCAN_CHILDREN", scan)  # children compared, or looked up by key
        for max_blocks in range(len(query) // TPB + 1):
            want = oracle(root, query, max_blocks)
            got = tree.match_full_key(root, data, max_blocks, 4 * TPB)
            assert got == want
            assert tree.match_full(root, data, max_blocks, 4 * TPB) == want[0]
            blocks, key = tree.match_full_key(root, data, max_blocks, 4 * TPB, want_key=False)
            assert blocks == want[0]
            assert key is None or key == want[1]  # a many-children lookup hashes anyway


def test_lone_child_with_equal_tokens_at_another_depth_is_no_match() -> None:
    """Tokens equal to a lone child's, but under another parent, do not match it (the compare
    only stands in for the key below the same parent)."""
    tree, root = build([[1, 2, 1, 2]])
    a = root.child
    assert a is not None and a.child is not None
    data = tokens_to_bytes(array("i", [1, 2, 1, 2, 1, 2]))
    assert tree.match_full_key(root, data, 3, 4 * TPB) == ([a, a.child], None)
    data = tokens_to_bytes(array("i", [1, 2, 7, 7]))
    key = blockchain_keys(SCOPE, [1, 2, 7, 7], TPB)[1]
    assert tree.match_full_key(root, data, 2, 4 * TPB) == ([a], key)
    assert tree.match_full_key(root, data, 2, 4 * TPB, want_key=False) == ([a], None)  # no hash


@settings(max_examples=300, deadline=None)
@given(
    shared=st.lists(TOKEN, max_size=40),
    a_rest=st.lists(TOKEN, max_size=5),
    b_rest=st.lists(TOKEN, max_size=5),
    limit=st.integers(min_value=0, max_value=50),
)
def test_common_prefix_is_the_first_difference(
    shared: list[int], a_rest: list[int], b_rest: list[int], limit: int
) -> None:
    a, b = array("i", shared + a_rest), array("i", shared + b_rest)
    n = min(len(a), len(b), limit)
    want = next((i for i in range(n) if a[i] != b[i]), n)  # one token at a time
    assert tree_mod._common_prefix(a, b, limit) == want
