"""The scoped block radix tree: structure only.

::

    roots[scope] --key--> block 0 --key--> block 1 --key--> block 2 (full)
        (root_key)                     \\--partials--> [7, 8] (partial, last of its chain)

One :class:`ScopeRoot` per :class:`~kvcache.scope.ReuseScope`, keyed by ``root_key(scope)``.
A child is found by its chained key ``sha256(parent_key || tokens)``, so two scopes never share
a node. Full children live in ``children``; partial blocks (fewer than ``tokens_per_block``
tokens, always leaves) live in ``partials`` so that a full-block walk never lands on one.

A node's only full child sits in ``child`` and ``children`` stays None; the dict is made when a
second full child comes (the first moves into it, so the order stays insertion order) and kept
from then on, with ``firsts`` beside it (how many full children begin with each token, so a
partial match skips a node's children when none can share a token with the query);
``partial_firsts`` counts the ``partials`` the same way. Most blocks
are links of one chain: a dict each would be a third garbage-collected object per cached block
beside the block and its token array, and the cyclic collector's full passes grow with their
number.

Ownership of a :class:`Block`'s fields (each is written by one module only; a test checks it):
this module writes the structure (``key``, ``tokens``, ``is_full``, ``parent``, ``child``,
``children``, ``firsts``, ``partials``, ``partial_firsts``, ``in_tree``);
:mod:`kvcache.block_pool` writes the page state (``tier``, ``page``, ``priority``, ``refs``,
``susp``, ``tick``, ``here``, ``gen``, ``uid``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Collection, Iterator, Sequence
from hashlib import sha256
from itertools import islice
from typing import Final

from kvcache.hashing import BlockKey, chain_keys, root_key
from kvcache.scope import ReuseScope
from kvcache.tokens import pack_range, tokens_to_bytes

_LITTLE: Final = sys.byteorder == "little"
# Up to this many full children are compared one by one rather than looked up by the query
# block's key: a compare is ~0.1 us, hashing a 512-token block ~1.5 us.
_SCAN_CHILDREN: Final = 8
_NO_KEY: Final = BlockKey(b"")
_NO_TOKENS: Final = array("i")  # shared by every block not in the tree; never mutated


class ScopeRoot:
    """The root of one scope: holds no tokens and no page."""

    __slots__ = ("child", "children", "firsts", "key", "partial_firsts", "partials", "scope")

    def __init__(self, scope: ReuseScope) -> None:
        self.scope = scope
        self.key: BlockKey = root_key(scope)
        self.child: Block | None = None
        self.children: dict[bytes, Block] | None = None
        self.firsts: dict[int, int] | None = None
        self.partials: dict[bytes, Block] | None = None
        self.partial_firsts: dict[int, int] | None = None


class Block:
    """One block of a chain: a tree node (``in_tree``) or a page a sequence holds privately.

    Satisfies :class:`kvcache.sink.BlockView`. The page state is the block pool's: ``tier``,
    ``page`` (slot in that tier's pool), ``refs`` (live sequences pinning it), ``susp``
    (suspended sequences holding it), ``tick`` (last release), ``here`` (children on the same
    tier), ``gen`` (invalidates stale eviction-heap entries), ``uid`` (creation order). A block
    taken out of the tree keeps its key, tokens and parent for the sink's sake.
    """

    __slots__ = (
        "child",
        "children",
        "firsts",
        "gen",
        "here",
        "in_tree",
        "is_full",
        "key",
        "page",
        "parent",
        "partial_firsts",
        "partials",
        "priority",
        "refs",
        "scope",
        "susp",
        "tick",
        "tier",
        "tokens",
        "uid",
    )

    def __init__(self, uid: int, scope: ReuseScope, tier: int, page: int, priority: int) -> None:
        self.uid = uid
        self.scope = scope
        self.tier = tier
        self.page = page
        self.priority = priority
        self.key: BlockKey = _NO_KEY
        self.tokens: array[int] = _NO_TOKENS
        self.parent: Block | None = None
        self.child: Block | None = None
        self.children: dict[bytes, Block] | None = None
        self.firsts: dict[int, int] | None = None
        self.partials: dict[bytes, Block] | None = None
        self.partial_firsts: dict[int, int] | None = None
        self.is_full = False
        self.in_tree = False
        self.refs = 1
        self.susp = 0
        self.tick = 0
        self.here = 0
        self.gen = 0

    def __repr__(self) -> str:
        where = "tree" if self.in_tree else "private"
        return (
            f"Block(uid={self.uid}, {where}, key={self.key[:4].hex()}, tokens={len(self.tokens)}, "
            f"tier={self.tier}, page={self.page}, refs={self.refs}, susp={self.susp})"
        )

    def iter_children(self) -> Iterator[Block]:
        """Full children, then partial children."""
        yield from full_children(self)
        if self.partials:
            yield from self.partials.values()


Node = Block | ScopeRoot


def new_blocks(
    first_uid: int, scope: ReuseScope, tier: int, pages: list[int], priority: int
) -> list[Block]:
    """One new private block per page of ``pages``, with uids from ``first_uid`` on (a sequence
    grows by runs of pages)."""
    return [Block(first_uid + i, scope, tier, page, priority) for i, page in enumerate(pages)]


def full_children(node: Node) -> Collection[Block]:
    """``node``'s full children, in the order they joined."""
    if node.children is not None:
        return node.children.values()
    return () if node.child is None else (node.child,)


def _starting(node: Node, first: int) -> Collection[Block]:
    """``node``'s full children to scan for one whose tokens begin with ``first``: none when
    the per-token counts say that no child does (a shared system prompt's last block may have
    hundreds of children, one per conversation that went on from it)."""
    children = node.children
    if children is None:
        return () if node.child is None else (node.child,)
    firsts = node.firsts
    return children.values() if firsts is not None and firsts.get(first) else ()


def _count(firsts: dict[int, int] | None, child: Block, sign: int) -> None:
    """Count ``child`` in (or out of) its parent's ``firsts`` or ``partial_firsts``."""
    assert firsts is not None
    t = child.tokens[0]
    n = firsts.get(t, 0) + sign
    if n:
        firsts[t] = n
    else:
        del firsts[t]


def _partials_starting(node: Node, first: int) -> Collection[Block]:
    """``node``'s partial children to scan for one whose tokens begin with ``first`` (none when
    the counts say no partial child does)."""
    partials = node.partials
    if not partials:
        return ()
    firsts = node.partial_firsts
    return partials.values() if firsts is not None and firsts.get(first) else ()


def _adopt(node: Node, b: Block) -> None:
    """Make the full block ``b`` (key and tokens set) a child of ``node``."""
    children = node.children
    if children is not None:
        children[b.key] = b
        _count(node.firsts, b, 1)
    elif node.child is None:
        node.child = b
    else:  # a second full child: both go into a dict, the first one first
        first = node.child
        node.children = {first.key: first, b.key: b}
        node.firsts = {first.tokens[0]: 1}
        _count(node.firsts, b, 1)
        node.child = None


def has_children(node: Node) -> bool:
    """Whether any block (full or partial) hangs below ``node``."""
    return node.child is not None or bool(node.children) or bool(node.partials)


def _common_prefix(a: array[int], b: array[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``. Past the first few
    tokens the first difference is found by halving (slice compares run in C): a long shared
    run costs about log2(tokens_per_block) compares, not a Python step per token."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < 8:  # most partial candidates differ early (their first token was checked)
        if a[i] != b[i]:
            return i
        i += 1
    lo, hi = i, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _siblings(node: Node) -> Iterator[Block]:
    if node.partials:
        yield from node.partials.values()
    yield from full_children(node)


def _missed_key(
    parent: Node, data: bytes, start: int, step: int, want_key: bool
) -> BlockKey | None:
    """The key of the block ``data[start : start + step]`` below ``parent``, which no child
    holds (None when the caller does not want it)."""
    if not want_key:
        return None
    return chain_keys(parent.key, data, start, step, 1)[0]


class RadixTree:
    """Scope roots and the structural operations on blocks."""

    __slots__ = ("num_blocks", "roots")

    def __init__(self) -> None:
        self.roots: dict[ReuseScope, ScopeRoot] = {}
        self.num_blocks = 0

    def root(self, scope: ReuseScope, create: bool = False) -> ScopeRoot | None:
        """The root of ``scope``; created on demand when ``create``."""
        root = self.roots.get(scope)
        if root is None and create:
            root = self.roots[scope] = ScopeRoot(scope)
        return root

    def match_prefix(
        self,
        tokens: array[int],
        scope: ReuseScope,
        tpb: int,
        partial: bool,
        max_scan: int,
        first_window: int,
        keys: Sequence[BlockKey] | None = None,
    ) -> tuple[list[Block], Block | None, int]:
        """The longest reusable prefix of ``tokens`` under ``scope``: (its full blocks, the
        block to copy a partial prefix from (with ``partial``, scanning at most ``max_scan``
        children), the tokens reused from it).

        ``keys``: the chain keys of ``tokens``'s full blocks, when the caller has them (at
        least every block that may be reused): the full blocks are then found by key alone,
        no token is packed, compared or hashed.

        At most ``len(tokens) - 1`` tokens are reused. The tokens are packed window by window,
        the first of ``first_window`` tokens, each next four times the last, while every block
        of the window matches: a long prompt that shares only its first blocks with the tree
        (most of them) is not packed to its end, and one that shares all of them is packed
        about once."""
        n = len(tokens)
        root = self.roots.get(scope)
        if root is None or n < 2:
            return [], None, 0
        max_full = (n - 1) // tpb
        full: list[Block] = []
        node: Node = root
        if keys is not None and len(keys) >= max_full:
            full = RadixTree.match_keys(root, keys, max_full)
        else:
            step = 4 * tpb
            done = 0
            window = max(1, first_window // tpb)
            while done < max_full:
                take = min(window, max_full - done)
                data = pack_range(tokens, done * tpb, (done + take) * tpb)
                found = RadixTree.match_full(node, data, take, step)
                full += found
                if len(found) < take:
                    break
                node = found[-1]
                done += take
                window *= 4
        if not partial:
            return full, None, 0
        start = len(full) * tpb
        limit = min(tpb, n - 1 - start)
        node = full[-1] if full else root
        src, m = RadixTree.match_partial(node, tokens[start : start + limit], limit, max_scan)
        return full, src, m

    @staticmethod
    def match_keys(node: Node, keys: Sequence[BlockKey], max_blocks: int) -> list[Block]:
        """The longest chain of full blocks under ``node`` whose keys are ``keys``'s first
        ones (at most ``max_blocks``)."""
        found: list[Block] = []
        children = node.children
        child = node.child
        for i in range(min(max_blocks, len(keys))):
            key = keys[i]
            if children is None:
                if child is None or child.key != key:
                    break
                block = child
            else:
                found_block = children.get(key)
                if found_block is None:
                    break
                block = found_block
            found.append(block)
            children = block.children
            child = block.child
        return found

    def prefix_blocks(self, scope: ReuseScope, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``'s first ones name a chain of full blocks from ``scope``'s root
        (any tier): the length of what :meth:`match_keys` finds there."""
        root = self.roots.get(scope)
        return 0 if root is None else len(RadixTree.match_keys(root, keys, len(keys)))

    @staticmethod
    def match_full(node: Node, data: bytes, max_blocks: int, step: int) -> list[Block]:
        """The longest chain of full blocks under ``node`` whose tokens are ``data``'s blocks.

        ``data`` is the packed 4-byte LE token bytes; ``step`` = 4 * tokens_per_block.
        """
        return RadixTree.match_full_key(node, data, max_blocks, step, want_key=False)[0]

    @staticmethod
    def match_full_key(
        node: Node, data: bytes, max_blocks: int, step: int, want_key: bool = True
    ) -> tuple[list[Block], BlockKey | None]:
        """:meth:`match_full`, and the key of the first block that did not match when it was
        computed on the way (None otherwise): a block pool storing that chain next would only
        hash the same bytes again. Without ``want_key`` a lone child's mismatch is not hashed
        (the key comes back only where a lookup computed it). ``data`` may run past
        ``max_blocks`` blocks.

        Below a node with few full children their tokens are compared with the query's
        instead of hashing: all keys chain from the same parent key, so they are equal exactly
        when the tokens are (``sha256`` collisions aside), and a compare of a block's bytes
        (memcmp, mostly ending at the first token) costs a small fraction of hashing them.
        Only a node with more than ``_SCAN_CHILDREN`` children is looked up by key.
        """
        if not _LITTLE:  # block tokens are native-endian, ``data`` little-endian
            return RadixTree._match_by_key(node, data, max_blocks, step)
        found: list[Block] = []
        prev: Node = node
        children = node.children
        child = node.child
        for start in range(0, max_blocks * step, step):
            if children is None:
                if child is None:
                    break
                # ``startswith`` compares the array's bytes in place (no slice is made)
                if not data.startswith(child.tokens, start):
                    return found, _missed_key(prev, data, start, step, want_key)
                block = child
            elif len(children) <= _SCAN_CHILDREN:
                if not children:  # the dict stays once made, and may be empty
                    break
                for block in children.values():  # at most one child can hold these tokens
                    if data.startswith(block.tokens, start):
                        break
                else:
                    return found, _missed_key(prev, data, start, step, want_key)
            else:
                key = chain_keys(prev.key, data, start, step, 1)[0]
                found_block = children.get(key)
                if found_block is None:
                    return found, key
                block = found_block
            found.append(block)
            prev = block
            children = block.children
            child = block.child
        return found, None

    @staticmethod
    def _match_by_key(
        node: Node, data: bytes, max_blocks: int, step: int
    ) -> tuple[list[Block], BlockKey | None]:
        """:meth:`match_full_key` by hashing every block (any byte order)."""
        found: list[Block] = []
        key: bytes = node.key
        children = node.children
        child = node.child
        for start in range(0, max_blocks * step, step):
            if child is None and not children:  # no full child (``child`` or the dict)
                break
            key = sha256(key + data[start : start + step]).digest()
            if children is None:
                block = child if child is not None and child.key == key else None
            else:
                block = children.get(key)
            if block is None:
                return found, BlockKey(key)
            found.append(block)
            children = block.children
            child = block.child
        return found, None

    @staticmethod
    def match_partial(
        node: Node, rest: array[int], limit: int, max_scan: int
    ) -> tuple[Block | None, int]:
        """The child of ``node`` sharing the longest token prefix with ``rest`` (at most
        ``limit`` tokens), scanning at most ``max_scan`` children (partial ones first)."""
        best: Block | None = None
        best_len = 0
        if limit <= 0:
            return None, 0
        # A child whose first token differs shares nothing: one int comparison rules out most
        # of the scanned children before any slice is made (most siblings differ from the
        # first token on). Children past ``max_scan`` are never looked at.
        # Every partial child counts towards ``max_scan`` (they come first), skipped or not.
        first = rest[0]
        scans = (
            (_partials_starting(node, first), max_scan),
            (_starting(node, first), max_scan - len(node.partials or ())),
        )
        for table, left in scans:
            if not table or left <= 0:
                continue
            for child in islice(table, left):
                tokens = child.tokens
                if tokens[0] != first:
                    continue
                n = _common_prefix(tokens, rest, limit)
                if n > best_len:
                    best, best_len = child, n
                    if n == limit:
                        return best, best_len
        return best, best_len

    @staticmethod
    def is_useless_partial(node: Node, tokens: array[int]) -> bool:
        """A partial block whose tokens are a prefix of a sibling's adds nothing reusable."""
        n = len(tokens)
        if not n:
            return has_children(node)
        # A tree block holds at least one token (verify checks it), so its first token rules
        # it out before a slice is made.
        first = tokens[0]
        for table in (_partials_starting(node, first), _starting(node, first)):
            for sib in table:
                t = sib.tokens
                if t[0] == first and t[:n] == tokens:
                    return True
        return False

    @staticmethod
    def extended_partial(node: Node, tokens: array[int]) -> Block | None:
        """The partial sibling whose tokens are a strict prefix of ``tokens``, if any."""
        if not node.partials:
            return None
        size = len(tokens)
        if not size:
            return None
        first = tokens[0]
        for sib in _partials_starting(node, first):
            t = sib.tokens
            if t[0] == first and len(t) < size and tokens[: len(t)] == t:
                return sib
        return None

    def attach_chain(
        self,
        node: Node,
        blocks: Sequence[Block],
        tokens: array[int],
        tpb: int,
        *,
        start: int = 0,
        data: bytes | None = None,
        first_key: bytes | None = None,
        keys: Sequence[BlockKey] | None = None,
    ) -> None:
        """Make ``blocks`` a chain of full blocks below ``node``: block ``j`` holds
        ``tokens[start + j * tpb : start + (j + 1) * tpb]`` and gets the key chained from its
        parent's.

        ``data``, when given, is those tokens' 4-byte LE encoding from the chain's first block
        on (it may run longer), and ``first_key`` the first block's key if already known
        (:meth:`match_full_key`): the caller has them, so nothing is packed or hashed twice.
        ``keys``, when given (not empty), are the keys of the chain's first blocks (at most
        ``len(blocks)``), computed by the caller from the same tokens: only the rest are
        hashed.
        """
        step = 4 * tpb
        count = len(blocks)
        if not count:
            return
        known = 0 if keys is None else min(len(keys), count)
        chain: list[BlockKey]
        if keys is not None and known == count:
            chain = keys if type(keys) is list and len(keys) == count else list(keys[:count])
        else:
            if data is None:
                data = tokens_to_bytes(tokens[start : start + count * tpb])
            # every key of the run in one call
            if keys is not None and known:
                rest = chain_keys(keys[known - 1], data, known * step, step, count - known)
                chain = [*keys[:known], *rest]
            elif first_key is None:
                chain = chain_keys(node.key, data, 0, step, count)
            else:
                chain = chain_keys(first_key, data, step, step, count - 1)
                chain.insert(0, first_key)  # type: ignore[arg-type]  # a BlockKey
        parent = node if isinstance(node, Block) else None
        prev: Node = node
        pos = start
        for j in range(count):
            b = blocks[j]
            b.key = chain[j]
            b.tokens = tokens[pos : pos + tpb]
            b.is_full = True
            b.parent = parent
            b.in_tree = True
            _adopt(prev, b)
            prev = parent = b
            pos += tpb
        self.num_blocks += len(blocks)

    def attach_partial(self, block: Block, node: Node, tokens: array[int]) -> None:
        """Make ``block``, holding ``tokens`` (fewer than a full block), a leaf below ``node``."""
        data = tokens_to_bytes(tokens)
        # chain_keys too (not hashlib) for the one partial block of a sequence: where it is
        # native, hashlib's first call after a run of native keying costs twice its hash
        # (its code has gone cold). A block holds at least one token (ValueError otherwise).
        key = chain_keys(node.key, data, 0, len(data), 1)[0]
        block.key = key
        block.tokens = tokens
        block.parent = node if isinstance(node, Block) else None
        block.in_tree = True
        if node.partials is None:
            node.partials = {}
            node.partial_firsts = {}
        node.partials[key] = block
        _count(node.partial_firsts, block, 1)
        self.num_blocks += 1

    def detach(self, block: Block) -> None:
        """Take ``block`` out of its parent's children (its own children are left alone); a
        scope root goes with its last child."""
        node: Node = block.parent or self.roots[block.scope]
        assert block.in_tree
        if block.is_full and node.children is None:
            assert node.child is block
            node.child = None
        else:
            table = node.children if block.is_full else node.partials
            assert table is not None
            del table[block.key]
            _count(node.firsts if block.is_full else node.partial_firsts, block, -1)
        block.in_tree = False
        self.num_blocks -= 1
        if isinstance(node, ScopeRoot) and not has_children(node):
            del self.roots[node.scope]

    @staticmethod
    def subtree(block: Block) -> list[Block]:
        """``block`` and every descendant, descendants first (post-order)."""
        if block.child is None and not block.children and not block.partials:
            return [block]  # the usual eviction victim: a leaf
        out: list[Block] = []
        stack: list[tuple[Block, bool]] = [(block, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.append(node)
                continue
            stack.append((node, True))
            stack += [(child, False) for child in full_children(node)]
            if node.partials:
                stack += [(child, False) for child in node.partials.values()]
        return out

    def iter_blocks(self) -> Iterator[Block]:
        """Every block of every scope, parents before children."""
        for root in list(self.roots.values()):
            stack = list(_siblings(root))
            while stack:
                block = stack.pop()
                yield block
                stack.extend(block.iter_children())
