"""Cache-blind baselines: round robin, seeded random, and least loaded."""

from __future__ import annotations

import random
from typing import Final

from router_sim.router.policies.base import PolicyChoice, RouteRequest, candidates, load_key

LOAD_METRICS: Final = ("active_requests", "pending_prefill_tokens")


class RoundRobinPolicy:
    """Each request to the next worker id after the previous choice (cyclic), so workers
    joining or leaving do not reset the rotation."""

    name = "round_robin"
    reads_loads = False
    """Picks by worker id alone: the router need not read any load for it."""
    reads_index = False
    """Never reads the router's index: a simulation may leave the event stream out."""

    def __init__(self) -> None:
        self._last: int | None = None

    def choose(self, request: RouteRequest) -> PolicyChoice:
        workers = candidates(request)
        after = [w for w in workers if self._last is None or w > self._last]
        chosen = after[0] if after else workers[0]
        self._last = chosen
        return PolicyChoice(chosen, "next in rotation")


class RandomPolicy:
    """Uniformly random worker from a seeded generator."""

    name = "random"
    reads_loads = False
    """Picks by worker id alone: the router need not read any load for it."""
    reads_index = False
    """Never reads the router's index: a simulation may leave the event stream out."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest) -> PolicyChoice:
        return PolicyChoice(self._rng.choice(candidates(request)), "uniform random")


class LeastLoadedPolicy:
    """The worker with the fewest active requests (or pending prefill tokens); ties go to
    the other metric, then the lowest worker id."""

    name = "least_loaded"
    reads_index = False
    """Never reads the router's index: a simulation may leave the event stream out."""

    def __init__(self, metric: str = "active_requests") -> None:
        if metric not in LOAD_METRICS:
            raise ValueError(f"least_loaded metric must be one of {LOAD_METRICS}, got {metric!r}")
        self.metric = metric

    def choose(self, request: RouteRequest) -> PolicyChoice:
        workers = candidates(request)
        loads = request.loads
        if self.metric == "active_requests":
            chosen = min(workers, key=lambda w: load_key(w, loads[w]))
        else:
            chosen = min(
                workers,
                key=lambda w: (loads[w].pending_prefill_tokens, loads[w].active_requests, w),
            )
        costs = {w: float(getattr(loads[w], self.metric)) for w in workers}
        return PolicyChoice(chosen, f"lowest {self.metric}", costs=costs)
