"""Token arrays are packed and checked by one native loop when ``kvcache._tokens`` is built:
it must give the bytes and the errors of the pure-Python path (the reference and fallback), and
every bad prompt or commit is still refused, with the same error, through the manager."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.keys as keys
from kvcache import KVCacheManager, KVCacheManagerConfig, TierConfig
from kvcache.keys import token_array_bytes

try:
    from kvcache import _tokens as native
except ImportError:  # pragma: no cover - depends on the install
    native = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(native is None, reason="kvcache._tokens is not built")
INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@pytest.fixture(params=["native", "pure"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with the native packer (when built) and once with the pure path."""
    if request.param == "native" and native is None:
        pytest.skip("kvcache._tokens is not built")
    with pytest.MonkeyPatch.context() as m:
        if request.param == "pure":
            m.setattr(keys, "_pack_nonneg", None)
            m.setattr(keys, "_all_nonneg", None)
        yield request.param


def outcome(fn: Callable[[], Any]) -> Any:
    """What a call returned, or the type and message of what it raised."""
    try:
        return ("ok", fn())
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))


def both(tokens: Any) -> tuple[Any, Any]:
    """token_array_bytes through the native packer and through the pure path."""
    got = outcome(lambda: token_array_bytes(tokens))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(keys, "_pack_nonneg", None)
        want = outcome(lambda: token_array_bytes(tokens))
    return got, want


@needs_native
@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(INT32, max_size=300), as_array=st.booleans())
def test_native_packing_equals_the_pure_path(tokens: list[int], as_array: bool) -> None:
    got, want = both(array("i", tokens) if as_array else tokens)
    assert got == want
    if got[0] == "ok":
        arr, data = got[1]
        assert list(arr) == tokens
        assert data == b"".join(t.to_bytes(4, "little") for t in tokens)  # WIRE.md section 2


@needs_native
@pytest.mark.parametrize("at", [0, 1, 7, 8, 1000, 4095])
@pytest.mark.parametrize("bad", [-1, -(2**31), -256])
def test_a_negative_id_anywhere_is_refused_like_the_pure_path(at: int, bad: int) -> None:
    """Every position of a long array (the loop's vectorized body and its remainder)."""
    tokens = array("i", range(5000, 5000 + 4096))
    tokens[at] = bad
    got, want = both(tokens)
    assert got == want == ("ValueError", f"token ids must be in [0, 2**31), got {bad}")


@needs_native
def test_native_packer_takes_only_int32_arrays() -> None:
    for wrong in (array("l", [1, 2]), array("h", [1, 2]), b"\x01\x00\x00\x00", bytearray(4)):
        with pytest.raises(TypeError):
            native.pack_nonneg(wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.pack_nonneg([1, 2])  # type: ignore[arg-type]
    assert native.pack_nonneg(array("i")) == b""
    # little-endian whatever the machine's byte order (WIRE.md section 2)
    assert native.pack_nonneg(array("i", [2**31 - 1, 258])) == b"\xff\xff\xff\x7f\x02\x01\x00\x00"


@needs_native
def test_native_packing_copies_the_array() -> None:
    """The bytes are the sequence's own record: changing the array afterwards changes nothing,
    and the array is not held (it can still grow)."""
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


@pytest.mark.usefixtures("path")
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
