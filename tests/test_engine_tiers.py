"""Tiers and clears as each engine means them (docs/INTEROP.md):

- SGLang's host medium ``CPU_PINNED`` is the host tier (cache level 1, what vLLM calls CPU),
  on both decoder paths;
- ``AllBlocksCleared`` empties what the worker's engine empties: vLLM's device tier only
  (``BlockPool.reset_prefix_cache``; offloaded copies stay), every tier of SGLang (its reset
  clears the host pool too) and of this project's workers; the dialect tells the index;
- an offload tier that announces one hash once per chunk (vLLM 0.33's offloading connector)
  is counted: the block stays until its last holder removes it (hypothesis against a model of
  the announcements).
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.codec import decode_batch
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    cache_level_of,
    medium_of,
)
from router_sim.router.indexer import KvIndexer, engine_clear_scope
from router_sim.sim.dialects import clear_scope

TPB = 4


def _batch(*data: object) -> DecodedBatch:
    return DecodedBatch(0.0, [KVCacheEvent(i, d) for i, d in enumerate(data)])  # type: ignore[arg-type]


def _chain(first: int, n: int, level: int = 0) -> Stored:
    return Stored(
        None,
        [StoredBlock(first + i, [first + i, 1, 2, 3], None, level) for i in range(n)],
        TPB,
    )


def _placeholders(hashes: list[int], level: int = 1) -> Stored:
    """A CPU-offload store as vLLM announces it: hashes only, no token ids."""
    return Stored(None, [StoredBlock(h, [], None, level) for h in hashes], 0)


def test_cpu_pinned_is_the_host_tier_on_every_decoder_path() -> None:
    assert cache_level_of("CPU_PINNED") == cache_level_of("cpu_pinned") == cache_level_of("CPU")
    assert medium_of(cache_level_of("CPU_PINNED")) == "CPU"
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [-5],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "CPU_PINNED",
                },
                {"type": "BlockRemoved", "block_hashes": [-5], "medium": "CPU_PINNED"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    stored, removed = (e.data for e in batch.events)
    assert isinstance(stored, Stored) and isinstance(removed, Removed)
    assert stored.blocks[0].cache_level == 1 and removed.cache_level == 1


def test_the_engines_clear_scopes() -> None:
    assert engine_clear_scope("vllm") == clear_scope("vllm") == "device"
    assert engine_clear_scope("sglang") == clear_scope("sglang") == "all"
    assert clear_scope("native") is None and clear_scope("trtllm") is None
    with pytest.raises(ValueError):
        clear_scope("other")
    with pytest.raises(ValueError):
        KvIndexer(TPB).set_clear_scope(0, "host")


@pytest.mark.parametrize(("scope", "left"), [("device", {1}), ("all", set()), (None, {1})], ids=str)
def test_a_clear_empties_what_the_engine_empties(scope: str | None, left: set[int]) -> None:
    """An engine-hashed worker (keyed by its tokens): GPU chain 10..13, copies of 10 and 11 on
    the host tier, then a clear. vLLM ("device", also the default for engine hashes) keeps the
    host copies, SGLang ("all") drops them."""
    index = KvIndexer(TPB, key_by_tokens=True)
    index.set_clear_scope(0, scope)
    assert index.clear_scope(0) == scope
    index.apply_batch(0, _batch(_chain(10, 4), _placeholders([10, 11])))
    keys = [index.key_of(0, h) for h in (10, 11, 12, 13)]
    assert [index.holds(0, k) for k in keys] == [(0, 1), (0, 1), (0,), (0,)]  # type: ignore[arg-type]
    index.apply_batch(0, _batch(AllBlocksCleared()))
    assert {lvl for k in keys for lvl in index.holds(0, k)} == left  # type: ignore[arg-type]
    assert index.block_count(0) == (2 if left else 0)


def test_the_scope_outlives_a_removal_of_the_worker() -> None:
    index = KvIndexer(TPB, key_by_tokens=True)
    index.set_clear_scope(3, "all")
    index.apply_batch(3, _batch(_chain(10, 2)))
    index.remove_worker(3)
    assert index.clear_scope(3) == "all"
    index.set_clear_scope(3, None)
    assert index.clear_scope(3) is None


# ----------------------------------------------------------------- counted offload chunks

op_st = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.sampled_from([0, 1])),
    st.tuples(st.just("remove"), st.integers(0, 3), st.sampled_from([0, 1])),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, max_size=30))
def test_offload_announcements_are_counted_per_chunk(ops: list[tuple[str, int, int]]) -> None:
    """Model: the device tier holds a block or not (vLLM announces a GPU block once); a slower
    tier counts announcements (one per offload chunk holding the block) and holds the block
    while the count is above 0. Every block first comes with its tokens on the GPU, so it has
    a key; offload stores and all removals name the engine hash only."""
    index = KvIndexer(TPB, key_by_tokens=True)
    hashes = [100 + i for i in range(4)]
    index.apply_batch(0, _batch(*(_chain(h, 1) for h in hashes)))
    keys = [index.key_of(0, h) for h in hashes]
    device = {0, 1, 2, 3}
    host = dict.fromkeys(range(4), 0)
    for op, i, level in ops:
        h = hashes[i]
        if op == "store":
            if level == 0:
                if i in device:
                    continue  # vLLM never re-announces a GPU block it holds
                index.apply_batch(0, _batch(_chain(h, 1)))
                device.add(i)
            else:
                index.apply_batch(0, _batch(_placeholders([h])))
                host[i] += 1
        else:
            index.apply_batch(0, _batch(Removed([h], level)))
            if level == 0:
                device.discard(i)
            elif host[i]:
                host[i] -= 1
        for j, key in enumerate(keys):
            want = tuple(lvl for lvl, on in ((0, j in device), (1, host[j] > 0)) if on)
            assert index.holds(0, key) == want, (ops, j)  # type: ignore[arg-type]
