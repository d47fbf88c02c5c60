"""Cache-aware cost policies: kv_overlap, predicted_ttft and the oracle.

kv_overlap follows the cost shape of NVIDIA Dynamo's KV router: for each worker,

    cost = overlap_weight x blocks to prefill + decode load in blocks

where blocks to prefill = the worker's queued prefill (pending tokens / tokens_per_block) plus
the request's blocks it does not hold (a device-tier block credited 1.0, a slower-tier block
0.75 by default: it still has to be copied back), and decode load = blocks held by decoding
requests plus the request's own blocks once it decodes. Lowest cost wins; ties go to the least
loaded. With ``temperature > 0`` the worker is sampled with softmax over costs normalized by
the largest cost.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from events.model import BlockHash
from router_sim.load import TimingModel, WorkerLoad
from router_sim.policies.base import (
    PolicyChoice,
    RouteRequest,
    RoutingError,
    candidates,
    credited_blocks,
    lowest_cost,
    softmax_sample,
)
from router_sim.timing_model import PolynomialTiming


def overlap_cost(
    request: RouteRequest, load: WorkerLoad, cached_blocks: float, overlap_weight: float
) -> float:
    """Dynamo-style cost of sending ``request`` to a worker that holds ``cached_blocks``."""
    tpb = request.tokens_per_block
    n = request.num_blocks
    prefill_blocks = load.pending_prefill_tokens / tpb + max(0.0, n - cached_blocks)
    decode_blocks = load.decode_blocks + n
    return overlap_weight * prefill_blocks + decode_blocks


def _check_credits(device_credit: float, slower_credit: float) -> None:
    if not 0.0 <= slower_credit <= device_credit <= 1.0:
        raise ValueError(
            "credits must satisfy 0 <= slower_credit <= device_credit <= 1, got "
            f"device_credit={device_credit}, slower_credit={slower_credit}"
        )


class KvOverlapPolicy:
    """Lowest Dynamo-style cost over the event-fed index (see the module docstring)."""

    name = "kv_overlap"

    def __init__(
        self,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        device_credit: float = 1.0,
        slower_credit: float = 0.75,
        seed: int = 0,
    ) -> None:
        if overlap_weight < 0 or temperature < 0:
            raise ValueError(
                f"kv_overlap needs overlap_weight >= 0 and temperature >= 0, got "
                f"{overlap_weight} and {temperature}"
            )
        _check_credits(device_credit, slower_credit)
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.device_credit = device_credit
        self.slower_credit = slower_credit
        self._rng = random.Random(seed)

    def cached(self, request: RouteRequest) -> dict[int, float]:
        """Credited cached blocks per candidate worker."""
        return {
            w: credited_blocks(request.matches.get(w), self.device_credit, self.slower_credit)
            for w in candidates(request)
        }

    def choose(self, request: RouteRequest) -> PolicyChoice:
        cached = self.cached(request)
        return choose_by_cost(self, request, cached, self.overlap_weight, self.temperature)

    def uniform(self) -> float:
        return self._rng.random()


class _Sampler(Protocol):
    def uniform(self) -> float: ...


def choose_by_cost(
    sampler: _Sampler,
    request: RouteRequest,
    cached: dict[int, float],
    overlap_weight: float,
    temperature: float,
) -> PolicyChoice:
    """Score every candidate with :func:`overlap_cost` and pick (or sample) one."""
    loads = request.loads
    costs = {w: overlap_cost(request, loads[w], cached[w], overlap_weight) for w in cached}
    if temperature > 0:
        chosen, probs = softmax_sample(costs, temperature, sampler.uniform())
        reason = f"sampled with p={probs[chosen]:.3f} at temperature {temperature}"
    else:
        chosen = lowest_cost(costs, loads)
        reason = "lowest cost"
    return PolicyChoice(chosen, reason, costs=costs, predicted_overlap=cached)


@runtime_checkable
class CacheOracle(Protocol):
    """Reads a worker's true cache state (a simulator can; a live router cannot)."""

    def true_overlap(self, worker: int, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` that ``worker`` could reuse right now."""
        ...


class OraclePolicy:
    """kv_overlap's cost on the workers' true overlap instead of the index's view: an upper
    bound of what any event-fed policy of that cost can reach."""

    name = "oracle"

    def __init__(self, oracle: CacheOracle | None = None, overlap_weight: float = 1.0) -> None:
        self.oracle = oracle
        self.overlap_weight = overlap_weight

    def choose(self, request: RouteRequest) -> PolicyChoice:
        if self.oracle is None:
            raise RoutingError(
                "the oracle policy has no CacheOracle: pass make_policy('oracle', oracle=...) "
                "or set policy.oracle before routing"
            )
        hashes = request.block_hashes
        cached = {w: float(self.oracle.true_overlap(w, hashes)) for w in candidates(request)}
        choice = choose_by_cost(self, request, cached, self.overlap_weight, 0.0)
        return PolicyChoice(choice.worker, "lowest cost on true overlap", choice.costs, cached)

    def uniform(self) -> float:
        return 0.0  # never sampled: temperature is 0


class PredictedTtftPolicy:
    """The worker with the earliest predicted first token.

    Predicted TTFT = prefill time of the worker's queued prompt tokens plus this request's
    uncached tokens in one batch (the timing model's prefill curve is convex, so a long queue
    costs more than its length alone), plus one decode iteration at the worker's KV usage
    when it is already running requests (the prefill shares iterations with them).
    """

    name = "predicted_ttft"

    def __init__(
        self,
        timing: TimingModel | None = None,
        device_credit: float = 1.0,
        slower_credit: float = 0.75,
    ) -> None:
        _check_credits(device_credit, slower_credit)
        self.timing: TimingModel = PolynomialTiming() if timing is None else timing
        self.device_credit = device_credit
        self.slower_credit = slower_credit

    def predict_ms(self, request: RouteRequest, worker: int) -> float:
        """Predicted time to first token of ``request`` on ``worker``."""
        load = request.loads[worker]
        cached = credited_blocks(
            request.matches.get(worker), self.device_credit, self.slower_credit
        )
        uncached = max(0, request.num_tokens - round(cached * request.tokens_per_block))
        ttft = self.timing.prefill_ms(load.pending_prefill_tokens + uncached)
        if load.active_requests > 0:
            ttft += self.timing.decode_ms(load.kv_usage)
        return ttft

    def choose(self, request: RouteRequest) -> PolicyChoice:
        workers = candidates(request)
        costs = {w: self.predict_ms(request, w) for w in workers}
        chosen = lowest_cost(costs, request.loads)
        overlap = {
            w: credited_blocks(request.matches.get(w), self.device_credit, self.slower_credit)
            for w in workers
        }
        reason = f"earliest predicted first token ({costs[chosen]:.1f} ms)"
        return PolicyChoice(chosen, reason, costs=costs, predicted_overlap=overlap)


__all__ = [
    "CacheOracle",
    "KvOverlapPolicy",
    "OraclePolicy",
    "PredictedTtftPolicy",
    "overlap_cost",
]
