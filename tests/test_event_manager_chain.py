"""The event manager hashes and records a committed chain of blocks in one call.

Checked against the block-by-block form: a manager that is handed each ``on_stored`` call whole
must produce exactly the events of one handed the same blocks one call per block (which builds
each record alone), through evictions, tier moves, partial blocks, scopes and priorities; and
the chain builder must equal a reference written here from the V1 hash.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest
from _reference import v1_block_hash as v1_block_hash_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from events.manager import KVCacheEventManager, MovesAs
from events.wire._records import v1_stored_chain
from events.wire.model import KVCacheEvent, StoredBlock
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.errors import OutOfPagesError
from kvcache.hashing import v1_block_hash
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from kvcache.sink import BlockView

TPB = 4
SCOPES = [ReuseScope(), ReuseScope(lora_id=3), ReuseScope(salt=7), ReuseScope(lora_id=1, salt=2)]


class Fanout:
    """A sink handing every call to two managers: ``whole`` gets each stored list as is,
    ``single`` one block per call."""

    def __init__(self, whole: KVCacheEventManager, single: KVCacheEventManager) -> None:
        self.whole = whole
        self.single = single

    def on_stored(self, blocks: Sequence[BlockView]) -> None:
        self.whole.on_stored(blocks)
        for block in blocks:
            self.single.on_stored([block])

    def on_removed(self, blocks: Sequence[BlockView]) -> None:
        self.whole.on_removed(blocks)
        self.single.on_removed(blocks)

    def on_moved(self, blocks: Sequence[BlockView], old_tier: int, new_tier: int) -> None:
        self.whole.on_moved(blocks, old_tier, new_tier)
        self.single.on_moved(blocks, old_tier, new_tier)

    def on_cleared(self) -> None:
        self.whole.on_cleared()
        self.single.on_cleared()


def _drain(mgr: KVCacheEventManager) -> list[KVCacheEvent]:
    mgr.flush()
    return mgr.get_latest_events()


_request = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=6),  # segments: shared prefixes
    st.integers(0, 2),  # extra tokens past the segments (a partial last block)
    st.sampled_from(SCOPES),
    st.integers(0, 2),  # priority
    st.booleans(),  # stop committing at the end (the partial block joins the tree)
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_request, min_size=1, max_size=25),
    st.sampled_from(["updated", "removed_stored"]),
    st.booleans(),
    st.integers(13, 40),  # room for the longest prompt; little more, so blocks move and go
)
def test_whole_calls_and_block_by_block_calls_give_the_same_events(
    requests: list[tuple[list[int], int, ReuseScope, int, bool]],
    moves_as: MovesAs,
    announce_partial: bool,
    device_blocks: int,
) -> None:
    options = {"moves_as": moves_as, "announce_partial": announce_partial, "max_entries": 10**6}
    whole = KVCacheEventManager(**options)  # type: ignore[arg-type]
    single = KVCacheEventManager(**options)  # type: ignore[arg-type]
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=[
            TierConfig(name="device", num_blocks=device_blocks),
            TierConfig(name="host", num_blocks=12),
        ],
    )
    cache = KVCacheManager(config, event_sink=Fanout(whole, single))
    stored = 0
    for n, (segments, extra, scope, priority, stop) in enumerate(requests):
        # each segment is two blocks of its own tokens, so prompts share block-aligned prefixes
        tokens = [1000 * s + j for s in segments for j in range(2 * TPB)]
        tokens += [90_000 + n * 10 + j for j in range(extra)]
        try:
            with cache.create_kv_cache(tokens, reuse_scope=scope, priority=priority) as seq:
                seq.commit(tokens[seq.num_tokens :])
                if stop:
                    seq.stop_committing()
        except OutOfPagesError:
            pass
        a, b = _drain(whole), _drain(single)
        assert a == b
        stored += sum(len(getattr(e.data, "blocks", ())) for e in a)
    assert whole.num_announced == single.num_announced
    assert whole.duplicate_stores == single.duplicate_stores
    assert stored > 0


def test_a_chain_continues_the_pending_chain_of_an_earlier_call() -> None:
    mgr = KVCacheEventManager()
    config = KVCacheManagerConfig(
        tokens_per_block=TPB, tiers=[TierConfig(name="device", num_blocks=32)]
    )
    cache = KVCacheManager(config, event_sink=mgr)
    tokens = list(range(6 * TPB))
    with cache.create_kv_cache(tokens) as seq:
        seq.commit(tokens[: 2 * TPB])  # two blocks, then four more in a second call
        seq.commit(tokens[2 * TPB :])
    (event,) = _drain(mgr)  # one Stored: the second call's chain extends the first's
    hashes: list[int] = []
    parent = 0
    for i in range(6):
        parent = v1_block_hash(tokens[i * TPB : (i + 1) * TPB], parent)
        hashes.append(parent)
    blocks = getattr(event.data, "blocks", [])
    assert [b.block_hash for b in blocks] == hashes
    assert [list(b.tokens) for b in blocks] == [tokens[i * TPB : (i + 1) * TPB] for i in range(6)]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=9), max_size=6),
    st.integers(0, 2**64 - 1),
    st.sampled_from(SCOPES),
    st.integers(0, 3),
    st.integers(-5, 5),
)
def test_the_chain_builder_equals_its_reference(
    blocks: list[list[int]], parent: int, scope: ReuseScope, level: int, priority: int
) -> None:
    arrays = [array("i", b) for b in blocks]
    args = (parent, scope.lora_id, scope.salt, level, priority)
    assert v1_stored_chain(arrays, *args) == _reference_chain(blocks, *args)


def _reference_chain(
    blocks: list[list[int]],
    parent: int,
    lora: int | None,
    salt: int | None,
    level: int,
    priority: int,
) -> list[StoredBlock]:
    """The records of a chain, from the readable V1 hash, block by block."""
    out = []
    for b in blocks:
        parent = v1_block_hash_ref(b, parent, lora, salt)
        out.append(StoredBlock(parent, b, lora, level, priority, salt))
    return out


def test_the_chain_builder_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="negative"):
        v1_stored_chain([array("i", [1, -2])], 0, None, None, 0, 0)
    with pytest.raises(ValueError, match="4-byte"):
        v1_stored_chain([b"abc"], 0, None, None, 0, 0)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        v1_stored_chain((array("i", [1]),), 0, None, None, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # a parent hash is an int
        v1_stored_chain([array("i", [1])], None, None, None, 0, 0)  # type: ignore[arg-type]
    assert v1_stored_chain([], 5, None, None, 0, 0) == []


# ------------------------------------------------- hashes made ahead (create_kv_cache(sink_hashes))


def _chain_hashes(arrays: list[array[int]], parent: int, scope: ReuseScope) -> list[int]:
    out = []
    for a in arrays:
        parent = v1_block_hash(a, parent, lora_id=scope.lora_id, salt_id=scope.salt)
        out.append(parent)
    return out


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=9), max_size=6),
    st.lists(st.integers(0, 2**64 - 1), max_size=8),
    st.integers(0, 2**64 - 1),
    st.sampled_from(SCOPES),
)
def test_known_hashes_are_taken_and_the_rest_chain_from_them(
    blocks: list[list[int]], known: list[int], parent: int, scope: ReuseScope
) -> None:
    arrays = [array("i", b) for b in blocks]
    args = (parent, scope.lora_id, scope.salt, 1, 2)
    records = v1_stored_chain(arrays, *args, known)
    k = min(len(known), len(arrays))
    start = known[k - 1] if k else parent
    expected = known[:k] + _chain_hashes(arrays[k:], start, scope)
    assert [r.block_hash for r in records] == expected
    assert [list(r.tokens) for r in records] == blocks
    # the true hashes change nothing
    true = _chain_hashes(arrays, parent, scope)
    assert v1_stored_chain(arrays, *args, true) == v1_stored_chain(arrays, *args)


@pytest.mark.parametrize("build", [v1_stored_chain])
def test_bad_known_hashes_are_refused(build: object) -> None:
    chain = [array("i", [1, 2])]
    with pytest.raises(TypeError):
        build(chain, 0, None, None, 0, 0, ["7"])  # type: ignore[operator]
    with pytest.raises(OverflowError):
        build(chain, 0, None, None, 0, 0, [-1])  # type: ignore[operator]
    with pytest.raises(OverflowError):
        build(chain, 0, None, None, 0, 0, [2**64])  # type: ignore[operator]


def _manager(sink: KVCacheEventManager) -> KVCacheManager:
    tiers = [TierConfig(name="device", num_blocks=32)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, tiers=tiers), event_sink=sink)


def _serve(
    m: KVCacheManager, prompt: list[int], scope: ReuseScope, hashes: list[int] | None
) -> None:
    seq = m.create_kv_cache(prompt, scope, sink_hashes=hashes)
    seq.commit(prompt[seq.num_reused_tokens :])
    seq.commit([9] * (TPB + 1))  # decode: a block past the hashes given, hashed by the manager
    seq.close()


@pytest.mark.parametrize("scope", SCOPES)
def test_hashes_made_ahead_give_the_same_events(scope: ReuseScope) -> None:
    first = list(range(3 * TPB + 1))
    second = first[: 2 * TPB] + [77] * (2 * TPB) + [5]  # two blocks reused, two new
    plain, ahead = KVCacheEventManager(), KVCacheEventManager()
    mp, ma = _manager(plain), _manager(ahead)
    for prompt in (first, second):
        arrays = [array("i", prompt[i : i + TPB]) for i in range(0, len(prompt) // TPB * TPB, TPB)]
        _serve(mp, prompt, scope, None)
        _serve(ma, prompt, scope, _chain_hashes(arrays, 0, scope))
    assert _drain(ahead) == _drain(plain)


def test_hashes_made_ahead_are_announced_as_given() -> None:
    # trusted as documented: hashes of other tokens are announced for these blocks
    events = KVCacheEventManager()
    m = _manager(events)
    prompt = list(range(2 * TPB + 1))
    _serve(m, prompt, ReuseScope(), [11, 12])
    stored = [b for e in _drain(events) for b in getattr(e.data, "blocks", [])]
    assert [b.block_hash for b in stored][:2] == [11, 12]
    # the decode block chains from the last given hash
    assert stored[2].block_hash == v1_block_hash(array("i", prompt[2 * TPB :] + [9] * 3), 12)


def test_other_algorithms_hash_for_themselves() -> None:
    plain = KVCacheEventManager(hash_algo="v2_sha256_64")
    ahead = KVCacheEventManager(hash_algo="v2_sha256_64")
    prompt = list(range(2 * TPB + 1))
    _serve(_manager(plain), prompt, ReuseScope(), None)
    _serve(_manager(ahead), prompt, ReuseScope(), [11, 12])
    assert _drain(ahead) == _drain(plain)


@pytest.mark.parametrize("known", [None, [], [11], [11, 12, 13, 14]])
def test_an_empty_block_inside_a_chain_is_hashed_on_its_own(known: list[int] | None) -> None:
    """The one native call over the chain stops before an empty block; the blocks from there
    on are hashed one by one, so the chain is whole and as the reference gives it."""
    blocks = [[1, 2], [], [3], [4, 5]]
    arrays = [array("i", b) for b in blocks]
    records = v1_stored_chain(arrays, 7, 3, 9, 0, 35, known)
    k = len(known or [])
    start = (known or [])[k - 1] if k else 7
    reference = _reference_chain(blocks[k:], start, 3, 9, 0, 35)
    assert records[k:] == reference[: len(blocks) - k]
    assert [r.block_hash for r in records[:k]] == (known or [])[:k]
    assert len(records) == len(blocks)
