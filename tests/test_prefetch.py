"""The replay's prompt thread (router_sim.sim.prefetch) against the inline path it stands in for
(the cache's side of given keys: tests/test_given_keys.py)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import pytest

from kvcache.hashing import blockchain_keys, root_key
from router_sim.router.load import StaticLoadSource, WorkerLoad
from router_sim.router.routing import Router
from router_sim.sim import prefetch
from router_sim.sim.simulator import SimConfig, simulate
from router_sim.sim.trace import load_trace
from router_sim.sim.workloads import Request

TPB = 64


def _requests() -> list[Request]:
    """Trace requests under three scopes (none, an adapter, an adapter and a salt), a
    request with a given prompt (not the thread's) and one shorter than a block."""
    base = load_trace("mooncake")[:120]
    out: list[Request] = []
    for i, r in enumerate(base):
        kw: dict[str, Any] = {"request_id": i}
        if i % 3 == 1:
            kw["lora_id"] = 7
        elif i % 3 == 2:
            kw.update(lora_id=3, cache_salt="tenant-b")
        out.append(
            Request(
                request_id=i,
                arrival_ms=r.arrival_ms,
                input_length=r.input_length,
                output_length=r.output_length,
                hash_ids=r.hash_ids,
                lora_id=kw.get("lora_id"),
                cache_salt=kw.get("cache_salt"),
            )
        )
    out.append(
        Request(
            request_id=900,
            arrival_ms=1e9,
            input_length=3,
            output_length=2,
            prompt=array("i", [1, 2, 3]),
        )
    )
    out.append(
        Request(request_id=901, arrival_ms=1e9, input_length=5, output_length=2, hash_ids=(4, 5))
    )
    return out


def test_each_request_gets_what_the_inline_path_computes() -> None:
    reqs = _requests()
    scopes = [r.scope for r in reqs]
    source = prefetch.prompt_source(reqs, scopes, TPB, True)
    assert source is not None
    router = Router(TPB, "round_robin", StaticLoadSource({0: WorkerLoad()}))
    keyed = bool(prefetch.KEYS)
    try:
        for req, scope in zip(reqs, scopes, strict=True):
            made = source.take()
            if req.prompt is not None:
                assert made is None  # a given prompt is hashed inline
                continue
            assert made is not None
            hashes, keys = made
            tokens = req.tokens()
            assert hashes == router.hash_request(tokens, scope)
            if keyed:
                assert keys == blockchain_keys(scope, tokens, TPB)[: len(tokens) // TPB]
            else:
                assert keys is None
    finally:
        source.close()
    # a scope's keys differ from another's: the thread chained each from its own root
    assert len({root_key(s) for s in scopes}) == 3


def test_the_cache_keys_chain_sha256_over_little_endian_tokens() -> None:
    # hand-derived: key = sha256(parent || 4-byte LE tokens), from sha256(scope bytes)
    if not prefetch.KEYS:
        pytest.skip("keys are made inline on a big-endian CPU")
    req = Request(request_id=0, arrival_ms=0.0, input_length=TPB, output_length=1, hash_ids=(11,))
    source = prefetch.prompt_source([req], [req.scope], TPB, False)
    assert source is not None
    made = source.take()
    source.close()
    assert made is not None and made[0] is None
    tokens = req.tokens()
    expect = hashlib.sha256(
        hashlib.sha256(req.scope.to_bytes()).digest()
        + b"".join(t.to_bytes(4, "little") for t in tokens)
    ).digest()
    assert made[1] == [expect]


def test_the_whole_report_is_the_same_with_and_without_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reqs = _requests()[:-2]
    config = SimConfig(workers=3, tokens_per_block=TPB, device_blocks=3000)
    skip = {"wall_s", "decision_us_p50", "decision_us_p99", "decision_us_mean"}
    reports = []
    for enabled in (True, False):
        monkeypatch.setattr(prefetch, "ENABLED", enabled)
        summary = simulate(reqs, "kv_overlap", config)
        d = {k: v for k, v in summary.as_dict().items() if k not in skip}
        records = [(r.worker, r.reused_tokens, r.first_token_ms) for r in summary.records]
        reports.append((d, records))
    assert reports[0] == reports[1]
    assert reports[0][0]["hit_rate"] > 0  # the keys did meet: prompts were reused


def test_take_past_the_end_and_after_close_answers_at_once() -> None:
    reqs = _requests()[:5]
    source = prefetch.prompt_source(reqs, [r.scope for r in reqs], TPB, True)
    assert source is not None
    for _ in range(5):
        source.take()
    assert len(source) == 0  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        source.take()
    many = load_trace("mooncake")[:3000]
    source = prefetch.prompt_source(many, [r.scope for r in many], TPB, True)
    assert source is not None
    source.close()
    taken = 0
    with pytest.raises((RuntimeError, IndexError)):
        while True:  # what was made before the close, then an error: never a wait
            source.take()
            taken += 1
    assert taken <= len(many)
    source.close()  # twice is fine


@pytest.mark.parametrize(
    "job, error",
    [
        ((1, 2), TypeError),
        (((1, 2), 2000, None, None, True, None), ValueError),  # more tokens than ids give
        (((1, 2), 10, None, None, True, b"short"), TypeError),
        (((1, "x"), 600, None, None, True, None), TypeError),
        (((1, 2), 10, -1, None, True, None), ValueError),
    ],
)
def test_a_bad_job_is_refused_when_made(job: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        prefetch.Prefetch([job], 512, 21, (1 << 21) - 1, TPB, 8)  # type: ignore[list-item,misc]


def test_disabled_or_nothing_to_make_gives_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    given = [r for r in _requests() if r.prompt is not None]
    assert prefetch.prompt_source(given, [r.scope for r in given], TPB, True) is None
    reqs = _requests()[:3]
    monkeypatch.setattr(prefetch, "ENABLED", False)
    assert prefetch.prompt_source(reqs, [r.scope for r in reqs], TPB, True) is None
