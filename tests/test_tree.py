"""The radix tree's structure on its own: matching, partial rules, subtrees, scopes."""

from __future__ import annotations

from array import array
from hashlib import sha256

from kvcache import ReuseScope
from kvcache.hashing import blockchain_keys
from kvcache.tokens import tokens_to_bytes
from kvcache.tree import Block, RadixTree, ScopeRoot

TPB = 2


def add(tree: RadixTree, node: Block | ScopeRoot, tokens: list[int], uid: int = 0) -> Block:
    toks = array("i", tokens)
    b = Block(uid, node.scope, 0, uid, 35)
    key = sha256(node.key + tokens_to_bytes(toks)).digest()
    if len(tokens) == TPB:
        tree.attach_chain(node, [b], toks, TPB)
    else:
        tree.attach_partial(b, node, toks)
    assert (b.key, b.tokens, b.parent) == (key, toks, node if isinstance(node, Block) else None)
    return b


def data(tokens: list[int]) -> bytes:
    return tokens_to_bytes(array("i", tokens))


def test_full_match_walks_chained_keys_and_stops_at_first_miss() -> None:
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    a = add(tree, root, [1, 2])
    b = add(tree, a, [3, 4])
    add(tree, b, [5, 6])
    assert tree.match_full(root, data([1, 2, 3, 4, 5, 6]), 3, 4 * TPB)[:2] == [a, b]
    assert tree.match_full(root, data([1, 2, 3, 4]), 2, 4 * TPB) == [a, b]
    assert tree.match_full(root, data([1, 2, 9, 4, 5, 6]), 3, 4 * TPB) == [a]
    assert tree.match_full(root, data([3, 4]), 1, 4 * TPB) == []  # same tokens, other depth
    assert tree.num_blocks == 3


def test_partial_blocks_are_never_full_matches() -> None:
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    p = add(tree, root, [1])
    assert tree.match_full(root, data([1, 2]), 1, 4 * TPB) == []
    assert tree.match_partial(root, array("i", [1, 2]), 2, 32) == (p, 1)


def test_partial_match_takes_longest_prefix_within_limit_and_scan() -> None:
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    add(tree, root, [7, 8])
    c = add(tree, root, [1, 9])
    rest = array("i", [1, 2])
    assert tree.match_partial(root, rest, 2, 32) == (c, 1)
    assert tree.match_partial(root, rest, 0, 32) == (None, 0)
    # the scan is bounded: with one child scanned, [1, 9] (second) is never looked at
    assert tree.match_partial(root, rest, 2, 1) == (None, 0)


def test_useless_and_extending_partials() -> None:
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    add(tree, root, [1, 2])
    p = add(tree, root, [3])
    assert tree.is_useless_partial(root, array("i", [1]))  # prefix of full sibling
    assert tree.is_useless_partial(root, array("i", [3]))  # equal to a partial sibling
    assert not tree.is_useless_partial(root, array("i", [4]))
    assert tree.extended_partial(root, array("i", [3, 4])) is p
    assert tree.extended_partial(root, array("i", [3])) is None  # equal is not an extension
    assert tree.extended_partial(root, array("i", [4, 3])) is None


def test_subtree_is_descendants_first_and_detach_drops_empty_root() -> None:
    tree = RadixTree()
    scope = ReuseScope(lora_id=3)
    root = tree.root(scope, create=True)
    assert root is not None
    a = add(tree, root, [1, 2], 1)
    b = add(tree, a, [3, 4], 2)
    c = add(tree, a, [5], 3)
    d = add(tree, b, [6, 7], 4)
    order = tree.subtree(a)
    assert set(order) == {a, b, c, d} and order[-1] is a
    assert order.index(d) < order.index(b)
    for blk in order:
        tree.detach(blk)
    assert tree.num_blocks == 0
    assert tree.root(scope) is None


def test_scopes_never_share_nodes() -> None:
    tree = RadixTree()
    scopes = [ReuseScope(), ReuseScope(lora_id=0), ReuseScope(salt=0), ReuseScope(0, 0)]
    roots = [tree.root(s, create=True) for s in scopes]
    blocks = [add(tree, r, [1, 2]) for r in roots if r is not None]
    assert len({b.key for b in blocks}) == 4
    for r, b in zip(roots, blocks, strict=True):
        assert r is not None
        others = [o for o in roots if o is not r]
        assert tree.match_full(r, data([1, 2]), 1, 4 * TPB) == [b]
        for o in others:
            assert o is not None
            assert b not in tree.match_full(o, data([1, 2]), 1, 4 * TPB)
    assert [b.scope for b in tree.iter_blocks()] == scopes


def test_attach_chain_keys_match_the_wire_key_chain() -> None:
    """Keys of a chain attached at once equal ``blockchain_keys`` (WIRE.md section 2), and each
    block's parent is the one before it."""
    tree = RadixTree()
    scope = ReuseScope(lora_id=7, salt=9)
    root = tree.root(scope, create=True)
    assert root is not None
    tokens = array("i", [5, 6, 7, 8, 9, 10])
    blocks = [Block(i, scope, 0, i, 35) for i in range(3)]
    tree.attach_chain(root, blocks, tokens, TPB)
    assert [b.key for b in blocks] == blockchain_keys(scope, list(tokens), TPB)
    assert [b.parent for b in blocks] == [None, blocks[0], blocks[1]]
    assert [list(b.tokens) for b in blocks] == [[5, 6], [7, 8], [9, 10]]
    assert tree.match_full(root, data(list(tokens)), 3, 4 * TPB) == blocks
    assert tree.num_blocks == 3 and all(b.is_full and b.in_tree for b in blocks)
