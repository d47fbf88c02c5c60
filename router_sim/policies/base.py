"""What every routing policy sees and returns, and the helpers they share.

A policy is a small object with a ``choose(request) -> PolicyChoice`` method. The router
builds the :class:`RouteRequest` (the request's block hashes, what the index says each worker
holds, each candidate's load, and the current time, injected) and the policy picks one of the
candidate workers. Policies read no clock and no global random state: time comes in the
request and randomness from a ``random.Random(seed)`` of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from events.model import BlockHash
from router_sim.indexer import MatchDetail
from router_sim.load import WorkerLoad


class RoutingError(RuntimeError):
    """A routing decision could not be made."""


class NoWorkersError(RoutingError):
    """The load source offered no worker to route to."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as a policy sees it.

    ``block_hashes``: the hashes of the request's full blocks, first block first.
    ``num_tokens``: prompt length (the last partial block is not in ``block_hashes``).
    ``matches``: per worker what the event-fed index says it holds of the chain (absent: none).
    ``loads``: the candidate workers and their load. ``now_ms``: the injected current time.
    """

    block_hashes: Sequence[BlockHash]
    num_tokens: int
    tokens_per_block: int
    matches: Mapping[int, MatchDetail]
    loads: Mapping[int, WorkerLoad]
    now_ms: float = 0.0

    @property
    def num_blocks(self) -> int:
        """Blocks the prompt occupies, a trailing partial block included."""
        return -(-self.num_tokens // self.tokens_per_block)


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    """A policy's pick and why: ``costs`` (lower is better; empty when the policy does not
    score workers) and ``predicted_overlap`` (the cached blocks the policy credited each
    worker with, from whatever source it trusts)."""

    worker: int
    reason: str
    costs: dict[int, float] = field(default_factory=dict)
    predicted_overlap: dict[int, float] = field(default_factory=dict)


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses a worker for a request."""

    name: str

    def choose(self, request: RouteRequest) -> PolicyChoice:
        """Pick one of ``request.loads``' workers. Raises :class:`NoWorkersError` if empty."""
        ...


def load_key(worker: int, load: WorkerLoad) -> tuple[int, int, int, int]:
    """Sort key of 'least loaded first', ties broken by worker id for determinism."""
    return (load.active_requests, load.pending_prefill_tokens, load.decode_blocks, worker)


def candidates(request: RouteRequest) -> list[int]:
    """The request's candidate workers in a stable order; raises if there are none."""
    if not request.loads:
        raise NoWorkersError("no worker to route to: the load source offered an empty list")
    return sorted(request.loads)


def credited_blocks(
    detail: MatchDetail | None, device_credit: float, slower_credit: float
) -> float:
    """Cached blocks of the chain, a slower-tier block counting as partly cached."""
    if detail is None:
        return 0.0
    return detail.device_blocks * device_credit + detail.slower_blocks * slower_credit


def load_rank(load: WorkerLoad) -> tuple[int, int, int]:
    """Sort key of 'least loaded first' without a worker id: equal keys are true ties."""
    return (load.active_requests, load.pending_prefill_tokens, load.decode_blocks)


def lowest_cost(
    costs: Mapping[int, float],
    loads: Mapping[int, WorkerLoad],
    draw: Callable[[], float] | None = None,
    prefer: Callable[[int], int] | None = None,
) -> int:
    """The worker of lowest cost; equal costs go to the least loaded, and workers still tied
    are picked with ``draw()`` (a uniform draw in [0, 1) from the caller's seeded RNG, made
    only when there is a tie). With ``prefer``, the tied workers of lowest ``prefer(worker)``
    are kept before the draw.

    Without ``draw`` a tie goes to the lowest worker id, which piles every tied decision
    on one worker: with spread-out arrivals most workers are idle and equally cheap when a
    request without cached blocks arrives, so a fixed order sends them all to worker 0.
    """
    best = min(costs.values())
    tied = [w for w, c in costs.items() if math.isclose(c, best, rel_tol=1e-12, abs_tol=1e-9)]
    lightest = min(load_rank(loads[w]) for w in tied)
    tied = sorted(w for w in tied if load_rank(loads[w]) == lightest)
    if prefer is not None and len(tied) > 1:
        first = min(prefer(w) for w in tied)
        tied = [w for w in tied if prefer(w) == first]
    if draw is None or len(tied) == 1:
        return tied[0]
    return tied[min(len(tied) - 1, int(draw() * len(tied)))]


class BoundedLoad:
    """Keeps each worker's share of the decisions within ``1 + epsilon`` of the fleet's mean.

    Two parts. A hard cap, consistent hashing with bounded loads (Mirrokni, Thorup and
    Zadimoghaddam, SODA 2018) applied to cache affinity: a worker may take the next request
    only while the requests it was sent stay under ``ceil((1 + epsilon) * (sent to the fleet
    + 1) / workers) + slack`` (the slack, a few requests, keeps a small fleet's first
    decisions with the cache: without it the second request sharing a prefix could not follow
    the first). And a soft price, :meth:`excess`: the requests a worker was sent beyond
    the mean, which the policy adds to its cost in its own units. The price moves the requests
    that gain little from a busy worker's cache first (a new conversation sharing only a
    system prompt, which then gets a second home for the price of one recomputation), while a
    long conversation whose history the worker holds outweighs it and stays; the cap alone
    would displace whichever request comes next, long histories included. Counts are the
    policy's own decisions (a live router knows what it sent); ``None`` turns both off.
    """

    def __init__(self, epsilon: float | None, slack: int = 2) -> None:
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"balance (epsilon) must be > 0 or None, got {epsilon}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.epsilon = epsilon
        self.slack = slack
        self.sent: dict[int, int] = {}

    def eligible(self, workers: Sequence[int]) -> list[int]:
        """The workers under the cap (never empty: the least-sent worker is below the mean)."""
        if self.epsilon is None or not workers:
            return list(workers)
        sent = self.sent
        total = sum(sent.get(w, 0) for w in workers)
        cap = math.ceil((1.0 + self.epsilon) * (total + 1) / len(workers)) + self.slack
        return [w for w in workers if sent.get(w, 0) < cap] or list(workers)

    def excess(self, workers: Sequence[int]) -> dict[int, float]:
        """Requests each worker was sent beyond the mean over ``workers`` (0 when below)."""
        if self.epsilon is None or not workers:
            return dict.fromkeys(workers, 0.0)
        sent = self.sent
        mean = sum(sent.get(w, 0) for w in workers) / len(workers)
        return {w: max(0.0, sent.get(w, 0) - mean) for w in workers}

    def prefer(self) -> Callable[[int], int] | None:
        """Tie-break for :func:`lowest_cost`: the worker sent the fewest requests (a request
        no worker holds anything of can go anywhere: send it where it evens the counts)."""
        if self.epsilon is None:
            return None
        sent = self.sent
        return lambda w: sent.get(w, 0)

    def record(self, worker: int) -> None:
        """Count a decision for ``worker``."""
        self.sent[worker] = self.sent.get(worker, 0) + 1

    def forget(self, worker: int) -> None:
        """``worker`` left the fleet: its count goes with it."""
        self.sent.pop(worker, None)


def softmax_sample(
    costs: Mapping[int, float], temperature: float, uniform: float
) -> tuple[int, dict[int, float]]:
    """Sample a worker with probability proportional to exp(-normalized cost / temperature).

    Costs are normalized by the largest one so that ``temperature`` means the same thing for
    short and long prompts. ``uniform`` is one draw in [0, 1) from the caller's seeded RNG.
    Returns the worker and the probabilities (for explanations and tests).
    """
    workers = sorted(costs)
    top = max(abs(c) for c in costs.values()) or 1.0
    logits = [-costs[w] / top / temperature for w in workers]
    shift = max(logits)
    weights = [math.exp(x - shift) for x in logits]
    total = sum(weights)
    probs = {w: wt / total for w, wt in zip(workers, weights, strict=True)}
    acc = 0.0
    for w in workers:
        acc += probs[w]
        if uniform < acc:
            return w, probs
    return workers[-1], probs
