"""Bad input gets a clear, typed error and leaves the cache usable and consistent."""

from __future__ import annotations

from typing import Any

import pytest
from kv_helpers import manager, run
from pydantic import ValidationError

from kvcache import (
    CacheStateError,
    ClosedCacheError,
    KVCacheManager,
    KVCacheManagerConfig,
    KVLayout,
    TierConfig,
)


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ("abc", TypeError, "sequence of ints"),
        (b"\x01\x02", TypeError, "sequence of ints"),
        ([1, 2.5], TypeError, "float"),
        ([1, None], TypeError, "NoneType"),
        ([1, "2"], TypeError, "str"),
        ([1, -1], ValueError, r"got -1"),
        ([2**31], ValueError, r"got 2147483648"),
        ([2**70], ValueError, r"\[0, 2\*\*31\)"),
        (5, TypeError, "not iterable"),
    ],
)
def test_bad_tokens(tokens: Any, error: type[Exception], match: str) -> None:
    m, _sink = manager(2, 4)
    run(m, [1, 2, 3])
    with pytest.raises(error, match=match):
        m.create_kv_cache(tokens)
    with pytest.raises(error, match=match):
        m.probe_reuse(tokens)
    seq = m.create_kv_cache([1, 2, 3])
    with pytest.raises(error, match=match):
        seq.commit(tokens)
    assert seq.num_tokens == 2
    seq.commit([3])
    seq.close()
    assert m.stats.queries == 2
    m.verify()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"reuse_scope": "tenant"}, TypeError),
        ({"reuse_scope": 7}, TypeError),
        ({"priority": 101}, ValueError),
        ({"priority": -1}, ValueError),
        ({"priority": True}, TypeError),
        ({"priority": 3.0}, TypeError),
    ],
)
def test_bad_scope_or_priority(kwargs: dict[str, Any], error: type[Exception]) -> None:
    m, _ = manager(2, 4)
    with pytest.raises(error):
        m.create_kv_cache([1, 2], **kwargs)
    assert m.stats.queries == 0 and m.num_available_pages() == 4


def test_closed_cache() -> None:
    m, _ = manager(2, 4)
    seq = m.create_kv_cache([])
    seq.commit([1, 2, 3])
    seq.close()
    seq.close()  # a second close is a no-op
    assert seq.closed
    for call in (
        lambda: seq.commit([4]),
        lambda: seq.resize(8),
        seq.stop_committing,
        seq.suspend,
        seq.resume,
        seq.page_indices,
    ):
        with pytest.raises(ClosedCacheError, match="closed"):
            call()
    assert m.num_available_pages() == 4
    with m.create_kv_cache([1, 2, 0]) as again:
        assert again.num_reused_tokens == 2
    assert again.closed
    m.verify()


@pytest.mark.pure
def test_state_errors() -> None:
    m, _ = manager(2, 4)
    seq = m.create_kv_cache([])
    with pytest.raises(CacheStateError, match="not suspended"):
        seq.resume()
    seq.suspend()
    with pytest.raises(CacheStateError, match="already suspended"):
        seq.suspend()
    with pytest.raises(CacheStateError, match="suspended"):
        seq.resize(4)
    seq.resume()
    with pytest.raises(TypeError, match="capacity_tokens"):
        seq.resize("8")  # type: ignore[arg-type]
    seq.commit([1])
    seq.stop_committing()
    seq.stop_committing()  # idempotent
    with pytest.raises(CacheStateError, match="stop_committing"):
        seq.commit([2])
    seq.close()
    fresh = m.create_kv_cache([])
    with pytest.raises(ValueError, match=">= 0"):
        fresh.resize(-1)
    fresh.close()
    m.verify()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"tiers": []}, "at least 1"),
        ({"tiers": [{"name": "device", "num_blocks": 0}]}, "num_blocks"),
        ({"tiers": [{"name": "device", "num_blocks": -3}]}, "num_blocks"),
        ({"tiers": [{"name": "", "num_blocks": 3}]}, "name"),
        (
            {"tiers": [{"name": "device", "num_blocks": 3}, {"name": "device", "num_blocks": 3}]},
            "unique",
        ),
        ({"max_partial_scan": -1}, "max_partial_scan"),
        ({"kv_layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 0}}, "head_dim"),
        (
            {"kv_layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "int8"}},
            "dtype",
        ),
        ({"block_size": 4}, "block_size"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "tokens_per_block": 4,
        "tiers": [{"name": "device", "num_blocks": 4}],
    }
    with pytest.raises(ValidationError, match=match):
        KVCacheManagerConfig(**{**base, **kwargs})


def test_good_config_and_lookups() -> None:
    cfg = KVCacheManagerConfig(
        tokens_per_block=16,
        tiers=[TierConfig(name="device", num_blocks=4), TierConfig(name="host", num_blocks=8)],
        kv_layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16"),
    )
    assert cfg.tier_index("host") == 1
    with pytest.raises(KeyError, match="no tier named"):
        cfg.tier_index("disk")
    with pytest.raises(TypeError, match="KVCacheManagerConfig"):
        KVCacheManager({"tokens_per_block": 4})  # type: ignore[arg-type]
    m, _ = manager(2, 4)
    with pytest.raises(ValueError, match=r"tier must be in \[0, 1\)"):
        m.num_available_pages(1)
    with pytest.raises(TypeError):
        m.kv_usage("device")  # type: ignore[arg-type]
