"""Routing without events: predict each worker's cache from this router's own decisions.

After routing a request to worker w the policy assumes w now holds the request's blocks for
``ttl_ms`` of injected time (refreshed on each reuse) and at most ``max_blocks_per_worker``
of them (least recently routed forgotten first). The predicted overlap then feeds the same
cost as kv_overlap. It is what a router does when workers publish no events; its predictions
go stale when workers evict sooner than the TTL or other routers send them traffic.
"""

from __future__ import annotations

from collections import OrderedDict

from events.wire.model import BlockHash
from router_sim.router.policies.base import PolicyChoice, RouteRequest, candidates
from router_sim.router.policies.overlap import (
    DEFAULT_OVERLAP_WEIGHT,
    DEFAULT_RECOMPUTE_WEIGHT,
    choose_by_cost,
)


class ApproximatePolicy:
    """kv_overlap's cost over a per-worker TTL + size-capped record of routed blocks."""

    name = "approximate"
    reads_index = False
    """Predicts from its own decisions: a simulation may leave the event stream out."""

    def __init__(
        self,
        ttl_ms: float = 120_000.0,
        max_blocks_per_worker: int = 100_000,
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
        seed: int = 0,
    ) -> None:
        if ttl_ms <= 0 or max_blocks_per_worker <= 0:
            raise ValueError(
                f"approximate needs ttl_ms > 0 and max_blocks_per_worker > 0, got {ttl_ms} and "
                f"{max_blocks_per_worker}"
            )
        self.ttl_ms = ttl_ms
        self.max_blocks_per_worker = max_blocks_per_worker
        self.overlap_weight = overlap_weight
        self.recompute_weight = recompute_weight
        self.seed = seed  # for ties only (temperature is 0)
        # worker -> block hash -> expiry time; ordered by last refresh, hence by expiry
        # (the TTL is fixed and injected time does not go backwards).
        self._seen: dict[int, OrderedDict[BlockHash, float]] = {}

    def _expire(self, worker: int, now_ms: float) -> OrderedDict[BlockHash, float]:
        seen = self._seen.setdefault(worker, OrderedDict())
        while seen:
            h, expiry = next(iter(seen.items()))
            if expiry > now_ms:
                break
            del seen[h]
        return seen

    def predicted_overlap(self, worker: int, request: RouteRequest) -> int:
        """Leading request blocks this policy believes ``worker`` holds at ``request.now_ms``."""
        seen = self._expire(worker, request.now_ms)
        n = 0
        for h in request.block_hashes:
            if h not in seen:
                break
            n += 1
        return n

    def remembered(self, worker: int) -> int:
        """Blocks currently remembered for ``worker`` (expired ones may linger until read)."""
        return len(self._seen.get(worker, ()))

    def record(self, worker: int, block_hashes: list[BlockHash], now_ms: float) -> None:
        """Remember that ``worker`` was sent these blocks at ``now_ms``."""
        seen = self._expire(worker, now_ms)
        expiry = now_ms + self.ttl_ms
        for h in block_hashes:
            seen[h] = expiry
            seen.move_to_end(h)
        while len(seen) > self.max_blocks_per_worker:
            seen.popitem(last=False)

    def forget_worker(self, worker: int) -> None:
        """Drop everything remembered about ``worker`` (it restarted or left)."""
        self._seen.pop(worker, None)

    def choose(self, request: RouteRequest) -> PolicyChoice:
        cached = {w: float(self.predicted_overlap(w, request)) for w in candidates(request)}
        choice = choose_by_cost(
            self.seed, request, cached, self.overlap_weight, 0.0, self.recompute_weight
        )
        self.record(choice.worker, list(request.block_hashes), request.now_ms)
        return PolicyChoice(choice.worker, "lowest cost on predicted overlap", choice.costs, cached)
