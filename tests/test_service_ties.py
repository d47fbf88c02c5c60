"""Two router replicas fed the same events break exact ties alike.

A load balancer sends each replica a different share of the traffic, so a tie-break drawn
from a replica's own RNG would diverge as soon as one replica routed a request the other did
not. The tie-break comes from the request's content instead; here two services (the state
``router-sim serve`` keeps: its router, policy and in-flight load view) receive the same
event batches through the path the event pump feeds, route different histories, then many
prompts that tie exactly, and must agree on every one.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from events.stream.subscriber import BatchDelivery
from events.wire.model import DecodedBatch, KVCacheEvent, Stored, StoredBlock
from kvcache.hashing import chain_hashes
from kvcache.scope import DEFAULT_SCOPE
from router_sim.service.core import RouterService
from router_sim.service.fleet import FleetFile
from router_sim.service.pump import PumpItem

TPB = 4
WORKERS = range(6)


def replica(policy: str) -> RouterService:
    svc = RouterService(FleetFile(tokens_per_block=TPB), policy)
    for w in WORKERS:  # what a first answered probe does
        svc.load.add(w)
        svc.load.set_eligible(w, True)
    return svc


def stored(tokens: list[int]) -> DecodedBatch:
    hashes = chain_hashes(tokens, TPB, DEFAULT_SCOPE)
    blocks = [StoredBlock(h, tokens[i * TPB : (i + 1) * TPB]) for i, h in enumerate(hashes)]
    return DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, blocks, TPB))])


@pytest.mark.parametrize("policy", ["kv_overlap", "predicted_ttft"])
def test_replicas_fed_the_same_events_break_exact_ties_alike(policy: str) -> None:
    rng = random.Random(12)
    shared = [rng.randrange(32_000) for _ in range(8 * TPB)]  # 8 blocks every worker holds
    batches: list[PumpItem] = [BatchDelivery(w, 0, stored(shared)) for w in WORKERS]
    a, b = replica(policy), replica(policy)
    for svc in (a, b):
        svc._apply(batches)
    # different histories: b alone routed other prompts first (its RNG, had it one for ties,
    # would be elsewhere in its stream)
    for i in range(29):
        b.decide([rng.randrange(32_000) for _ in range(5 * TPB + i % 3)], None, None)
    prompts = [shared + [rng.randrange(32_000) for _ in range(k % 7 + TPB)] for k in range(300)]
    prompts += [[rng.randrange(32_000) for _ in range(3 * TPB)] for _ in range(100)]  # no hit
    picks_a = [a.decide(p, None, None) for p in prompts]
    picks_b = [b.decide(p, None, None) for p in reversed(prompts)][::-1]
    for da, db in zip(picks_a, picks_b, strict=True):
        assert len(set(da.costs.values())) == 1  # an exact tie over every worker
        assert da.worker == db.worker
    spread = Counter(d.worker for d in picks_a)
    assert set(spread) == set(WORKERS)  # ties spread over the fleet, not all to worker 0
    assert max(spread.values()) < 2 * len(prompts) / len(WORKERS)
