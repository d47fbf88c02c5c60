"""Statistics records of the cache manager."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TierUsage:
    """Pages of one tier: ``used + free == num_blocks``; ``evictable`` of the used ones can be
    had by eviction now (so ``free + evictable`` is what an allocation can get). ``pinned``
    are held by live sequences. Byte figures are 0 without a ``KVLayout``."""

    num_blocks: int
    used: int
    free: int
    evictable: int
    pinned: int
    bytes_used: int = 0
    bytes_free: int = 0
    bytes_evictable: int = 0


@dataclass(slots=True)
class KVCacheStats:
    """Cumulative counters (since the manager was built) and current per-tier usage.

    ``queries``/``query_tokens``/``hit_tokens`` count ``create_kv_cache`` calls, their input
    tokens and the tokens they reused. ``evictions`` counts pages pushed out of a tier;
    each one either ``offloads`` (moved one tier down) or ``drops`` (removed, with its
    subtree: ``drops`` counts every block removed). ``onboards`` counts blocks copied back to
    the device tier on reuse or resume.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    drops: int = 0
    tiers: dict[str, TierUsage] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Reused tokens over queried tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
