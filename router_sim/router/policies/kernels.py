"""The per-decision loops of the cost policies, in a module the simulator's build compiles.

The policy classes stay plain Python (users subclass them, and options are read off their
constructors' signatures); what they run for every candidate of every decision lives here:
:func:`overlap_costs` (kv_overlap), :func:`ttft_costs` (predicted_ttft), :func:`lowest_cost`
(their pick) and :class:`BoundedLoad` (their balance). Each computes the same floats, in the
same order, as the formulas in the policies' docstrings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from router_sim.router.indexer import MatchDetail
from router_sim.router.load import TimingModel, WorkerLoad


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
    rank: Callable[[int], int] | None = None,
    prefer: Callable[[int], int] | None = None,
    *,
    rank_of: Callable[[], Callable[[int], int]] | None = None,
) -> int:
    """The worker of lowest cost; equal costs go to the least loaded, and workers still tied
    to the lowest ``rank(worker)`` (:func:`~router_sim.router.policies.base.tie_rank` of the
    request: the same pick on every replica). With ``prefer``, the tied workers of lowest
    ``prefer(worker)`` are kept before the rank decides.

    Without ``rank`` a tie goes to the lowest worker id, which piles every tied decision
    on one worker: with spread-out arrivals most workers are idle and equally cheap when a
    request without cached blocks arrives, so a fixed order sends them all to worker 0.
    ``rank_of`` (instead of ``rank``) makes the rank only when workers are still tied: most
    decisions have one cheapest worker, and a request's rank costs two hashes to make.
    """
    best = min(costs.values())
    isclose = math.isclose
    tied = [w for w, c in costs.items() if isclose(c, best, rel_tol=1e-12, abs_tol=1e-9)]
    if len(tied) == 1:
        return tied[0]
    lightest = min(load_rank(loads[w]) for w in tied)
    tied = sorted(w for w in tied if load_rank(loads[w]) == lightest)
    if prefer is not None and len(tied) > 1:
        first = min(prefer(w) for w in tied)
        tied = [w for w in tied if prefer(w) == first]
    if len(tied) == 1:
        return tied[0]
    if rank is None and rank_of is not None:
        rank = rank_of()
    if rank is None:
        return tied[0]
    order = rank
    return min(tied, key=lambda w: (order(w), w))


def overlap_costs(
    workers: list[int],
    counts: list[int],
    mean: float | None,
    matches: Mapping[int, MatchDetail],
    loads: Mapping[int, WorkerLoad],
    device_credit: float,
    slower_credit: float,
    weight: float,
    recompute: float,
    tpb: int,
    n: int,
) -> tuple[dict[int, float], dict[int, float]]:
    """kv_overlap's (cost, credited cached blocks) per worker: ``weight`` x (queued prefill
    blocks + ``recompute`` x uncached blocks) + decode blocks + the request's ``n`` blocks,
    plus ``weight`` x the requests the worker was sent beyond ``mean`` (``counts``, the
    balance's price; ``mean`` None: off)."""
    none_cached = recompute * max(0.0, n - 0.0)  # the term of a worker holding nothing
    cached: dict[int, float] = {}
    costs: dict[int, float] = {}
    for i, w in enumerate(workers):
        detail = matches.get(w)
        c = cached[w] = credited_blocks(detail, device_credit, slower_credit)
        uncached = none_cached if detail is None else recompute * max(0.0, n - c)
        load = loads[w]
        cost = weight * (load.pending_prefill_tokens / tpb + uncached) + (load.decode_blocks + n)
        if mean is not None:  # the balance's price: BoundedLoad.excess, when above 0
            x = counts[i] - mean
            if x > 0:
                cost += weight * x
        costs[w] = cost
    return costs, cached


def chunked_prefill_ms(timing: TimingModel, chunk: int, tokens: int, chunk_ms: float) -> float:
    """Compute time of ``tokens`` prompt tokens run in steps of ``chunk`` tokens, one full
    step taking ``chunk_ms``."""
    if tokens <= 0:
        return 0.0
    full, rest = divmod(tokens, chunk)
    return full * chunk_ms + timing.prefill_ms(rest)


def ttft_costs(
    workers: list[int],
    matches: Mapping[int, MatchDetail],
    loads: Mapping[int, WorkerLoad],
    num_tokens: int,
    tpb: int,
    device_credit: float,
    slower_credit: float,
    recompute: float,
    timing: TimingModel,
    chunk: int,
    counts: list[int] | None = None,
    mean: float | None = None,
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """predicted_ttft's (cost, predicted TTFT, credited cached blocks) per worker: the queued
    and uncached prompt tokens in chunks, each step with one decode iteration when requests
    are decoding there, plus ``recompute`` x the uncached tokens' chunked prefill time. The
    step time of a full chunk is computed once per decision and each chunked prefill time
    once per token count (most candidates hold nothing of the prompt and many queue
    nothing: they share their counts). With ``counts`` (requests each worker was sent) and
    their ``mean``, the balance's price is added to each cost: one request beyond the mean
    costs the compute time of one more block."""
    chunk_ms = timing.prefill_ms(chunk)
    # BoundedLoad.excess over the workers, from the counts it read
    excess: list[float] = []  # empty: no worker pays a price
    block_ms = 0.0
    if counts is not None and mean is not None:
        over = [max(0.0, c - mean) for c in counts]
        if any(over):
            excess = over
            block_ms = chunked_prefill_ms(timing, chunk, 2 * tpb, chunk_ms) - chunked_prefill_ms(
                timing, chunk, tpb, chunk_ms
            )
    chunked: dict[int, float] = {0: 0.0}  # tokens -> chunked_prefill_ms(tokens)
    costs: dict[int, float] = {}
    predicted: dict[int, float] = {}
    overlap: dict[int, float] = {}
    for i, w in enumerate(workers):
        cached = credited_blocks(matches.get(w), device_credit, slower_credit)
        uncached = num_tokens - round(cached * tpb)
        if uncached < 0:
            uncached = 0
        load = loads[w]
        queue = load.pending_prefill_tokens + uncached
        ms = chunked.get(queue)
        if ms is None:
            ms = chunked[queue] = chunked_prefill_ms(timing, chunk, queue, chunk_ms)
        if load.decode_blocks > 0 and queue > 0:
            ms += -(-queue // chunk) * timing.decode_ms(load.kv_usage)
        own = chunked.get(uncached)
        if own is None:
            own = chunked[uncached] = chunked_prefill_ms(timing, chunk, uncached, chunk_ms)
        cost = ms + recompute * own
        if excess:
            cost += block_ms * excess[i]
        costs[w] = cost
        predicted[w] = ms
        overlap[w] = cached
    return costs, predicted, overlap


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

    def eligible_counts(self, workers: Sequence[int]) -> tuple[list[int], list[int], float | None]:
        """:meth:`eligible`, each one's count and the mean count over them (None when the
        balance is off): what :meth:`excess` prices, each worker's count read once."""
        if self.epsilon is None or not workers:
            return list(workers), [0] * len(workers), None
        get = self.sent.get
        counts = [get(w, 0) for w in workers]
        total = sum(counts)
        cap = math.ceil((1.0 + self.epsilon) * (total + 1) / len(workers)) + self.slack
        if max(counts) < cap:  # the common case: every worker is under the cap
            return list(workers), counts, total / len(workers)
        chosen = [w for w in workers if get(w, 0) < cap] or list(workers)
        counts = [get(w, 0) for w in chosen]
        return chosen, counts, sum(counts) / len(chosen)

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


__all__ = [
    "BoundedLoad",
    "chunked_prefill_ms",
    "credited_blocks",
    "load_rank",
    "lowest_cost",
    "overlap_costs",
    "ttft_costs",
]
