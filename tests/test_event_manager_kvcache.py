"""KVCacheEventManager as the sink of a real KVCacheManager: the events an engine would send.

Every expected hash is what a router computes from the request's tokens and scope
(``kvcache.hashing.chain_hashes``), so these scenarios also check the two sides agree.
"""

from __future__ import annotations

import pytest

from events.manager import KVCacheEventManager, MovesAs
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    EventData,
    EventDiff,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.hashing import HashAlgo, chain_hashes, v1_block_hash
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope

TPB = 4
A = list(range(16))
B = list(range(100, 116))


class Engine:
    """A cache manager plus event manager; ``request`` runs one prompt and returns the
    iteration's events."""

    def __init__(self, tiers: list[int], **event_options: object) -> None:
        self.events = KVCacheEventManager(**event_options)  # type: ignore[arg-type]
        config = KVCacheManagerConfig(
            tokens_per_block=TPB,
            tiers=[TierConfig(name=f"tier{i}", num_blocks=n) for i, n in enumerate(tiers)],
        )
        self.cache = KVCacheManager(config, event_sink=self.events)

    def request(
        self, tokens: list[int], scope: ReuseScope | None = None, partial: bool = False
    ) -> list[EventData]:
        with self.cache.create_kv_cache(tokens, reuse_scope=scope) as seq:
            seq.commit(tokens[seq.num_tokens :])
            if partial:
                seq.stop_committing()
        self.events.flush()
        return [e.data for e in self.events.get_latest_events()]


def stored(
    tokens: list[int],
    hashes: list[BlockHash],
    parent: BlockHash | None = None,
    level: int = 0,
    scope: ReuseScope | None = None,
    first_block: int = 0,
) -> Stored:
    scope = scope or ReuseScope()
    blocks = [
        StoredBlock(
            h,
            tokens[(first_block + i) * TPB : (first_block + i + 1) * TPB],
            scope.lora_id,
            level,
            35,
            scope.salt,
        )
        for i, h in enumerate(hashes)
    ]
    return Stored(parent, blocks, TPB)


HA = chain_hashes(A, TPB)
HB = chain_hashes(B, TPB)


def test_commit_announces_the_chain_the_router_computes() -> None:
    engine = Engine([8])
    assert engine.request(A) == [stored(A, HA)]


def test_reused_blocks_are_not_stored_again() -> None:
    engine = Engine([16])
    engine.request(A)
    longer = [*A, 16, 17, 18, 19, 20, 21, 22, 23]
    # A's four blocks are reused; only blocks 4-5 are new and announced, chained to A's last.
    assert engine.request(longer) == [
        stored(longer, chain_hashes(longer, TPB)[4:], parent=HA[3], first_block=4)
    ]
    assert engine.request(longer) == []  # everything reused (or completed into a cached block)
    assert engine.events.duplicate_stores == 0
    assert engine.events.num_announced == 6


@pytest.mark.parametrize(
    "scope",
    [ReuseScope(lora_id=3), ReuseScope.for_request(cache_salt="tenant-a"), ReuseScope(7, 11)],
)
def test_scopes_get_their_own_hashes_and_fields(scope: ReuseScope) -> None:
    engine = Engine([16])
    engine.request(A)
    (event,) = engine.request(A, scope)
    expected = chain_hashes(A, TPB, scope)
    assert event == stored(A, expected, scope=scope)
    assert not set(expected) & set(HA)


def test_eviction_removes_descendants_first() -> None:
    engine = Engine([4])
    engine.request(A)
    assert engine.request(B) == [Removed(HA[::-1], 0), stored(B, HB)]
    assert engine.events.num_announced == 4


@pytest.mark.parametrize("moves_as", ["updated", "removed_stored"])
def test_offload_and_onboard(moves_as: MovesAs) -> None:
    engine = Engine([4, 8], moves_as=moves_as)
    engine.request(A)
    offload = engine.request(B)
    # Shares A's first two blocks (on the host tier by now), then diverges.
    a2 = A[:8] + list(range(300, 308))
    h_a2 = chain_hashes(a2, TPB)
    back = engine.request(a2)
    new_blocks = stored(a2, h_a2[2:], parent=HA[1], first_block=2)
    if moves_as == "updated":
        assert offload == [*(Updated(h, EventDiff(0, 1)) for h in HA[::-1]), stored(B, HB)]
        # room for the onboard (B's leaves), the onboard, room for the two new blocks
        assert back == [
            *(Updated(h, EventDiff(0, 1)) for h in HB[:1:-1]),
            *(Updated(h, EventDiff(1, 0)) for h in HA[:2]),
            *(Updated(h, EventDiff(0, 1)) for h in HB[1::-1]),
            new_blocks,
        ]
    else:
        assert offload == [Removed(HA[::-1], 0), stored(A, HA, level=1), stored(B, HB)]
        # each move re-stores its blocks parent first, chained to their parent's hash
        assert back == [
            Removed(HB[:1:-1], 0),
            stored(B, HB[2:], parent=HB[1], level=1, first_block=2),
            Removed(HA[:2], 1),
            stored(A, HA[:2]),
            Removed(HB[1::-1], 0),
            stored(B, HB[:2], level=1),
            new_blocks,
        ]


def test_dropped_from_the_last_tier_is_removed_at_that_level() -> None:
    engine = Engine([4, 4])
    engine.request(A)
    engine.request(B)
    c = list(range(200, 216))
    # Each device page B gives up needs a host page: A's blocks, oldest there, are dropped one
    # by one (leaf first) to make room, so removals and moves alternate.
    expected: list[EventData] = []
    for a, b in zip(HA[::-1], HB[::-1], strict=True):
        expected += [Removed([a], 1), Updated(b, EventDiff(0, 1))]
    assert engine.request(c) == [*expected, stored(c, chain_hashes(c, TPB))]
    assert engine.events.num_announced == 8


def test_clear_announces_all_blocks_cleared_and_forgets() -> None:
    engine = Engine([8])
    engine.request(A)
    engine.cache.clear_reusable_blocks()
    engine.events.flush()
    assert [e.data for e in engine.events.get_latest_events()] == [AllBlocksCleared()]
    assert engine.events.num_announced == 0
    assert engine.request(A) == [stored(A, HA)]


@pytest.mark.parametrize("announce_partial", [False, True])
def test_partial_block_after_stop_committing(announce_partial: bool) -> None:
    engine = Engine([8], announce_partial=announce_partial)
    tokens = A[:10]
    events = engine.request(tokens, partial=True)
    full = stored(tokens, HA[:2])
    if not announce_partial:
        assert events == [full]
        return
    tail = v1_block_hash([8, 9], int(HA[1]))
    assert events == [Stored(None, [*full.blocks, StoredBlock(tail, [8, 9])], TPB)]


@pytest.mark.parametrize("algo", [HashAlgo.V2_SHA256, HashAlgo.V2_SHA256_64])
def test_v2_hashes_match_the_router_side(algo: HashAlgo) -> None:
    engine = Engine([8], hash_algo=algo)
    scope = ReuseScope(7, 11)
    (event,) = engine.request(A, scope)
    assert isinstance(event, Stored)
    assert [b.block_hash for b in event.blocks] == chain_hashes(A, TPB, scope, algo)
