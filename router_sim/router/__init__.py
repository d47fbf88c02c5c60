"""The router: the index rebuilt from each worker's KV events, the routing policies, load, and the
:class:`Router` that combines them."""

from router_sim.router.indexer import KvIndexer, MatchDetail
from router_sim.router.routing import Router, RoutingDecision

__all__ = ["KvIndexer", "MatchDetail", "Router", "RoutingDecision"]
