"""How kvcache.tree makes a sequence's private blocks and links a committed chain into the tree:
exact slots, keys and links, hand-derived."""

from __future__ import annotations

import hashlib
from array import array

from kvcache.scope import DEFAULT_SCOPE
from kvcache.tree import RadixTree, new_blocks


def test_new_blocks_make_private_pages() -> None:
    blocks = new_blocks(7, DEFAULT_SCOPE, 0, [4, 9], 35)
    assert [(b.uid, b.page, b.tier, b.priority, b.refs) for b in blocks] == [
        (7, 4, 0, 35, 1),
        (8, 9, 0, 35, 1),
    ]
    assert all(not b.in_tree and b.tokens == array("i") and b.parent is None for b in blocks)


def test_a_linked_chain_holds_copies_of_its_tokens_and_its_keys() -> None:
    """Three 2-token blocks from offset 1 of the array, keyed by the chain
    sha256(parent || LE tokens) (WIRE.md section 2), each the only child of the one before."""
    t = RadixTree()
    root = t.root(DEFAULT_SCOPE, create=True)
    assert root is not None
    tokens = array("i", [9, 1, 2, 3, 4, 5, 6, 7])
    blocks = new_blocks(1, DEFAULT_SCOPE, 0, [0, 1, 2], 35)
    t.attach_chain(root, blocks, tokens, 2, start=1)
    tokens[:] = array("i", [0] * 8)  # a later change to the caller's array changes no block
    assert [b.tokens for b in blocks] == [array("i", p) for p in ([1, 2], [3, 4], [5, 6])]
    assert all(type(b.tokens) is array and b.tokens.typecode == "i" for b in blocks)
    assert len({id(b.tokens) for b in blocks}) == 3
    key = root.key
    for b, pair in zip(blocks, ([1, 2], [3, 4], [5, 6]), strict=True):
        key = hashlib.sha256(key + b"".join(x.to_bytes(4, "little") for x in pair)).digest()
        assert b.key == key
    assert root.child is blocks[0] and blocks[0].child is blocks[1]
    assert blocks[1].child is blocks[2] and blocks[2].child is None
    assert [b.parent for b in blocks] == [None, blocks[0], blocks[1]]
    assert all(b.is_full and b.in_tree for b in blocks)
    assert t.num_blocks == 3


def test_a_chain_below_a_node_with_children_joins_them() -> None:
    """A root with three full children (looked up by key) gains a fourth chain; the first
    tokens' counts say which children begin with which token."""
    t = RadixTree()
    root = t.root(DEFAULT_SCOPE, create=True)
    assert root is not None
    for s in range(3):
        toks = array("i", [1000 + s] * 4)
        t.attach_chain(root, new_blocks(100 + s, DEFAULT_SCOPE, 0, [100 + s], 35), toks, 4)
    blocks = new_blocks(1, DEFAULT_SCOPE, 0, [0, 1], 35)
    t.attach_chain(root, blocks, array("i", range(5, 16)), 4, start=2)
    assert [b.tokens.tolist() for b in blocks] == [[7, 8, 9, 10], [11, 12, 13, 14]]
    assert root.children is not None and len(root.children) == 4
    assert root.children[blocks[0].key] is blocks[0] and blocks[0].child is blocks[1]
    assert t.num_blocks == 5
