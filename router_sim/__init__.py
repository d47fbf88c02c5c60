"""router_sim: a KV-aware router rebuilt from KV events, routing policies and a simulator."""

from router_sim.router.indexer import KvIndexer, MatchDetail
from router_sim.router.load import LoadSource, StaticLoadSource, TimingModel, WorkerLoad
from router_sim.router.policies import RoutingPolicy, make_policy
from router_sim.router.routing import Router, RoutingDecision
from router_sim.sim.timing_model import PolynomialTiming

__all__ = [
    "KvIndexer",
    "LoadSource",
    "MatchDetail",
    "PolynomialTiming",
    "Router",
    "RoutingDecision",
    "RoutingPolicy",
    "StaticLoadSource",
    "TimingModel",
    "WorkerLoad",
    "make_policy",
]
