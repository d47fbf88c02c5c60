"""SGLang-style cache-aware routing: prefix match unless the fleet is out of balance.

The exact rule, with ``load`` = active requests of each candidate:

1. The fleet is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` AND
   ``max_load > balance_rel_threshold * min_load``. Then the request goes to the least loaded
   worker (ties: more cached blocks, then lower id). Balance wins over locality.
2. Otherwise take the worker with the most cached blocks of the request (slower-tier blocks
   credited ``slower_credit``; ties: least loaded). If its match ratio (cached blocks /
   request blocks) is at least ``cache_threshold``, the request goes there.
3. Otherwise no worker holds enough to matter: the request goes to the worker with the most
   free cache room (lowest ``kv_usage``; ties: least loaded), which is where SGLang's router
   sends it too (its smallest tree), so new prefixes spread over the fleet.

Default thresholds are SGLang router's defaults (cache_threshold 0.3, balance_abs_threshold
64, balance_rel_threshold 1.5).
"""

from __future__ import annotations

from router_sim.router.policies.base import (
    PolicyChoice,
    RouteRequest,
    candidates,
    credited_blocks,
    load_key,
)


class CacheAwarePolicy:
    """Prefix match with a load-balance override (the rule is in the module docstring)."""

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        slower_credit: float = 0.75,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError(
                "cache_aware needs balance_abs_threshold >= 0 and balance_rel_threshold >= 1, "
                f"got {balance_abs_threshold} and {balance_rel_threshold}"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.slower_credit = slower_credit

    def imbalanced(self, request: RouteRequest) -> bool:
        """Rule 1's test on the candidates' active requests."""
        active = [load.active_requests for load in request.loads.values()]
        hi, lo = max(active), min(active)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, request: RouteRequest) -> PolicyChoice:
        workers = candidates(request)
        loads = request.loads
        cached = {
            w: credited_blocks(request.matches.get(w), 1.0, self.slower_credit) for w in workers
        }
        if self.imbalanced(request):
            chosen = min(
                workers, key=lambda w: (loads[w].active_requests, -cached[w], load_key(w, loads[w]))
            )
            return PolicyChoice(chosen, "imbalanced: least loaded", predicted_overlap=cached)
        best = min(workers, key=lambda w: (-cached[w], load_key(w, loads[w])))
        ratio = cached[best] / request.num_blocks if request.num_blocks else 0.0
        if ratio >= self.cache_threshold and cached[best] > 0:
            reason = f"best prefix match (ratio {ratio:.2f} >= {self.cache_threshold})"
            return PolicyChoice(best, reason, predicted_overlap=cached)
        chosen = min(workers, key=lambda w: (loads[w].kv_usage, load_key(w, loads[w])))
        reason = f"match ratio {ratio:.2f} < {self.cache_threshold}: most free cache"
        return PolicyChoice(chosen, reason, predicted_overlap=cached)
