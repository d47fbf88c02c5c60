"""Cache-aware cost policies: kv_overlap and the oracle.

kv_overlap follows the cost shape of NVIDIA Dynamo's KV router: for each worker,

    cost = overlap_weight x blocks to prefill + decode load in blocks

with three choices of this implementation, each there because the simulator showed locality
given up without it:

- blocks to prefill = the worker's queued prefill (pending tokens / tokens_per_block) plus the
  request's blocks the worker does not hold, those counted ``1 + recompute_weight`` times.
  Queued blocks are computed whichever worker is chosen; uncached blocks are new work that
  this choice adds: the request waits for them once, and the worker's capacity pays for them
  once more (whatever is routed there next waits for them too). Counted once, as in a pure
  wait estimate, a worker holding the whole prompt loses to an idle one as soon as its queue
  is as long as the prompt, which happens within every burst of arrivals: the recomputation
  is then paid by the whole fleet. ``recompute_weight=0`` gives the plain Dynamo form.
  (A device-tier block is credited 1.0, a slower-tier block 0.75 by default: it still has
  to be copied back.)
- decode load = blocks held by decoding requests plus the request's own blocks once it
  decodes. ``overlap_weight`` converts between the two units; see
  :data:`DEFAULT_OVERLAP_WEIGHT` for why its default is not Dynamo's 1.
- lowest cost wins; ties go to the least loaded, then to the tied worker that the request's
  content ranks first (:func:`~router_sim.router.policies.base.tie_rank`: not the lowest worker id,
  which would pile every tie on one worker, and not a draw from the router's own RNG, which
  would make two replicas break the same tie differently). With ``temperature > 0`` the
  worker is sampled with softmax over costs normalized by the largest cost, from the
  policy's seeded RNG (so replicas then agree only on the costs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Final, Protocol, runtime_checkable

from events.wire.model import BlockHash
from router_sim.router.load import WorkerLoad
from router_sim.router.policies.base import (
    BoundedLoad,
    PolicyChoice,
    RouteRequest,
    RoutingError,
    candidates,
    credited_blocks,
    lowest_cost,
    softmax_sample,
    tie_rank,
)
from router_sim.router.policies.kernels import overlap_costs

DEFAULT_OVERLAP_WEIGHT: Final = 16.0
"""Decode blocks one prefill block is worth, by default.

The two terms are in different units. A prefill block is compute done once: with the default
timing model ~20 us per token in a full 8192-token step, ~10.6 ms for a 512-token block. A
decode block is memory read once per decode step while its request decodes: the model's
decode iteration grows by 54 ms per unit of KV usage, so one block of a 65536-block device
tier adds ~0.0008 ms per step, ~0.3 ms over a 343-token answer (the Mooncake trace's mean),
and one block of a 4096-block tier ~4.5 ms. The exchange rate is thus ~2 to ~40 decode blocks
per prefill block depending on the tier's size; 16 sits in that range. Weighted 1:1
(Dynamo's default, meant for small blocks on memory-bound workers), a worker with two answers
in progress looks as costly as recomputing a whole prompt. On the first 3000 Mooncake
requests (8 workers, 512-token blocks) weights 8, 16 and 32 reach 96.7, 97.0 and 97.1 % of
the compulsory-miss bound with 65536-block tiers, and 4, 16 and 64 reach 92.7, 93.5 and
93.0 % with 4096-block tiers; weight 1 reaches 92.2 %.
"""

DEFAULT_BALANCE: Final[float | None] = 0.1
"""Default ``balance`` (epsilon of :class:`~router_sim.router.policies.base.BoundedLoad`). On the
whole
conversation trace it costs no hit rate where it matters: at 32 workers kv_overlap goes from
36.7 % hit and a busiest worker sent 1.87x the mean request count to 37.0 % and 1.01x, at 128
workers from 36.7 % and 7.87x to 37.0 % and 1.04x; at 8 workers 36.0 % -> 35.9 %, 1.04x ->
1.00x. Its state is the
router's own decision history, so router replicas that each see part of the traffic cannot
share it: ``router-sim serve`` turns it off unless asked (see
:func:`~router_sim.router.policies.without_history`); ``None`` turns it off here."""

DEFAULT_RECOMPUTE_WEIGHT: Final = 1.0
"""Extra weight of a request's uncached blocks over queued ones (see the module docstring)."""


def overlap_cost(
    request: RouteRequest,
    load: WorkerLoad,
    cached_blocks: float,
    overlap_weight: float,
    recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
) -> float:
    """Dynamo-style cost of sending ``request`` to a worker that holds ``cached_blocks``."""
    tpb = request.tokens_per_block
    n = request.num_blocks
    uncached = max(0.0, n - cached_blocks)
    prefill_blocks = load.pending_prefill_tokens / tpb + (1.0 + recompute_weight) * uncached
    decode_blocks = load.decode_blocks + n
    return overlap_weight * prefill_blocks + decode_blocks


def check_credits(device_credit: float, slower_credit: float) -> None:
    """Raise ``ValueError`` unless 0 <= slower_credit <= device_credit <= 1."""
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
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        temperature: float = 0.0,
        device_credit: float = 1.0,
        slower_credit: float = 0.75,
        seed: int = 0,
        recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
        balance: float | None = DEFAULT_BALANCE,
    ) -> None:
        if overlap_weight < 0 or temperature < 0 or recompute_weight < 0:
            raise ValueError(
                "kv_overlap needs overlap_weight, temperature and recompute_weight >= 0, got "
                f"{overlap_weight}, {temperature} and {recompute_weight}"
            )
        check_credits(device_credit, slower_credit)
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.device_credit = device_credit
        self.slower_credit = slower_credit
        self.recompute_weight = recompute_weight
        self.bounded = BoundedLoad(balance)
        self.seed = seed
        self._rng = random.Random(seed)

    def cached(self, request: RouteRequest) -> dict[int, float]:
        """Credited cached blocks per candidate worker (those under the balance cap)."""
        return {
            w: credited_blocks(request.matches.get(w), self.device_credit, self.slower_credit)
            for w in self.bounded.eligible(candidates(request))
        }

    def choose(self, request: RouteRequest) -> PolicyChoice:
        if self.temperature > 0:
            return self._sample(request)
        # One pass per candidate: the credited blocks, overlap_cost's terms in its order (the
        # same floats) and the balance price; choose_by_cost's lowest_cost then decides.
        bounded = self.bounded
        # balance: one request beyond the mean costs as much as one block to prefill
        eligible, counts, mean = bounded.eligible_counts(candidates(request))
        loads = request.loads
        costs, cached = overlap_costs(
            eligible,
            counts,
            mean,
            request.matches,
            loads,
            self.device_credit,
            self.slower_credit,
            self.overlap_weight,
            1.0 + self.recompute_weight,
            request.tokens_per_block,
            request.num_blocks,
        )
        seed = self.seed
        chosen = lowest_cost(
            costs, loads, None, bounded.prefer(), rank_of=lambda: tie_rank(request.tie_key(seed))
        )
        bounded.record(chosen)
        return PolicyChoice(chosen, "lowest cost", costs=costs, predicted_overlap=cached)

    def _sample(self, request: RouteRequest) -> PolicyChoice:
        """:meth:`choose` at ``temperature > 0``: a softmax draw over the costs."""
        cached = self.cached(request)
        excess = self.bounded.excess(list(cached))
        choice = choose_by_cost(
            self.seed,
            request,
            cached,
            self.overlap_weight,
            self.temperature,
            self.recompute_weight,
            prefer=self.bounded.prefer(),
            extra={w: self.overlap_weight * x for w, x in excess.items() if x > 0},
            uniform=self._rng.random,
        )
        self.bounded.record(choice.worker)
        return choice

    def forget_worker(self, worker: int) -> None:
        self.bounded.forget(worker)


def choose_by_cost(
    seed: int,
    request: RouteRequest,
    cached: dict[int, float],
    overlap_weight: float,
    temperature: float,
    recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
    prefer: Callable[[int], int] | None = None,
    extra: dict[int, float] | None = None,
    uniform: Callable[[], float] | None = None,
) -> PolicyChoice:
    """Score every candidate with :func:`overlap_cost` (plus ``extra``, per worker) and pick
    the cheapest (ties broken by load, then ``prefer``, then :func:`tie_rank` of the request
    and ``seed``), or, at ``temperature > 0``, sample one with ``uniform()``'s draws."""
    loads = request.loads
    costs = {
        w: overlap_cost(request, loads[w], cached[w], overlap_weight, recompute_weight)
        for w in cached
    }
    for w, x in (extra or {}).items():
        costs[w] += x
    if temperature > 0:
        if uniform is None:
            raise ValueError("sampling at temperature > 0 needs a uniform() draw")
        chosen, probs = softmax_sample(costs, temperature, uniform())
        reason = f"sampled with p={probs[chosen]:.3f} at temperature {temperature}"
    else:
        chosen = lowest_cost(
            costs, loads, None, prefer, rank_of=lambda: tie_rank(request.tie_key(seed))
        )
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
    reads_index = False
    """Reads the workers' true caches: a simulation may leave the event stream out."""

    def __init__(
        self,
        oracle: CacheOracle | None = None,
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
        seed: int = 0,
        balance: float | None = DEFAULT_BALANCE,
    ) -> None:
        self.oracle = oracle
        self.overlap_weight = overlap_weight
        self.recompute_weight = recompute_weight
        self.bounded = BoundedLoad(balance)  # as kv_overlap's, so the two stay comparable
        self.seed = seed  # for ties only (temperature is 0)

    def choose(self, request: RouteRequest) -> PolicyChoice:
        if self.oracle is None:
            raise RoutingError(
                "the oracle policy has no CacheOracle: pass make_policy('oracle', oracle=...) "
                "or set policy.oracle before routing"
            )
        hashes = request.block_hashes
        cached = {
            w: float(self.oracle.true_overlap(w, hashes))
            for w in self.bounded.eligible(candidates(request))
        }
        excess = self.bounded.excess(list(cached))
        choice = choose_by_cost(
            self.seed,
            request,
            cached,
            self.overlap_weight,
            0.0,
            self.recompute_weight,
            prefer=self.bounded.prefer(),
            extra={w: self.overlap_weight * x for w, x in excess.items() if x > 0},
        )
        self.bounded.record(choice.worker)
        return PolicyChoice(choice.worker, "lowest cost on true overlap", choice.costs, cached)

    def forget_worker(self, worker: int) -> None:
        self.bounded.forget(worker)


__all__ = [
    "CacheOracle",
    "KvOverlapPolicy",
    "OraclePolicy",
    "overlap_cost",
]
