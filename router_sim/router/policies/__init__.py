"""Routing policies behind one protocol, built by name with :func:`make_policy`."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any, Final

from router_sim.router.policies.approximate import ApproximatePolicy
from router_sim.router.policies.base import (
    NoWorkersError,
    PolicyChoice,
    RouteRequest,
    RoutingError,
    RoutingPolicy,
)
from router_sim.router.policies.cache_aware import CacheAwarePolicy
from router_sim.router.policies.overlap import (
    DEFAULT_OVERLAP_WEIGHT,
    DEFAULT_RECOMPUTE_WEIGHT,
    CacheOracle,
    KvOverlapPolicy,
    OraclePolicy,
    overlap_cost,
)
from router_sim.router.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from router_sim.router.policies.ttft import PredictedTtftPolicy

POLICIES: Final[dict[str, Callable[..., RoutingPolicy]]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_loaded": LeastLoadedPolicy,
    "kv_overlap": KvOverlapPolicy,
    "cache_aware": CacheAwarePolicy,
    "approximate": ApproximatePolicy,
    "predicted_ttft": PredictedTtftPolicy,
    "oracle": OraclePolicy,
}

#: policies that need no KV events: they declare ``reads_index = False`` (a simulation of
#: one may leave the event stream out, see ``SimConfig.events``)
EVENT_FREE: Final = frozenset(
    name for name, factory in POLICIES.items() if not getattr(factory, "reads_index", True)
)


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """Build the policy called ``name`` with its keyword options.

    Raises ``ValueError`` for an unknown name and ``TypeError`` for an option the policy
    does not take (the message names both).
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    unknown = _unknown_options(factory, options)
    if unknown:
        raise TypeError(unknown_options_message(name, factory, unknown))
    try:
        return factory(**options)
    except TypeError as exc:
        raise TypeError(f"bad options {sorted(options)} for policy {name!r}: {exc}") from exc


def _options_of(factory: Any) -> list[str] | None:
    """The keyword options ``factory`` takes (None: it takes any)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds]


def _unknown_options(factory: Any, options: dict[str, Any]) -> list[str]:
    known = _options_of(factory)
    return [] if known is None else sorted(set(options) - set(known))


def unknown_options_message(name: str, factory: Any, unknown: list[str]) -> str:
    """Which options ``name`` does not take, the nearest it does, and all it takes."""
    known = _options_of(factory) or []
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(key, known, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (
        f"policy {name!r} has no option {', '.join(parts)}; its options: "
        f"{', '.join(known) or 'none'}"
    )


def without_history(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``balance`` turned off where the policy takes it and ``options`` does
    not set it: the options of a router replica. Balance counts the decisions this router
    made; replicas behind a load balancer each see part of the traffic, so their counts, and
    from then on their decisions, would differ (``router-sim serve`` uses this)."""
    factory = POLICIES.get(name)
    if factory is None or "balance" in options:
        return dict(options)
    if "balance" not in inspect.signature(factory).parameters:
        return dict(options)
    return {**options, "balance": None}


__all__ = [
    "DEFAULT_OVERLAP_WEIGHT",
    "DEFAULT_RECOMPUTE_WEIGHT",
    "EVENT_FREE",
    "POLICIES",
    "ApproximatePolicy",
    "CacheAwarePolicy",
    "CacheOracle",
    "KvOverlapPolicy",
    "LeastLoadedPolicy",
    "NoWorkersError",
    "OraclePolicy",
    "PolicyChoice",
    "PredictedTtftPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingError",
    "RoutingPolicy",
    "make_policy",
    "overlap_cost",
    "without_history",
]
