"""Consistency check of a manager's books (a debugging aid and the oracle of the property tests).

Recomputes from scratch what the manager maintains incrementally and raises
:class:`InconsistentStateError` on the first disagreement: every page of every tier is free or
owned by exactly one block; reference counts equal the sequences holding each block; per-tier
class counts, leaf counts and the tree's block count match; keys chain; a child never sits on a
faster tier than its parent. Cost is linear in the cache size: call it from tests, not per step
of a serving loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from hashlib import sha256

from kvcache.block_pool import BlockPool
from kvcache.errors import KVCacheError
from kvcache.hashing import root_key
from kvcache.tokens import tokens_to_bytes
from kvcache.tree import Block, Node, RadixTree, has_children


class InconsistentStateError(KVCacheError):
    """The manager's books disagree with each other (a bug: please report it with a repro)."""


def _fail(msg: str) -> None:
    raise InconsistentStateError(msg)


def verify(
    tree: RadixTree, pages: BlockPool, holders: Iterable[tuple[Sequence[Block], bool]]
) -> None:
    """Raise :class:`InconsistentStateError` if any invariant is broken. ``holders`` are the
    open sequences: (blocks held, whether suspended)."""
    tpb = pages.tokens_per_block
    tree_blocks = list(tree.iter_blocks())
    if len(tree_blocks) != tree.num_blocks:
        _fail(f"tree counts {tree.num_blocks} blocks but holds {len(tree_blocks)}")
    refs: Counter[Block] = Counter()
    susp: Counter[Block] = Counter()
    private: list[Block] = []
    for held, suspended in holders:
        for b in held:
            (susp if suspended else refs)[b] += 1
            if not b.in_tree:
                private.append(b)
    owners: dict[tuple[int, int], Block] = {}
    for b in [*tree_blocks, *private]:
        if b.page < 0:
            _fail(f"{b} is held but has no page")
        where = (b.tier, b.page)
        if where in owners and owners[where] is not b:
            _fail(f"page {where} owned by {owners[where]} and {b}")
        owners[where] = b
        if pages.pools[b.tier].is_free(b.page):
            _fail(f"{b} owns page {where} which is on the free list")
        if b.refs != refs[b] or b.susp != susp[b]:
            _fail(f"{b}: refs/susp {b.refs}/{b.susp}, sequences hold {refs[b]}/{susp[b]}")
    for t, pool in enumerate(pages.pools):
        owned = sum(1 for tier, _ in owners if tier == t)
        if owned + pool.num_free != pool.num_blocks:
            _fail(f"tier {t}: {owned} owned + {pool.num_free} free != {pool.num_blocks} pages")
        held = [b for b in owners.values() if b.tier == t]
        counts = (
            sum(1 for b in held if b.refs),
            sum(1 for b in held if not b.refs and b.susp),
            sum(1 for b in held if not b.refs and not b.susp),
        )
        if counts != (pages.pinned[t], pages.suspended[t], pages.cached[t]):
            _fail(
                f"tier {t}: pinned/suspended/cached counted {counts}, books say "
                f"{(pages.pinned[t], pages.suspended[t], pages.cached[t])}"
            )
    for b in tree_blocks:
        if not b.in_tree:
            _fail(f"{b} is reachable in the tree but not marked in_tree")
        if b.is_full != (len(b.tokens) == tpb) or not 0 < len(b.tokens) <= tpb:
            _fail(f"{b}: is_full={b.is_full} with {len(b.tokens)} tokens")
        parent_key = root_key(b.scope) if b.parent is None else b.parent.key
        if sha256(parent_key + tokens_to_bytes(b.tokens)).digest() != b.key:
            _fail(f"{b}: key does not chain from its parent")
        if b.parent is not None and b.parent.tier > b.tier:
            _fail(f"{b} sits on a faster tier than its parent {b.parent}")
        here = sum(1 for c in b.iter_children() if c.tier == b.tier)
        if here != b.here:
            _fail(f"{b}: counts {b.here} children on its tier, has {here}")
        if not b.is_full and has_children(b):
            _fail(f"partial {b} has children")
    nodes: list[Node] = [*tree.roots.values(), *tree_blocks]
    for node in nodes:
        _check_full_children(node)
        _check_partial_children(node)


def _check_full_children(node: Node) -> None:
    """One full child inline or a dict of them (never both), each under its key, and the
    per-first-token counts beside the dict."""
    if node.children is None:
        if node.firsts is not None:
            _fail(f"{node} counts first tokens without a children dict")
        return
    if node.child is not None:
        _fail(f"{node} holds a child inline and a children dict")
    if any(k != c.key or not c.is_full for k, c in node.children.items()):
        _fail(f"{node}: a full child is not under its key")
    firsts = Counter(c.tokens[0] for c in node.children.values())
    if node.firsts != dict(firsts):
        _fail(f"{node}: first-token counts {node.firsts}, children say {dict(firsts)}")


def _check_partial_children(node: Node) -> None:
    """The per-first-token counts beside ``partials`` (None without the dict)."""
    if node.partials is None:
        if node.partial_firsts is not None:
            _fail(f"{node} counts partial first tokens without a partials dict")
        return
    firsts = Counter(c.tokens[0] for c in node.partials.values())
    if node.partial_firsts != dict(firsts):
        _fail(f"{node}: partial first-token counts {node.partial_firsts}, partials say {firsts}")
