"""KVCacheEventManager driven by small fake blocks: hashes, coalescing, moves, buffer, threads.

Expected hashes are the golden vectors of WIRE.md section 3, written out here so the test does
not trust the hashing code it exercises.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from events.manager import KVCacheEventManager
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.hashing import BlockKey, blockchain_keys, hash_from_key
from kvcache.scope import ReuseScope

# WIRE.md section 3 vectors.
H_1234: BlockHash = 924206229973855  # [1,2,3,4], parent 0, no scope
H_56_AFTER_1234: BlockHash = 6875034662206558884  # [5,6], parent H_1234
CHAIN_0_7: list[BlockHash] = [
    733356887393045,
    6310903394565074474,
]  # tokens 0..7, tpb 4, ReuseScope()
CHAIN_0_7_SCOPED: list[BlockHash] = [
    11481563305523318472,
    9304211693877664517,
]  # same, ReuseScope(7, 11)


@dataclass(slots=True)
class FakeBlock:
    """A BlockView as the radix tree would present it."""

    key: BlockKey
    tokens: Sequence[int]
    parent: FakeBlock | None
    scope: ReuseScope
    tier: int = 0
    priority: int = 35
    is_full: bool = True


def chain(
    tokens: Sequence[int],
    tpb: int = 4,
    scope: ReuseScope | None = None,
    parent: FakeBlock | None = None,
    priority: int = 35,
    packed: bool = False,
) -> list[FakeBlock]:
    """The blocks of ``tokens`` under ``scope`` (continuing after ``parent`` when given); with
    ``packed`` their tokens are int32 arrays, as the radix tree keeps them."""
    scope = scope or ReuseScope()
    prefix: list[int] = []
    node = parent
    while node is not None:
        prefix[:0] = node.tokens
        node = node.parent
    keys = blockchain_keys(scope, [*prefix, *tokens], tpb)[len(prefix) // tpb :]
    blocks: list[FakeBlock] = []
    prev = parent
    for i, key in enumerate(keys):
        toks = tuple(tokens[i * tpb : (i + 1) * tpb])
        held: Sequence[int] = array("i", toks) if packed else toks
        prev = FakeBlock(key, held, prev, scope, priority=priority, is_full=len(toks) == tpb)
        blocks.append(prev)
    return blocks


def drain(mgr: KVCacheEventManager) -> list[KVCacheEvent]:
    mgr.flush()
    return mgr.get_latest_events()


def datas(mgr: KVCacheEventManager) -> list[object]:
    return [e.data for e in drain(mgr)]


def stored_hashes(event_data: object) -> list[BlockHash]:
    assert isinstance(event_data, Stored)
    return [b.block_hash for b in event_data.blocks]


# ------------------------------------------------------------------------------ hashing


@pytest.mark.parametrize("packed", [False, True])
def test_first_chain_is_one_stored_event_with_golden_hashes(packed: bool) -> None:
    mgr = KVCacheEventManager()
    mgr.on_stored(chain(range(8), packed=packed))
    (event,) = drain(mgr)
    assert event.event_id == 0
    assert event.hash_algo == "v1_block_key"
    assert event.data == Stored(
        parent_hash=None,
        blocks=[
            StoredBlock(CHAIN_0_7[0], [0, 1, 2, 3], None, 0, 35, None),
            StoredBlock(CHAIN_0_7[1], [4, 5, 6, 7], None, 0, 35, None),
        ],
        block_size=4,
    )


@pytest.mark.parametrize("packed", [False, True])
def test_scope_enters_hashes_and_blocks(packed: bool) -> None:
    mgr = KVCacheEventManager()
    mgr.on_stored(chain(range(8), scope=ReuseScope(7, 11), packed=packed))
    (data,) = datas(mgr)
    assert isinstance(data, Stored)
    assert stored_hashes(data) == CHAIN_0_7_SCOPED
    assert {(b.lora_id, b.cache_salt_id) for b in data.blocks} == {(7, 11)}


@pytest.mark.parametrize(
    "scope", [ReuseScope(lora_id=7), ReuseScope(salt=11), ReuseScope(lora_id=0), ReuseScope(7, 12)]
)
def test_every_scope_gets_its_own_hashes(scope: ReuseScope) -> None:
    mgr = KVCacheEventManager()
    mgr.on_stored(chain(range(8)))
    mgr.on_stored(chain(range(8), scope=ReuseScope(7, 11)))
    mgr.on_stored(chain(range(8), scope=scope))
    hashes = [h for d in datas(mgr) for h in stored_hashes(d)]
    assert len(set(hashes)) == 6


def test_v2_algorithms_hash_the_block_key() -> None:
    blocks = chain(range(8))
    hex_mgr = KVCacheEventManager(hash_algo="v2_sha256")
    int_mgr = KVCacheEventManager(hash_algo="v2_sha256_64")
    hex_mgr.on_stored(blocks)
    int_mgr.on_stored(blocks)
    (hex_event,) = drain(hex_mgr)
    (int_event,) = drain(int_mgr)
    assert hex_event.hash_algo == "v2_sha256"
    assert stored_hashes(hex_event.data) == [b.key.hex() for b in blocks]
    assert stored_hashes(int_event.data) == [int.from_bytes(b.key[:8], "big") for b in blocks]
    assert stored_hashes(hex_event.data) == [hash_from_key("v2_sha256", b.key) for b in blocks]
    assert stored_hashes(int_event.data) == [hash_from_key("v2_sha256_64", b.key) for b in blocks]
    assert isinstance(int_event.data, Stored) and isinstance(hex_event.data, Stored)
    assert int_event.data.parent_hash is None


def test_parent_stored_before_the_manager_attached_is_hashed_from_its_chain() -> None:
    first, second = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.on_stored([second])
    (data,) = datas(mgr)
    assert data == Stored(CHAIN_0_7[0], [StoredBlock(CHAIN_0_7[1], [4, 5, 6, 7])], 4)
    # The parent was never announced, so neither is its removal.
    mgr.on_removed([second, first])
    assert datas(mgr) == [Removed([CHAIN_0_7[1]], 0)]


def test_partial_blocks_are_silent_by_default() -> None:
    full, partial = chain([1, 2, 3, 4, 5, 6])
    assert not partial.is_full
    mgr = KVCacheEventManager()
    mgr.on_stored([full, partial])
    assert [stored_hashes(d) for d in datas(mgr)] == [[H_1234]]
    assert mgr.hash_of(partial) is None
    mgr.on_removed([partial])
    mgr.on_moved([partial], 0, 1)
    assert datas(mgr) == []


@pytest.mark.parametrize("packed", [False, True])
def test_partial_blocks_announced_on_request(packed: bool) -> None:
    full, partial = chain([1, 2, 3, 4, 5, 6], packed=packed)
    mgr = KVCacheEventManager(announce_partial=True)
    mgr.on_stored([full, partial])
    (data,) = datas(mgr)
    assert data == Stored(
        None, [StoredBlock(H_1234, [1, 2, 3, 4]), StoredBlock(H_56_AFTER_1234, [5, 6])], 4
    )
    mgr.on_removed([partial])
    assert datas(mgr) == [Removed([H_56_AFTER_1234], 0)]


def test_block_size_given_up_front_is_stamped_on_partial_only_events() -> None:
    _, partial = chain([1, 2, 3, 4, 5, 6])
    mgr = KVCacheEventManager(announce_partial=True, tokens_per_block=4)
    mgr.on_stored([partial])
    (data,) = datas(mgr)
    assert isinstance(data, Stored) and data.block_size == 4


def test_removal_forgets_the_hash_and_a_restore_announces_again() -> None:
    blocks = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.on_stored(blocks)
    assert mgr.hash_of(blocks[1]) == CHAIN_0_7[1]
    mgr.on_removed(blocks[::-1])
    assert mgr.hash_of(blocks[1]) is None and mgr.num_announced == 0
    mgr.on_removed(blocks)  # already forgotten: nothing more to say
    mgr.on_stored(blocks)
    both = Stored(
        None,
        [StoredBlock(CHAIN_0_7[0], [0, 1, 2, 3]), StoredBlock(CHAIN_0_7[1], [4, 5, 6, 7])],
        4,
    )
    assert datas(mgr) == [both, Removed([CHAIN_0_7[1], CHAIN_0_7[0]], 0), both]


def test_a_second_store_of_an_announced_block_is_ignored_and_counted() -> None:
    blocks = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.on_stored(blocks)
    mgr.on_stored(blocks[:1])
    assert [stored_hashes(d) for d in datas(mgr)] == [CHAIN_0_7]
    assert mgr.duplicate_stores == 1


# --------------------------------------------------------------------------- coalescing


def test_stored_continuing_the_previous_chain_extends_it() -> None:
    a, b = chain(range(8))
    (c,) = chain([8, 9, 10, 11], parent=b)
    mgr = KVCacheEventManager()
    mgr.on_stored([a])
    mgr.on_stored([b])
    mgr.on_stored([c])
    (data,) = datas(mgr)
    assert isinstance(data, Stored) and data.parent_hash is None
    assert stored_hashes(data)[:2] == CHAIN_0_7 and len(data.blocks) == 3


def test_stored_not_continuing_or_differing_starts_a_new_event() -> None:
    a, b = chain(range(8))
    (other,) = chain([9, 9, 9, 9])
    (c_prio,) = chain([8, 9, 10, 11], parent=b, priority=80)
    mgr = KVCacheEventManager()
    mgr.on_stored([a])
    mgr.on_stored([other])  # a sibling chain, not a continuation
    mgr.on_stored([b])  # continues a, but other came in between
    mgr.on_stored([c_prio])  # continues b with another priority
    events = datas(mgr)
    assert [len(d.blocks) for d in events if isinstance(d, Stored)] == [1, 1, 1, 1]
    assert [d.parent_hash for d in events if isinstance(d, Stored)] == [
        None,
        None,
        CHAIN_0_7[0],
        CHAIN_0_7[1],
    ]


def test_removals_merge_per_level_and_keep_their_place_before_stores() -> None:
    a, b = chain(range(8))
    (x,) = chain([7, 7, 7, 7])
    (y,) = chain([8, 8, 8, 8])
    y.tier = 1
    mgr = KVCacheEventManager()
    mgr.on_stored([a, x])
    mgr.on_stored([y])
    drain(mgr)
    mgr.on_removed([a])
    mgr.on_removed([x])
    mgr.on_removed([y])
    mgr.on_stored([b])  # after the removals: must not jump ahead of them
    events = datas(mgr)
    hx = events[0]
    assert isinstance(hx, Removed) and hx.cache_level == 0 and len(hx.block_hashes) == 2
    assert hx.block_hashes[0] == CHAIN_0_7[0]
    assert isinstance(events[1], Removed) and events[1].cache_level == 1
    assert isinstance(events[2], Stored) and events[2].parent_hash == CHAIN_0_7[0]
    assert len(events) == 3


def test_iterations_are_not_coalesced_across_flushes() -> None:
    a, b = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.on_stored([a])
    assert mgr.flush() == 1
    mgr.on_stored([b])
    assert mgr.flush() == 1
    assert mgr.flush() == 0
    events = mgr.get_latest_events()
    assert [e.event_id for e in events] == [0, 1]
    assert [stored_hashes(e.data) for e in events] == [[CHAIN_0_7[0]], [CHAIN_0_7[1]]]


# ------------------------------------------------------------------------------- moves


def test_moves_as_updated() -> None:
    blocks = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.on_stored(blocks)
    drain(mgr)
    for b in blocks:
        b.tier = 1
    mgr.on_moved(blocks, 0, 1)
    assert datas(mgr) == [Updated(h, cache_level=EventDiff(0, 1)) for h in CHAIN_0_7]
    mgr.on_removed(blocks[::-1])
    assert datas(mgr) == [Removed(CHAIN_0_7[::-1], 1)]


def test_moves_as_removed_stored_pair() -> None:
    a, b = chain(range(8), scope=ReuseScope(7, 11))
    mgr = KVCacheEventManager(moves_as="removed_stored")
    mgr.on_stored([a, b])
    drain(mgr)
    b.tier = 1
    mgr.on_moved([b], 0, 1)
    assert datas(mgr) == [
        Removed([CHAIN_0_7_SCOPED[1]], 0),
        Stored(
            CHAIN_0_7_SCOPED[0], [StoredBlock(CHAIN_0_7_SCOPED[1], [4, 5, 6, 7], 7, 1, 35, 11)], 4
        ),
    ]
    a.tier = 1
    b.tier = 0
    mgr.on_moved([a], 0, 1)
    mgr.on_moved([b], 1, 0)
    events = datas(mgr)
    assert events == [
        Removed([CHAIN_0_7_SCOPED[0]], 0),
        Stored(None, [StoredBlock(CHAIN_0_7_SCOPED[0], [0, 1, 2, 3], 7, 1, 35, 11)], 4),
        Removed([CHAIN_0_7_SCOPED[1]], 1),
        Stored(
            CHAIN_0_7_SCOPED[0], [StoredBlock(CHAIN_0_7_SCOPED[1], [4, 5, 6, 7], 7, 0, 35, 11)], 4
        ),
    ]


@pytest.mark.parametrize("leaf_first", [False, True])
def test_a_moved_chain_is_one_removed_and_one_stored(leaf_first: bool) -> None:
    blocks = chain(range(12))
    mgr = KVCacheEventManager(moves_as="removed_stored")
    mgr.on_stored(blocks)
    (stored,) = datas(mgr)
    hashes = stored_hashes(stored)
    for blk in blocks:
        blk.tier = 1
    # The cache offloads leaf first; the re-store must still come parent first.
    mgr.on_moved(blocks[::-1] if leaf_first else blocks, 0, 1)
    removed, restored = datas(mgr)
    assert removed == Removed(hashes[::-1] if leaf_first else hashes, 0)
    assert isinstance(restored, Stored) and restored.parent_hash is None
    assert stored_hashes(restored) == hashes
    assert {blk.cache_level for blk in restored.blocks} == {1}


# ----------------------------------------------------------------- clear and created


def test_clear_announces_and_forgets_everything() -> None:
    blocks = chain(range(8))
    mgr = KVCacheEventManager()
    mgr.created([100, 400])
    mgr.on_stored(blocks)
    mgr.on_cleared()
    mgr.on_removed(blocks)  # forgotten by the clear
    events = datas(mgr)
    assert events[0] == Created([100, 400])
    assert isinstance(events[1], Stored)
    assert events[2] == AllBlocksCleared()
    assert len(events) == 3
    assert mgr.hash_of(blocks[0]) is None


# ------------------------------------------------------------------ buffer and draining


def test_events_are_stamped_and_ids_increase() -> None:
    mgr = KVCacheEventManager(window_size=4096, dp_rank=3)
    mgr.on_stored(chain(range(4)))
    mgr.on_cleared()
    mgr.flush()
    mgr.on_cleared()
    mgr.flush()
    events = mgr.get_latest_events()
    assert [e.event_id for e in events] == [0, 1, 2]
    assert {(e.window_size, e.attention_dp_rank, e.hash_algo) for e in events} == {
        (4096, 3, "v1_block_key")
    }
    assert mgr.next_event_id == 3


def test_full_buffer_drops_the_oldest_and_counts_each_drop() -> None:
    mgr = KVCacheEventManager(max_entries=3)
    for _ in range(2):
        mgr.on_cleared()
        mgr.flush()
    for _ in range(3):
        mgr.on_cleared()
    assert mgr.flush() == 3
    assert mgr.dropped_events == 2
    assert mgr.take_dropped() == 2  # taken here, so no loss marker leads the drain
    assert [e.event_id for e in mgr.get_latest_events()] == [2, 3, 4]
    for _ in range(5):
        mgr.on_cleared()
    mgr.flush()
    assert mgr.dropped_events == 4
    assert mgr.take_dropped() == 2
    assert [e.event_id for e in mgr.get_latest_events()] == [7, 8, 9]
    assert mgr.get_latest_events() == []


def test_get_latest_events_waits_for_a_flush_from_another_thread() -> None:
    mgr = KVCacheEventManager()
    started = threading.Event()

    def engine() -> None:
        started.wait(10)
        mgr.on_stored(chain(range(4)))
        mgr.flush()

    thread = threading.Thread(target=engine)
    thread.start()
    started.set()
    events: list[KVCacheEvent] = []
    while not events:  # a wait that times out returns [], so loop under the join bound
        events = mgr.get_latest_events(timeout_ms=10_000)
    thread.join(10)
    assert [stored_hashes(e.data) for e in events] == [[CHAIN_0_7[0]]]


def test_get_latest_events_times_out_empty() -> None:
    assert KVCacheEventManager().get_latest_events(timeout_ms=5) == []


def test_concurrent_producer_and_consumer_lose_nothing() -> None:
    mgr = KVCacheEventManager(max_entries=1_000_000)
    blocks = chain(range(4 * 200))
    done = threading.Event()

    def engine() -> None:
        for blk in blocks:
            mgr.on_stored([blk])
            mgr.flush()
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    seen: list[KVCacheEvent] = []
    while not (done.is_set() and len(seen) == len(blocks)):
        seen.extend(mgr.get_latest_events(timeout_ms=100))
        assert thread.is_alive() or done.is_set()
    thread.join(10)
    assert [e.event_id for e in seen] == list(range(len(blocks)))
    assert mgr.dropped_events == 0


# --------------------------------------------------------------------------- plumbing


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hash_algo": "md5"},
        {"max_entries": 0},
        pytest.param({"max_entries": True}, marks=pytest.mark.pure),
        {"moves_as": "both"},
        {"tokens_per_block": 0},
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        KVCacheEventManager(**kwargs)  # type: ignore[arg-type]
