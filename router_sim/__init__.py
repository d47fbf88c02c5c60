"""router_sim: a KV-aware router rebuilt from KV events, routing policies and a simulator."""

from router_sim.indexer import KvIndexer, MatchDetail
from router_sim.load import LoadSource, StaticLoadSource, TimingModel, WorkerLoad
from router_sim.policies import RoutingPolicy, make_policy
from router_sim.router import Router, RoutingDecision
from router_sim.timing_model import PolynomialTiming

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
