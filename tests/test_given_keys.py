"""``KVCacheManager.create_kv_cache(block_keys=..., sink_hashes=...)``: an engine that hashed a
request once on arrival hands the cache its keys and the event sink its V1 hashes; the cache
files, finds and reuses blocks by them exactly as by the tokens, and refuses malformed ones."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.hashing import blockchain_keys
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from kvcache.sink import RecordingSink


def _manager() -> KVCacheManager:
    tiers = [TierConfig(name="device", num_blocks=64)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, tiers=tiers))


def _committed_keys(m: KVCacheManager) -> list[bytes]:
    return sorted(b.key for b in m.iter_blocks())


def test_given_keys_file_the_blocks_as_computed_ones_would() -> None:
    scope = ReuseScope(lora_id=5, salt=9)
    prompt = array("i", range(100, 114))  # three full blocks and two tokens
    plain, keyed = _manager(), _manager()
    for m, keys in ((plain, None), (keyed, blockchain_keys(scope, prompt, 4)[:3])):
        seq = m.create_kv_cache(prompt, scope, block_keys=keys)
        seq.commit(prompt[seq.num_reused_tokens :])
        seq.commit(array("i", [7, 7, 7]))  # a block past the keys: hashed here
        seq.close()
    assert _committed_keys(plain) == _committed_keys(keyed)
    again = keyed.create_kv_cache(prompt, scope)
    assert again.num_reused_tokens == len(prompt) - 1  # found by content, as any other
    again.close()


def test_given_keys_are_used_not_recomputed() -> None:
    # keys of other content are trusted (documented): the blocks are filed under them
    m = _manager()
    prompt = array("i", range(8))
    fake = [bytes([1]) * 32, bytes([2]) * 32]
    seq = m.create_kv_cache(prompt, block_keys=fake)
    seq.commit(prompt)
    seq.close()
    assert set(fake) <= {b.key for b in m.iter_blocks()}


def test_given_keys_find_the_cached_prefix_by_key() -> None:
    # the prefix is looked up by the keys given, not by the tokens (which are not packed,
    # compared or hashed): blocks filed under the keys are found for other tokens
    m = _manager()
    fake = [bytes([1]) * 32, bytes([2]) * 32]
    seq = m.create_kv_cache(array("i", range(8)), block_keys=fake)
    seq.commit(array("i", range(8)))
    seq.close()
    other = array("i", range(50, 59))  # two full blocks and one token, no content cached
    assert m.create_kv_cache(other).num_reused_tokens == 0
    keyed = m.create_kv_cache(other, block_keys=fake)
    assert keyed.num_reused_tokens == 8
    assert list(keyed.tokens) == list(range(8))  # what the cache holds: the blocks' tokens
    keyed.close()


@given(
    prompts=st.lists(
        st.tuples(
            st.integers(0, 2),  # scope
            st.lists(st.integers(0, 2), min_size=1, max_size=5),  # block contents
            st.integers(0, 3),  # tokens past the full blocks
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=60, deadline=None)
def test_given_keys_reuse_what_the_tokens_would(prompts: list[tuple[int, list[int], int]]) -> None:
    # full and partial reuse, three scopes: with every full block's key given, a manager
    # reuses the same blocks as one that matches by tokens, and holds the same tree after
    scopes = [ReuseScope(), ReuseScope(lora_id=2), ReuseScope(lora_id=2, salt=5)]
    plain, keyed = _manager(), _manager()
    for which, contents, extra in prompts:
        scope = scopes[which]
        tokens = array("i", [t for c in contents for t in (c, c + 1, c + 2, c + 3)])
        tokens.extend(range(90, 90 + extra))
        keys = blockchain_keys(scope, tokens, 4)[: len(tokens) // 4]
        reused = []
        for m, given_keys in ((plain, None), (keyed, keys)):
            seq = m.create_kv_cache(tokens, scope, block_keys=given_keys)
            reused.append((seq.num_reused_tokens, [b.uid for b in seq.held_blocks()]))
            seq.commit(tokens[seq.num_reused_tokens :])
            assert list(seq.tokens) == list(tokens)
            seq.close()
        assert reused[0] == reused[1]
    assert _committed_keys(plain) == _committed_keys(keyed)


def test_sink_hashes_reach_the_sink_with_their_blocks() -> None:
    # blocks i..j stored by a commit come with hashes i..j; reused and decode blocks without
    sink = RecordingSink()
    tiers = [TierConfig(name="device", num_blocks=64)]
    m = KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, tiers=tiers), event_sink=sink)
    first = m.create_kv_cache(array("i", range(9)), sink_hashes=[1, 2])
    first.commit(array("i", range(9)))
    first.close()
    sink.clear()
    prompt = array("i", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])  # 2 blocks reused
    seq = m.create_kv_cache(prompt, sink_hashes=[1, 2, 3, 4])
    assert seq.num_reused_tokens == 8
    seq.commit(prompt[8:12])
    seq.commit(prompt[12:])
    seq.commit(array("i", [9, 9, 9]))
    seq.close()
    stored = [(r.keys, r.hashes) for r in sink.records if r.kind == "stored"]
    assert [len(k) for k, _ in stored] == [1, 1, 1]  # block 2, block 3, a decode block
    assert [h for _, h in stored] == [(3,), (4,), ()]


@pytest.mark.parametrize("hashes", [[1, 2, 3], [-1], [2**64], ["1"], [1.0], b"ab"])
def test_bad_sink_hashes_are_refused(hashes: Any) -> None:
    m = _manager()
    with pytest.raises(ValueError):
        m.create_kv_cache(array("i", range(8)), sink_hashes=hashes)


@pytest.mark.parametrize(
    "keys",
    [b"x" * 32, [b"x" * 32] * 3, [b"short"], ["x" * 32]],
)
def test_bad_block_keys_are_refused(keys: Any) -> None:
    m = _manager()
    with pytest.raises(ValueError):
        m.create_kv_cache(array("i", range(8)), block_keys=keys)


@given(
    st.lists(
        st.one_of(
            st.binary(min_size=31, max_size=33),
            st.text(min_size=32, max_size=32),
            st.integers(),
            st.none(),
        ),
        max_size=6,
    )
)
def test_block_keys_are_taken_exactly_when_each_is_32_bytes(keys: list[Any]) -> None:
    """Up to one key per full block (6 here): refused unless every key is 32 bytes."""
    expected = all(type(k) is bytes and len(k) == 32 for k in keys)
    for given_keys in (keys, tuple(keys)):
        m = _manager()
        if expected:
            m.create_kv_cache(array("i", range(25)), block_keys=given_keys).close()
        else:
            with pytest.raises(ValueError, match="block_keys"):
                m.create_kv_cache(array("i", range(25)), block_keys=given_keys)


@given(
    st.lists(
        st.one_of(st.integers(-(2**65), 2**65), st.booleans(), st.floats(), st.binary()),
        max_size=6,
    )
)
def test_sink_hashes_are_taken_exactly_when_each_is_a_64_bit_int(hashes: list[Any]) -> None:
    expected = all(type(h) is int and 0 <= h < 2**64 for h in hashes)
    for given_hashes in (hashes, tuple(hashes)):
        m = _manager()
        if expected:
            m.create_kv_cache(array("i", range(25)), sink_hashes=given_hashes).close()
        else:
            with pytest.raises(ValueError, match="sink_hashes"):
                m.create_kv_cache(array("i", range(25)), sink_hashes=given_hashes)


def test_ids_past_the_given_keys_are_still_checked() -> None:
    """The ids under given keys were checked when the keys were made (blockchain_keys refuses a
    negative one); every id past them is checked here, as without keys."""
    scope = ReuseScope()
    prompt = array("i", range(100, 114))  # three full blocks and two tokens
    keys = blockchain_keys(scope, prompt, 4)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        blockchain_keys(scope, array("i", [1, 2, 3, -4]), 4)
    m = _manager()
    for at in (8, 12, 13):  # in the unkeyed third block, in the partial tail
        bad = array("i", prompt)
        bad[at] = -1
        with pytest.raises(ValueError, match=r"got -1"):
            m.create_kv_cache(bad, scope, block_keys=keys[:2])
    # types are checked over the whole prompt (a bool in a list)
    with pytest.raises(TypeError, match="bool"):
        m.create_kv_cache([*prompt[:13], True], scope, block_keys=keys[:2])
    assert m.create_kv_cache(prompt, scope, block_keys=keys[:2]).num_reused_tokens == 0
