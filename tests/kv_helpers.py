"""Small builders shared by the kvcache scenario tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache import (
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    RecordingSink,
    ReuseScope,
    SinkRecord,
    TierConfig,
)


def manager(
    tpb: int = 2, *sizes: int, partial: bool = True
) -> tuple[KVCacheManager, RecordingSink]:
    """A manager with tiers device/host/disk of the given sizes (default: one 8-page tier)."""
    names = ["device", "host", "disk"]
    tiers = [TierConfig(name=names[i], num_blocks=n) for i, n in enumerate(sizes or (8,))]
    sink = RecordingSink()
    cfg = KVCacheManagerConfig(tokens_per_block=tpb, tiers=tiers, enable_partial_reuse=partial)
    return KVCacheManager(cfg, sink), sink


def run(
    m: KVCacheManager,
    tokens: Sequence[int],
    scope: ReuseScope | None = None,
    priority: int = 35,
    stop: bool = False,
) -> KVCache:
    """A request that computes everything it did not reuse, commits it and closes."""
    seq = m.create_kv_cache(tokens, scope, priority)
    seq.commit(tokens[seq.num_reused_tokens :])
    if stop:
        seq.stop_committing()
    seq.close()
    return seq


def seen(sink: RecordingSink) -> list[tuple[object, ...]]:
    """The sink's calls as (kind, tokens of each block, tiers | (old, new))."""
    out: list[tuple[object, ...]] = []
    for r in sink.records:
        out.append(_one(r))
    return out


def _one(r: SinkRecord) -> tuple[object, ...]:
    blocks = [list(t) for t in r.tokens]
    if r.kind == "moved":
        return ("moved", blocks, r.old_tier, r.new_tier)
    if r.kind == "cleared":
        return ("cleared",)
    return (r.kind, blocks, list(r.tiers))
