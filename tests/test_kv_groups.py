"""KV-cache groups of hybrid models (vLLM: one group per attention type, ``group_idx`` on every
event, ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` on stores):

- the spec decodes on both decoder paths, and a masked store keeps its token ids;
- a sliding-window group's masked store (its token ids cover the blocks before the window,
  which its hashes leave out) is keyed from its trailing blocks, in the group's own key space;
- removals are per group: the same block in two groups is two entries;
- :meth:`KvIndexer.prefix_hit` applies vLLM's hybrid rule, checked by hypothesis against a
  model written here from vLLM's documented algorithm (``HybridKVCacheCoordinator`` and
  ``SlidingWindowManager.find_longest_cache_hit``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.codec import decode_batch
from events.wire.decode import decode_general
from events.wire.model import DecodedBatch, KVCacheEvent, Removed, Stored, StoredBlock
from router_sim.router.indexer import KvIndexer, MatchDetail, sliding_hit

TPB = 4


def _payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def _store(hashes: list[int], tokens: list[int], group: int, **spec: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": TPB,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": group,
        **spec,
    }


SW = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 2 * TPB}
FULL = {"kv_cache_spec_kind": "full_attention"}
TOKENS = list(range(100, 100 + 4 * TPB))  # four blocks


@pytest.mark.parametrize("decode", [decode_batch, decode_general], ids=["typed", "general"])
def test_the_group_spec_and_a_masked_stores_tokens_decode(decode: Any) -> None:
    batch = decode(
        _payload(_store([1, 2, 3, 4], TOKENS, 0, **FULL), _store([3, 4], TOKENS, 1, **SW))
    )
    full, window = (e.data for e in batch.events)
    assert isinstance(full, Stored) and isinstance(window, Stored)
    assert (full.group, full.group_kind, full.sliding_window) == (0, "full_attention", None)
    assert not full.masked and full.masked_tokens is None
    assert (window.group, window.group_kind, window.sliding_window) == (1, "sliding_window", 8)
    assert window.masked and list(window.masked_tokens or []) == TOKENS
    assert [b.block_hash for b in window.blocks] == [3, 4]


def test_a_sliding_window_store_is_keyed_from_its_trailing_blocks() -> None:
    index = KvIndexer(TPB, key_by_tokens=True)
    index.apply_batch(0, decode_batch(_payload(_store([1, 2, 3, 4], TOKENS, 0, **FULL))))
    # the same blocks in group 1 (a separate index): as the full group's, in its key space
    other = KvIndexer(TPB, key_by_tokens=True)
    other.apply_batch(0, decode_batch(_payload(_store([1, 2, 3, 4], TOKENS, 1, **SW))))
    index.apply_batch(0, decode_batch(_payload(_store([3, 4], TOKENS, 1, **SW))))
    assert index.worker_anomalies(0)["unkeyed_block"] == 0
    for h in (3, 4):
        assert index.key_of(0, h, 1) == other.key_of(0, h, 1) != index.key_of(0, h)
    assert index.block_count(0) == 6


def test_removals_are_per_group() -> None:
    index = KvIndexer(TPB, key_by_tokens=True)
    index.apply_batch(
        0,
        decode_batch(
            _payload(_store([1, 2, 3, 4], TOKENS, 0, **FULL), _store([3, 4], TOKENS, 1, **SW))
        ),
    )
    k0, k1 = index.key_of(0, 4), index.key_of(0, 4, 1)
    removal = {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU", "group_idx": 1}
    index.apply_batch(0, decode_batch(_payload(removal)))
    assert index.holds(0, k0) == (0,) and index.holds(0, k1) == ()  # type: ignore[arg-type]
    index.apply_batch(0, decode_batch(_payload({**removal, "group_idx": 0})))
    assert index.holds(0, k0) == ()  # type: ignore[arg-type]


def test_sliding_hit_follows_the_engines_scan() -> None:
    held = {0, 1, 3, 4, 5}.__contains__
    assert sliding_hit(held, 6, 2) == 6  # blocks 4-5: the window's two blocks end the hit
    assert sliding_hit(held, 4, 2) == 2  # within 4: block 3 alone, then 0-1
    assert sliding_hit(held, 3, 3) == 2  # no run of 3: the run held from the first block
    assert sliding_hit(lambda i: False, 5, 1) == 0


# ----------------------------------------------------------------- the hybrid rule, vs a model


def model_hit(full: list[set[int]], windows: list[tuple[set[int], int]], length: int) -> int:
    """vLLM's fixed point, written from its documented algorithm: each full-attention group
    caps the hit at its leading run; each sliding-window group, scanning the candidate from
    its end, needs ``need`` consecutive cached blocks ending the hit (else its leading run);
    repeat until no group lowers it."""
    hit = length
    while True:
        before = hit
        for held in full:
            n = 0
            while n < hit and n in held:
                n += 1
            hit = min(hit, n)
        for held, need in windows:
            run, found = 0, None
            for i in reversed(range(hit)):
                run = run + 1 if i in held else 0
                if run >= need:
                    found = i + run
                    break
            hit = min(hit, found if found is not None else run)
        if hit == before:
            return hit


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 10),
    gone0=st.sets(st.integers(0, 9)),
    gone1=st.sets(st.integers(0, 9)),
    gone2=st.sets(st.integers(0, 9)),
    window=st.integers(1, 4 * TPB + 1),
    third=st.booleans(),
)
def test_prefix_hit_is_vllms_hybrid_rule(
    n: int, gone0: set[int], gone1: set[int], gone2: set[int], window: int, third: bool
) -> None:
    """Group 0 (full attention), group 1 (sliding window of ``window`` tokens) and, with
    ``third``, group 2 (another full-attention group) each store the prompt's ``n`` blocks,
    then drop some; the hit is the model's."""
    tokens = list(range(7, 7 + n * TPB))
    hashes = [1000 + i for i in range(n)]
    index = KvIndexer(TPB, key_by_tokens=True)
    sw = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": window}
    events = [_store(hashes, tokens, 0, **FULL), _store(hashes, tokens, 1, **sw)]
    if third:
        events.append(_store(hashes, tokens, 2, **FULL))
    index.apply_batch(0, decode_batch(_payload(*events)))
    keys = [index.key_of(0, h) for h in hashes]
    drops = [(0, gone0), (1, gone1)] + ([(2, gone2)] if third else [])
    for group, gone in drops:
        removed = [hashes[i] for i in sorted(gone) if i < n]
        if removed:
            index.apply_batch(
                0, DecodedBatch(0.0, [KVCacheEvent(0, Removed(removed, 0, group or None))])
            )
    held = [{i for i in range(n) if i not in gone} for _, gone in drops]
    need = max(-(-(window - 1) // TPB), 1)  # vLLM counts a block before comparing
    run0 = next((i for i in range(n) if i not in held[0]), n)  # group 0's own run
    full = [held[0]] + ([held[2]] if third else [])
    want = model_hit(full, [(held[1], need)], n)
    hit, limit = index.prefix_hit(0, keys)
    assert hit == want
    assert (limit is None) == (hit == run0)
    # what routing counts: every block is on the device tier, so the details are the hit's;
    # the same with a key the table does not hold after the chain (the general path, as far
    # as the native loop reads ahead)
    detail = MatchDetail(want, want, want, 0) if want else None
    for q in (keys, [*keys, "x"]):
        assert index.find_matches(q).get(0, 0) == want
        assert index.find_matches_detailed(q).get(0) == detail


def test_a_worker_without_groups_hits_its_plain_run() -> None:
    index = KvIndexer(TPB, key_by_tokens=True)
    blocks = [StoredBlock(i, [i, 1, 2, 3]) for i in range(3)]
    index.apply_batch(0, DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, blocks, TPB))]))
    keys = [index.key_of(0, i) for i in range(3)]
    assert index.prefix_hit(0, keys) == (3, None)
