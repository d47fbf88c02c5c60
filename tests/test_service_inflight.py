"""The router service's load view: what it forwarded and has not seen finish."""

from __future__ import annotations

from router_sim.router.load import WorkerLoad
from router_sim.service.inflight import InFlightLoad


def test_a_request_loads_its_worker_from_forwarding_to_its_end() -> None:
    view = InFlightLoad(tokens_per_block=16)
    view.add(0)
    view.add(1)
    # 100 prompt tokens, 32 of them cached: 68 to prefill; its KV spans ceil(100/16) = 7 blocks
    t = view.begin(0, prompt_tokens=100, cached_tokens=32)
    assert view.load(0) == WorkerLoad(active_requests=1, pending_prefill_tokens=68)
    view.first_token(t)
    assert view.load(0) == WorkerLoad(active_requests=1, decode_blocks=7)
    view.first_token(t)  # a second chunk changes nothing
    view.end(t)
    view.end(t)  # idempotent
    assert view.load(0) == WorkerLoad()
    assert view.load(1) == WorkerLoad()


def test_a_request_that_ends_before_its_first_token_gives_back_its_prefill() -> None:
    view = InFlightLoad(tokens_per_block=16)
    a = view.begin(2, 64, 0)
    b = view.begin(2, 40, 16)
    assert view.load(2) == WorkerLoad(active_requests=2, pending_prefill_tokens=64 + 24)
    view.end(a)  # failed before answering
    assert view.load(2) == WorkerLoad(active_requests=1, pending_prefill_tokens=24)
    view.end(b)
    assert view.load(2) == WorkerLoad()


def test_only_eligible_workers_are_offered_and_kv_usage_is_clamped() -> None:
    view = InFlightLoad(tokens_per_block=16)
    for w in (0, 1, 2):
        view.add(w)
    view.set_eligible(1, False)
    assert sorted(view.workers()) == [0, 2]
    view.set_kv_usage(2, 1.7)
    assert view.load(2).kv_usage == 1.0
    t = view.begin(0, 16, 0)
    view.remove(0)
    view.end(t)  # the worker left meanwhile: nothing to give back, no error
    assert sorted(view.workers()) == [2]
    assert view.active(0) == 0


def test_a_load_read_again_is_kept_until_one_of_its_figures_changes() -> None:
    view = InFlightLoad(tokens_per_block=16)
    view.add(0)
    first = view.load(0)
    assert view.load(0) is first  # nothing changed: the same snapshot
    view.set_kv_usage(0, 0.5)
    assert view.load(0) == WorkerLoad(kv_usage=0.5)
    view.set_reported(0, 3)
    assert view.load(0) == WorkerLoad(active_requests=3, kv_usage=0.5)
    t = view.begin(0, prompt_tokens=32, cached_tokens=0)
    assert view.load(0) == WorkerLoad(active_requests=3, pending_prefill_tokens=32, kv_usage=0.5)
    view.first_token(t)
    assert view.load(0) == WorkerLoad(active_requests=3, decode_blocks=2, kv_usage=0.5)
    view.set_reported(0, None)
    assert view.load(0) == WorkerLoad(active_requests=1, decode_blocks=2, kv_usage=0.5)
    view.end(t)
    assert view.load(0) == WorkerLoad(kv_usage=0.5)
