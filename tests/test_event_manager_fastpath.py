"""The event manager's native run builder (``v1_store_run``) against its reference.

``KVCacheEventManager.on_stored`` announces a commit's chain of blocks through one call that
takes the run, hashes it, builds its records and enters each block's hash under its key. The
native form must agree with ``events.manager._v1_run_py`` on every input: which blocks it takes
(child of the previous block, full, packed tokens, same tier, priority and scope, not announced
yet), the records, the stop index and the dict afterwards; and refuse hostile input with typed
errors. The hashes themselves are checked against the pure-Python V1 reference.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import events.manager as manager_module
from events._records import record_setters
from events.hashing import v1_block_hash_py
from events.manager import (
    NATIVE_RUN,
    KVCacheEventManager,
    _build_events_py,
    _PendingRemoved,
    _PendingStored,
    _v1_run_py,
)
from events.model import (
    AllBlocksCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.scope import ReuseScope

native = pytest.importorskip("events._v1hash") if NATIVE_RUN else None
needs_native = pytest.mark.skipif(not NATIVE_RUN, reason="events._v1hash is not built")

SCOPES = [ReuseScope(), ReuseScope(lora_id=3), ReuseScope(salt=7), ReuseScope(lora_id=1, salt=2)]


class FakeBlock:
    """A BlockView with settable fields (the tree's node has the same slots)."""

    __slots__ = ("is_full", "key", "parent", "priority", "scope", "tier", "tokens")

    def __init__(
        self,
        key: bytes,
        tokens: Any,
        parent: FakeBlock | None,
        scope: ReuseScope,
        tier: int = 0,
        priority: int = 35,
        is_full: bool = True,
    ) -> None:
        self.key = key
        self.tokens = tokens
        self.parent = parent
        self.scope = scope
        self.tier = tier
        self.priority = priority
        self.is_full = is_full


def _native_run(
    blocks: list[Any], start: int, hashes: dict[Any, Any], parent: Any
) -> tuple[list[StoredBlock], int]:
    assert native is not None
    result: tuple[list[StoredBlock], int] = native.v1_store_run(
        StoredBlock, record_setters(StoredBlock), blocks, start, hashes, parent
    )
    return result


def _chain(n: int, scope: ReuseScope = SCOPES[0], tpb: int = 4) -> list[FakeBlock]:
    blocks: list[FakeBlock] = []
    for i in range(n):
        tokens = array("i", range(10 * i, 10 * i + tpb))
        blocks.append(FakeBlock(bytes([i]) * 4, tokens, blocks[-1] if blocks else None, scope))
    return blocks


# One mutation per block after the first, each of which ends a run in the reference.
_MUTATIONS = [
    "none",
    "list_tokens",
    "long_tokens",
    "other_parent",
    "no_parent",
    "partial",
    "tier",
    "priority",
    "scope",
    "equal_scope",
    "announced",
]


def _apply(blocks: list[FakeBlock], i: int, how: str, hashes: dict[Any, Any]) -> None:
    b = blocks[i]
    if how == "list_tokens":
        b.tokens = list(b.tokens)
    elif how == "long_tokens":
        b.tokens = array("q", b.tokens)
    elif how == "other_parent":
        b.parent = blocks[0] if i > 1 else FakeBlock(b"x", array("i"), None, SCOPES[0])
    elif how == "no_parent":
        b.parent = None
    elif how == "partial":
        b.is_full = False
    elif how == "tier":
        b.tier = 1
    elif how == "priority":
        b.priority = 7
    elif how == "scope":
        b.scope = SCOPES[1] if b.scope != SCOPES[1] else SCOPES[2]
    elif how == "equal_scope":  # equal but not the same object: still the same run
        b.scope = ReuseScope(lora_id=b.scope.lora_id, salt=b.scope.salt)
    elif how == "announced":
        hashes[b.key] = 12345


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 7),
    st.lists(st.sampled_from(_MUTATIONS), min_size=7, max_size=7),
    st.integers(0, 3),
    st.sampled_from(SCOPES),
    st.sampled_from([0, 1, 2**64 - 1, 0x1234_5678_9ABC_DEF0]),
    st.booleans(),
)
def test_the_native_run_equals_its_reference(
    n: int,
    mutations: list[str],
    start: int,
    scope: ReuseScope,
    parent_hash: int,
    as_tuple: bool,
) -> None:
    blocks = _chain(n, scope)
    hashes: dict[Any, Any] = {b"other": 1}
    for i in range(1, n):
        _apply(blocks, i, mutations[i], hashes)
    start = min(start, n - 1)
    blocks[start].tokens = array("i", blocks[start].tokens)  # the caller checked the first
    seq: Any = tuple(blocks) if as_tuple else blocks
    ref_hashes, nat_hashes = dict(hashes), dict(hashes)
    ref_records, ref_stop = _v1_run_py(seq, start, ref_hashes, parent_hash)
    nat_records, nat_stop = _native_run(seq, start, nat_hashes, parent_hash)
    assert nat_stop == ref_stop
    assert nat_records == ref_records
    assert nat_hashes == ref_hashes
    assert list(nat_hashes) == list(ref_hashes)  # same insertion order
    # independent hashes: the pure V1 reference, block by block
    h, run_scope = parent_hash, seq[start].scope
    lora, salt = run_scope.lora_id, run_scope.salt
    for b, rec in zip(seq[start:nat_stop], nat_records, strict=True):
        h = v1_block_hash_py(list(b.tokens), h, lora_id=lora, salt_id=salt)
        assert rec.block_hash == h
        assert rec.tokens is b.tokens  # the cache's array, not a copy
        assert (rec.lora_id, rec.cache_salt_id) == (lora, salt)
        assert (rec.cache_level, rec.priority) == (b.tier, b.priority)
        assert nat_hashes[b.key] == h


def test_a_run_stops_where_the_attributes_change() -> None:
    blocks: list[Any] = _chain(6)
    blocks[3].priority = 1  # the run is blocks 1..2
    hashes: dict[Any, Any] = {}
    records, stop = manager_module._v1_run(blocks, 1, hashes, 99)
    assert stop == 3
    assert len(records) == 2
    assert list(hashes) == [blocks[1].key, blocks[2].key]
    first = v1_block_hash_py(list(blocks[1].tokens), 99, lora_id=None, salt_id=None)
    assert records[0].block_hash == first
    assert records[1].block_hash == v1_block_hash_py(
        list(blocks[2].tokens), first, lora_id=None, salt_id=None
    )


@needs_native
def test_the_native_run_rejects_hostile_input() -> None:
    assert native is not None
    setters = record_setters(StoredBlock)
    blocks = _chain(3)
    run = native.v1_store_run
    with pytest.raises(TypeError, match="6 arguments"):
        run(StoredBlock, setters, blocks, 0, {})
    with pytest.raises(TypeError, match="list or tuple"):
        run(StoredBlock, setters, iter(blocks), 0, {}, 0)
    with pytest.raises(TypeError, match="dict"):
        run(StoredBlock, setters, blocks, 0, [], 0)
    with pytest.raises(TypeError):
        run(StoredBlock, setters, blocks, "0", {}, 0)
    for start in (-1, 3, 2**62):
        with pytest.raises(IndexError):
            run(StoredBlock, setters, blocks, start, {}, 0)
    with pytest.raises(OverflowError):
        run(StoredBlock, setters, blocks, 2**70, {}, 0)
    with pytest.raises(TypeError, match="parent_hash"):
        run(StoredBlock, setters, blocks, 0, {}, None)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="parent_hash"):
            run(StoredBlock, setters, blocks, 0, {}, bad)
    with pytest.raises(TypeError, match="record type"):
        run(3, setters, blocks, 0, {}, 0)
    with pytest.raises(TypeError, match="setters"):
        run(StoredBlock, (), blocks, 0, {}, 0)
    with pytest.raises(AttributeError):
        run(StoredBlock, setters, [object()], 0, {}, 0)
    with pytest.raises(AttributeError):
        run(StoredBlock, setters, [blocks[0], object()], 0, {}, 0)
    bad_scope = FakeBlock(b"s", array("i", [1]), None, ReuseScope())
    bad_scope.scope = "not a scope"  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        run(StoredBlock, setters, [bad_scope], 0, {}, 0)
    negative = _chain(2)
    negative[1].tokens = array("i", [1, -2, 3, 4])
    hashes: dict[Any, Any] = {}
    with pytest.raises(ValueError, match="token ids"):
        run(StoredBlock, setters, negative, 0, hashes, 0)
    assert hashes == {}  # nothing entered when a record fails
    odd = _chain(1)
    odd[0].tokens = b"abc"
    with pytest.raises(ValueError, match="4-byte"):
        run(StoredBlock, setters, odd, 0, {}, 0)
    unhashable = _chain(2)
    unhashable[1].key = []  # type: ignore[assignment]
    with pytest.raises(TypeError):
        run(StoredBlock, setters, unhashable, 0, {}, 0)


class _Scope:
    """A scope whose comparison runs Python code: it empties the blocks list, or raises."""

    def __init__(self, blocks: list[Any], raise_it: bool) -> None:
        self.lora_id = None
        self.salt = None
        self.blocks = blocks
        self.raise_it = raise_it

    def __eq__(self, other: object) -> bool:
        if self.raise_it:
            raise KeyError("compare")
        self.blocks.clear()
        return True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]


@needs_native
@pytest.mark.parametrize("raise_it", [False, True])
def test_the_native_run_survives_a_comparison_that_changes_the_blocks(raise_it: bool) -> None:
    blocks: list[Any] = _chain(4)
    for i, b in enumerate(blocks):
        b.scope = _Scope(blocks, raise_it) if i else ReuseScope()
    blocks[0].scope = _Scope(blocks, raise_it)
    with pytest.raises(KeyError if raise_it else RuntimeError):
        _native_run(blocks, 0, {}, 0)


def _events(mgr: KVCacheEventManager) -> list[KVCacheEvent]:
    events, _ = mgr.end_step()
    return events


@needs_native
def test_the_manager_gives_the_same_events_with_either_run_builder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def scenario() -> list[KVCacheEvent]:
        mgr = KVCacheEventManager(tokens_per_block=4)
        blocks: list[Any] = _chain(5, SCOPES[3])
        for b in blocks[2:]:
            b.priority = 3  # two runs, two Stored events
        mgr.on_stored(blocks[:3])
        mgr.on_stored(tuple(blocks[3:]))  # continues the open run (a tuple is taken too)
        mgr.on_stored([blocks[4]])  # announced: ignored
        assert mgr.duplicate_stores == 1
        return _events(mgr)

    native_events = scenario()
    monkeypatch.setattr(manager_module, "_v1_run", _v1_run_py)
    assert scenario() == native_events
    assert [len(e.data.blocks) for e in native_events] == [2, 3]  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- events


def _pending_item(kind: int, n: int) -> Any:
    sb = StoredBlock(n, array("i", [n, n + 1]), None, 0, 35, None)
    if kind == 0:
        return _PendingStored(None if n % 2 else n * 7, [sb] * (n % 3 + 1))
    if kind == 1:
        return _PendingRemoved([n, n + 1], n % 2)
    if kind == 2:
        return AllBlocksCleared()
    if kind == 3:
        return Created([n, 2 * n])
    return Updated(n, cache_level=EventDiff(0, 1))


@needs_native
@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50)), max_size=8),
    st.sampled_from([0, 1, 254, 255, 256, 2**63 - 2, 2**70]),
    st.sampled_from([None, 4, 512]),
    st.sampled_from([0, 128]),
    st.sampled_from(["v1_block_key", "v2_sha256"]),
    st.sampled_from([None, 0, 3]),
)
def test_the_native_event_builder_equals_its_reference(
    items: list[tuple[int, int]],
    first_id: int,
    block_size: int | None,
    window: int,
    algo: str,
    dp_rank: int | None,
) -> None:
    pending = [_pending_item(kind, n) for kind, n in items]
    args = (first_id, block_size, window, algo, dp_rank)
    got = manager_module._build_events(list(pending), *args)
    want = _build_events_py(list(pending), *args)
    assert got == want
    assert [type(e.data) for e in got] == [type(e.data) for e in want]
    assert [e.event_id for e in got] == list(range(first_id, first_id + len(pending)))
    for e, item in zip(got, pending, strict=True):
        if isinstance(item, _PendingStored):
            assert e.data.blocks is item.blocks  # type: ignore[union-attr]
            assert e.data == Stored(item.parent_hash, item.blocks, block_size)
        elif isinstance(item, _PendingRemoved):
            assert e.data == Removed(item.block_hashes, item.cache_level)
        else:
            assert e.data is item


@needs_native
def test_the_native_event_builder_rejects_hostile_input() -> None:
    assert native is not None
    build: Any = manager_module._build_events
    spec = build.args[0]
    with pytest.raises(TypeError, match="7 arguments"):
        native.build_events(spec, [], 0)
    with pytest.raises(TypeError, match="list of pending"):
        build((), 0, None, 0, "v1_block_key", None)
    with pytest.raises(TypeError, match="first_id"):
        build([], "0", None, 0, "v1_block_key", None)
    with pytest.raises(TypeError, match="spec"):
        native.build_events(spec[:9], [], 0, None, 0, "a", None)
    bad = list(spec)
    bad[3] = bad[3][:2]  # Stored's setters do not cover its fields
    with pytest.raises(TypeError, match="Stored setters"):
        native.build_events(tuple(bad), [], 0, None, 0, "a", None)
    bad = list(spec)
    bad[2] = 5
    with pytest.raises(TypeError, match="spec item 2"):
        native.build_events(tuple(bad), [], 0, None, 0, "a", None)
    bad = list(spec)
    bad[4] = (None,) * 20
    with pytest.raises((TypeError, ValueError)):
        native.build_events(tuple(bad), [], 0, None, 0, "a", None)

    class Hostile:
        """A pending item whose isinstance check empties the pending list."""

        def __init__(self, pending: list[Any]) -> None:
            self.pending = pending

        @property  # type: ignore[misc]
        def __class__(self) -> type:
            self.pending.clear()
            return Hostile

    pending: list[Any] = []
    pending += [Hostile(pending), AllBlocksCleared()]
    with pytest.raises(RuntimeError, match="changed"):
        build(pending, 0, None, 0, "v1_block_key", None)


def _twin_events(mgr: KVCacheEventManager, step: int) -> None:
    blocks: list[Any] = _chain(3, SCOPES[step % 4])
    for i, b in enumerate(blocks):
        b.key = bytes([step, i])
    mgr.on_stored(blocks)
    if step % 2:
        mgr.on_removed(blocks[2:])
    if step % 3 == 2:
        mgr.on_cleared()


@pytest.mark.parametrize("max_entries", [1, 2, 3, 100])
def test_end_step_gives_what_flush_and_drain_give(max_entries: int) -> None:
    """Step by step, through the path that skips the buffer and the one that overflows it."""
    one = KVCacheEventManager(max_entries=max_entries, tokens_per_block=4)
    twin = KVCacheEventManager(max_entries=max_entries, tokens_per_block=4)
    for step in range(8):
        _twin_events(one, step)
        _twin_events(twin, step)
        got = one.end_step()
        twin.flush()
        lost = twin.take_dropped()
        assert got == (twin.get_latest_events(), lost)
    assert one.dropped_events == twin.dropped_events
    assert one.next_event_id == twin.next_event_id
    if max_entries < 3:
        assert one.dropped_events > 0
