"""kvcache.tree makes runs of private blocks and links committed chains natively when
``kvcache._tree`` is built: the blocks, the tree and the events must be exactly those of the
pure-Python path (the reference and fallback), and bad arguments to the native layout must
raise typed errors, never crash."""

from __future__ import annotations

import gc
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.tree as tree_mod
from kvcache import KVCacheManager, KVCacheManagerConfig, RecordingSink, ReuseScope, TierConfig
from kvcache.keys import chain_keys, tokens_to_bytes
from kvcache.scope import DEFAULT_SCOPE
from kvcache.tree import Block, RadixTree, ScopeRoot, new_blocks

try:
    from kvcache import _tree as native
except ImportError:  # pragma: no cover - depends on the install
    native = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(native is None, reason="kvcache._tree is not built")
# the Layout writes through Block's slot descriptors: a mypyc-compiled Block has none (and its
# compiled loops set the fields directly, the Layout unused)
pytestmark = pytest.mark.pure


@contextmanager
def pure() -> Iterator[None]:
    """A context in which kvcache.tree takes its pure-Python paths."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tree_mod, "_maker", None)
        m.setattr(tree_mod, "_linker", None)
        yield


@pytest.fixture(params=["native", "pure"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with the native layout (when built) and once with the pure path."""
    if request.param == "native" and native is None:
        pytest.skip("kvcache._tree is not built")
    if request.param == "pure":
        with pure():
            yield "pure"
    else:
        yield "native"


def slots(b: Block, ids: dict[int, int]) -> dict[str, Any]:
    """Every slot of ``b``, blocks it refers to by their uid, token arrays with their type."""
    out: dict[str, Any] = {}
    for name in sorted(Block.__slots__):
        v = getattr(b, name)
        if isinstance(v, Block):
            v = ("block", ids.get(id(v), v.uid))
        elif isinstance(v, array):
            v = (type(v).__name__, v.typecode, v.tolist())
        elif isinstance(v, dict):
            v = [
                (k, ("block", x.uid) if isinstance(x, Block) else x) for k, x in v.items()
            ]  # order included
        out[name] = (type(getattr(b, name)).__name__, v)
    return out


def snapshot(m: KVCacheManager, sink: RecordingSink) -> tuple[Any, ...]:
    """The whole tree (every block's every slot, in iteration order) and every event."""
    blocks = [slots(b, {}) for b in m._tree.iter_blocks()]
    roots = [
        (str(s), r.key, r.child.uid if r.child else None, list(r.children or {}), r.firsts)
        for s, r in m._tree.roots.items()
    ]
    events = [
        (r.kind, [list(t) for t in r.tokens], list(r.tiers), r.old_tier, r.new_tier)
        for r in sink.records
    ]
    return blocks, roots, events, m.num_cached_blocks, m.stats


# --------------------------------------------------------------------------- making blocks


@needs_native
@settings(max_examples=50, deadline=None)
@given(
    first=st.integers(0, 2**40),
    pages=st.lists(st.integers(-1, 10**6), max_size=40),
    tier=st.integers(0, 3),
    priority=st.integers(0, 100),
)
def test_native_blocks_equal_the_pure_ones(
    first: int, pages: list[int], tier: int, priority: int
) -> None:
    scope = ReuseScope.for_request(lora_id=3, cache_salt="a")
    got = new_blocks(first, scope, tier, pages, priority)
    with pure():
        want = new_blocks(first, scope, tier, pages, priority)
    assert [type(b) for b in got] == [Block] * len(pages)
    assert [slots(b, {}) for b in got] == [slots(b, {}) for b in want]
    # the independent reference: what the class itself makes
    assert [slots(b, {}) for b in got] == [
        slots(Block(first + i, scope, tier, p, priority), {}) for i, p in enumerate(pages)
    ]
    assert all(gc.is_tracked(b) for b in got)  # blocks form cycles: the collector sees them


def test_new_blocks_make_private_pages(path: str) -> None:
    blocks = new_blocks(7, DEFAULT_SCOPE, 0, [4, 9], 35)
    assert [(b.uid, b.page, b.tier, b.priority, b.refs) for b in blocks] == [
        (7, 4, 0, 35, 1),
        (8, 9, 0, 35, 1),
    ]
    assert all(not b.in_tree and b.tokens == array("i") and b.parent is None for b in blocks)


# ------------------------------------------------------------------------- linking chains


def chain_below(node_kind: str, count: int, tpb: int) -> tuple[Any, ...]:
    """A tree with a parent node of the given kind (a root with 0, 1 or 3 full children) and
    ``count`` fresh blocks linked below it; what the result looks like."""
    t = RadixTree()
    root = t.root(DEFAULT_SCOPE, create=True)
    assert root is not None
    siblings = {"empty": 0, "one": 1, "many": 3}[node_kind]
    for s in range(siblings):
        toks = array("i", [1000 + s] * tpb)
        t.attach_chain(root, new_blocks(100 + s, DEFAULT_SCOPE, 0, [100 + s], 35), toks, tpb)
    tokens = array("i", range(5, 5 + tpb * count + 3))  # runs past the chain
    blocks = new_blocks(1, DEFAULT_SCOPE, 0, list(range(count)), 35)
    t.attach_chain(root, blocks, tokens, tpb, start=2)
    tokens[2:] = array("i", [0] * (len(tokens) - 2))  # a later change to the caller's array
    return (
        [slots(b, {}) for b in t.iter_blocks()],
        root.child.uid if root.child else None,
        list(root.children or {}),
        root.firsts,
        t.num_blocks,
    )


@needs_native
@pytest.mark.parametrize("node_kind", ["empty", "one", "many"])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_native_chain_equals_the_pure_one(node_kind: str, count: int) -> None:
    got = chain_below(node_kind, count, 4)
    with pure():
        want = chain_below(node_kind, count, 4)
    assert got == want


def test_a_linked_chain_holds_copies_of_its_tokens_and_its_keys(path: str) -> None:
    """Hand-derived: three 2-token blocks from offset 1 of the array, keyed by the chain
    sha256(parent || LE tokens) (WIRE.md section 2), each the only child of the one before."""
    t = RadixTree()
    root = t.root(DEFAULT_SCOPE, create=True)
    assert root is not None
    tokens = array("i", [9, 1, 2, 3, 4, 5, 6, 7])
    blocks = new_blocks(1, DEFAULT_SCOPE, 0, [0, 1, 2], 35)
    t.attach_chain(root, blocks, tokens, 2, start=1)
    tokens[:] = array("i", [0] * 8)
    assert [b.tokens for b in blocks] == [array("i", p) for p in ([1, 2], [3, 4], [5, 6])]
    assert all(type(b.tokens) is array and b.tokens.typecode == "i" for b in blocks)
    assert len({id(b.tokens) for b in blocks}) == 3
    import hashlib

    key = root.key
    for b, pair in zip(blocks, ([1, 2], [3, 4], [5, 6]), strict=True):
        key = hashlib.sha256(key + b"".join(x.to_bytes(4, "little") for x in pair)).digest()
        assert b.key == key
    assert root.child is blocks[0] and blocks[0].child is blocks[1]
    assert blocks[1].child is blocks[2] and blocks[2].child is None
    assert [b.parent for b in blocks] == [None, blocks[0], blocks[1]]
    assert all(b.is_full and b.in_tree for b in blocks)
    assert t.num_blocks == 3


@needs_native
def test_link_hands_a_block_with_a_child_to_the_general_loop() -> None:
    """Block 1 of the run already has a full child: link stops there and the pure loop puts
    block 2 beside that child (both then in the dict), as the pure path alone does."""

    def build() -> tuple[Any, ...]:
        t = RadixTree()
        root = ScopeRoot(DEFAULT_SCOPE)
        blocks = new_blocks(1, DEFAULT_SCOPE, 0, [0, 1, 2], 35)
        other = new_blocks(9, DEFAULT_SCOPE, 0, [9], 35)[0]
        other.tokens = array("i", [7, 7])
        other.key = b"k" * 32  # type: ignore[assignment]
        blocks[1].child = other
        t.attach_chain(root, blocks, array("i", range(6)), 2)
        return [slots(b, {}) for b in (*blocks, other)], root.child is blocks[0]

    assert native is not None
    linker = native.Layout(Block, tree_mod._LINK_NAMES)
    blocks = new_blocks(1, DEFAULT_SCOPE, 0, [0, 1, 2], 35)
    blocks[1].child = blocks[0]  # any block: only its presence matters
    keys = [b"a" * 32, b"b" * 32, b"c" * 32]
    assert linker.link(blocks, keys, array("i", range(6)), 0, 2, None) == 2
    got = build()
    with pure():
        want = build()
    assert got == want
    assert got[0][1]["children"][1][0][0] == b"k" * 32  # the old child first


# ---------------------------------------------------------------- whole workloads, both paths

PROMPT = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def replay(ops: list[tuple[list[int], int, bool, bool]], tpb: int) -> tuple[Any, ...]:
    """Requests through a small two-tier manager (evictions, moves, partial reuse), some kept
    live: the final state and every event."""
    sink = RecordingSink()
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb,
        tiers=[TierConfig(name="device", num_blocks=12), TierConfig(name="host", num_blocks=6)],
        enable_partial_reuse=True,
    )
    m = KVCacheManager(cfg, sink)
    live = []
    for prompt, split, stop, keep in ops:
        try:
            seq = m.create_kv_cache(prompt)
            seq.resize(len(prompt) + 2)
            rest = prompt[seq.num_reused_tokens :]
            cut = min(split, len(rest))
            seq.commit(rest[:cut])
            seq.commit(array("i", rest[cut:]))
            if stop:
                seq.stop_committing()
        except Exception as exc:  # out of pages: the same on both paths
            live.append(type(exc).__name__)
            continue
        if keep:
            live.append(seq)
        else:
            seq.close()
        if len(live) > 3:
            old = live.pop(0)
            if not isinstance(old, str):
                old.close()
    m.verify()
    return snapshot(m, sink), [x if isinstance(x, str) else x.num_tokens for x in live]


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(PROMPT, st.integers(0, 14), st.booleans(), st.booleans()), max_size=12),
    tpb=st.sampled_from([1, 2, 3]),
)
def test_native_replay_equals_the_pure_replay(
    ops: list[tuple[list[int], int, bool, bool]], tpb: int
) -> None:
    got = replay(ops, tpb)
    with pure():
        want = replay(ops, tpb)
    assert got == want


# ------------------------------------------------------------------------- hostile inputs


@needs_native
def test_layout_refuses_what_is_not_a_writable_object_slot() -> None:
    assert native is not None
    Layout = native.Layout
    with pytest.raises(AttributeError):
        Layout(Block, ("nope",))
    for name in ("__repr__", "iter_children", "__slots__"):
        with pytest.raises(TypeError, match="not a writable slot"):
            Layout(Block, (name,))
    with pytest.raises(TypeError, match="not a writable slot"):
        Layout(complex, ("real",))  # a read-only float member, not an object slot
    with pytest.raises(TypeError):
        Layout(Block, ("key", 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Layout(Block, ["key"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Layout("Block", ("key",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        Layout(Block, ("key", "key"))
    with pytest.raises(ValueError, match="at most"):
        Layout(Block, ("key",) * 33)

    class Borrowed:  # another class's slot descriptor: its offset means nothing here
        uid = Block.__dict__["uid"]

    with pytest.raises(TypeError, match="not a writable slot"):
        Layout(Borrowed, ("uid",))
    with pytest.raises(TypeError, match="variable-size"):
        Layout(tuple, ())


@needs_native
def test_layout_new_refuses_bad_arguments() -> None:
    assert native is not None
    maker = native.Layout(Block, tree_mod._MAKE_NAMES)
    values = (DEFAULT_SCOPE, 0, 35, b"", array("i"), *[None] * 6, False, False, 1, 0, 0, 0, 0)
    with pytest.raises(TypeError):
        maker.new(0, (1, 2), values)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        maker.new(0, [1], list(values))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        maker.new("0", [1], values)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        maker.new(0, [1])  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="values"):
        maker.new(0, [1], values[:-1])
    with pytest.raises(OverflowError):
        maker.new(2**70, [1], values)
    with pytest.raises(OverflowError):
        maker.new(sys.maxsize, [1, 2], values)
    with pytest.raises(ValueError, match="values"):
        native.Layout(Block, ("uid",)).new(0, [1], ())
    assert maker.new(sys.maxsize - 1, [1], values)[0].uid == sys.maxsize - 1
    assert maker.new(0, [], values) == []


@needs_native
def test_layout_link_refuses_bad_arguments_and_changes_nothing() -> None:
    assert native is not None
    linker = native.Layout(Block, tree_mod._LINK_NAMES)
    tokens = array("i", range(8))

    def fresh() -> list[Block]:
        return new_blocks(1, DEFAULT_SCOPE, 0, [0, 1], 35)

    keys = [b"a" * 32, b"b" * 32]
    bad: list[tuple[tuple[Any, ...], type[Exception]]] = [
        ((fresh(), keys[:1], tokens, 0, 2, None), ValueError),
        ((fresh(), keys, tokens, -1, 2, None), ValueError),
        ((fresh(), keys, tokens, 0, 0, None), ValueError),
        ((fresh(), keys, tokens, 0, sys.maxsize, None), ValueError),
        ((fresh(), keys, tokens, sys.maxsize, 2, None), ValueError),
        ((fresh(), keys, tokens, 2**70, 2, None), OverflowError),
        ((fresh(), keys, tokens, 0, "2", None), TypeError),
        ((tuple(fresh()), keys, tokens, 0, 2, None), TypeError),
        (([*fresh()[:1], object()], keys, tokens, 0, 2, None), TypeError),
        ((fresh(), keys, 12345, 0, 2, None), TypeError),
        ((fresh(), keys, tokens, 0, 2), TypeError),
    ]
    for args, exc in bad:
        blocks = args[0]
        with pytest.raises(exc):
            linker.link(*args)
        for b in blocks:
            if isinstance(b, Block):  # nothing written before the error
                assert not b.in_tree and b.child is None and b.key == b""
    with pytest.raises(TypeError, match="layout of 7"):
        native.Layout(Block, ("key",)).link(fresh(), keys, tokens, 0, 2, None)
    # a huge but valid request: slices past the end are short, as Python's are
    blocks = fresh()
    assert linker.link(blocks, keys, tokens, 6, 2**40, None) == 2
    assert blocks[0].tokens == array("i", [6, 7]) and blocks[1].tokens == array("i")


@needs_native
def test_link_survives_a_collection_and_frees_what_it_made() -> None:
    """Refcounts stay balanced: the old token arrays and keys are freed, the new ones held."""
    assert native is not None
    linker = native.Layout(Block, tree_mod._LINK_NAMES)
    tokens = array("i", range(4096))
    keys = chain_keys(b"r" * 32, tokens_to_bytes(tokens), 0, 64, 64)
    before = sys.getrefcount(keys[0])

    def once() -> tuple[bool, bool, bool]:
        blocks = new_blocks(1, DEFAULT_SCOPE, 0, list(range(64)), 35)
        done = linker.link(blocks, keys, tokens, 0, 16, None) == 64
        gc.collect()
        same = blocks[-1].tokens == tokens[63 * 16 : 64 * 16]
        return done, same, gc.is_tracked(blocks[0].tokens)

    for _ in range(50):
        assert once() == (True, True, False)  # an array is in no cycle: left untracked
    gc.collect()
    after = sys.getrefcount(keys[0])  # outside the assert (its rewrite holds operands)
    assert after == before
