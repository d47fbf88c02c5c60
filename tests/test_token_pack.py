"""Token arrays are packed and checked once per request (``kvcache.tokens.token_array_bytes``):
the bytes are WIRE.md's 4-byte little-endian ids, the errors name what is wrong, and every bad
prompt or commit is refused, with the same error, through the manager."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, KVCacheManagerConfig, TierConfig
from kvcache.tokens import checked_token_array, token_array_bytes

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(INT32, max_size=300), as_array=st.booleans())
def test_packing_gives_little_endian_ids_or_refuses_a_negative_one(
    tokens: list[int], as_array: bool
) -> None:
    given_tokens = array("i", tokens) if as_array else tokens
    if any(t < 0 for t in tokens):
        with pytest.raises(ValueError, match=f"got {min(tokens)}"):
            token_array_bytes(given_tokens)
        with pytest.raises(ValueError, match=f"got {min(tokens)}"):
            checked_token_array(given_tokens)
        return
    arr, data = token_array_bytes(given_tokens)
    assert list(arr) == tokens
    assert data == b"".join(t.to_bytes(4, "little") for t in tokens)  # WIRE.md section 2
    assert list(checked_token_array(given_tokens)) == tokens


def test_packing_copies_the_array() -> None:
    """The packed bytes do not change when the caller's array changes afterwards, and the
    array is not held (it can still grow)."""
    arr = array("i", [1, 2, 3])
    _, data = token_array_bytes(arr)
    arr[0] = 9
    arr.append(4)  # would raise BufferError if a buffer export had leaked
    assert data == array("i", [1, 2, 3]).tobytes()


BAD_PROMPTS: list[tuple[Any, type[Exception], str]] = [
    (array("i", [1, 2, -3, 4]), ValueError, "got -3"),
    ([1, 2, -3, 4], ValueError, "got -3"),
    ([1, True, 3], TypeError, "bool"),
    ([1, 2.0, 3], TypeError, "got float"),
    ([1, 2**31], ValueError, "got 2147483648"),
    ("1234", TypeError, "got str"),
    ({1, 2, 3}, TypeError, "got set"),
]


@pytest.mark.parametrize(("prompt", "error", "says"), BAD_PROMPTS)
def test_bad_prompts_and_commits_are_refused_by_the_manager(
    prompt: Any, error: type[Exception], says: str
) -> None:
    """Through create_kv_cache, probe_reuse and commit, with nothing changed."""
    cfg = KVCacheManagerConfig(tokens_per_block=2, tiers=[TierConfig(name="device", num_blocks=8)])
    m = KVCacheManager(cfg)
    with pytest.raises(error, match=says):
        m.create_kv_cache(prompt)
    with pytest.raises(error, match=says):
        m.probe_reuse(prompt)
    seq = m.create_kv_cache(array("i", [5, 6, 7]))
    seq.commit(array("i", [5, 6, 7]))
    with pytest.raises(error, match=says):
        seq.commit(prompt)
    assert seq.num_tokens == 3 and seq.tokens == [5, 6, 7]
    seq.close()
    m.verify()
    assert m.probe_reuse([5, 6, 8]) == 2
