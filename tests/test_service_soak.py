"""Longer runs of ``router-sim serve`` (``-m slow``): concurrent traffic, then bookkeeping."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_procs import (
    Proc,
    fleet_file,
    poll,
    request,
    start_serve,
    start_worker,
    workers_by_id,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TPB = 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Proc], Proc, Path]]:
    workers: list[Proc] = []
    serve = None
    try:
        workers = [start_worker(i) for i in range(4)]
        path = fleet_file(tmp_path_factory.mktemp("soak") / "fleet.json", workers)
        serve = start_serve(path)
        poll("workers up", lambda: all(w["up"] for w in workers_by_id(serve).values()))
        yield workers, serve, path
    finally:
        for p in [serve, *workers]:
            if p is not None:
                p.stop()


def _complete(serve: Proc, prompt: list[int], stream: bool) -> tuple[int, int]:
    body = {"prompt": prompt, "max_tokens": 8, "stream": stream}
    status, headers, data = request("POST", serve.http + "/v1/completions", body, timeout=60)
    assert status == 200, data
    if stream:
        events = [e for e in data.decode().split("\n\n") if e and e != "data: [DONE]"]
        usage: dict[str, Any] = json.loads(events[-1][len("data: ") :])["usage"]
    else:
        usage = json.loads(data)["usage"]
    assert usage["completion_tokens"] == 8
    return int(headers["X-Router-Worker"]), int(usage["prompt_tokens_details"]["cached_tokens"])


def test_concurrent_traffic_keeps_prefixes_together_and_the_books_balanced(
    fleet: tuple[list[Proc], Proc, Path],
) -> None:
    _, serve, _ = fleet
    groups = 8
    prefixes = [[50_000 * (g + 1) + i for i in range(8 * TPB)] for g in range(groups)]
    # one request per group first, so that every prefix has a home
    with ThreadPoolExecutor(16) as pool:
        homes = list(pool.map(lambda g: _complete(serve, [*prefixes[g], 1], False)[0], range(8)))
    for g in range(groups):
        poll(
            f"group {g} indexed",
            lambda g=g: (
                json.loads(  # type: ignore[misc]
                    request("POST", serve.http + "/route", {"prompt": prefixes[g]})[2]
                )["overlaps"][str(homes[g])]
                == 8
            ),
        )
    jobs = [(g, k) for k in range(12) for g in range(groups)]
    with ThreadPoolExecutor(24) as pool:
        results = list(
            pool.map(lambda j: _complete(serve, [*prefixes[j[0]], 2, j[1]], j[1] % 2 == 0), jobs)
        )
    at_home = sum(1 for (g, _), (w, _) in zip(jobs, results, strict=True) if w == homes[g])
    cached = sum(1 for _, c in results if c >= 8 * TPB)
    # the policy may send some away to balance load, but most stay with their prefix
    assert at_home >= len(jobs) // 2, (at_home, len(jobs))
    assert cached >= at_home
    report = workers_by_id(serve)
    assert all(w["in_flight"] == 0 for w in report.values())
    text = request("GET", serve.http + "/metrics")[2].decode()
    inflight = decisions = proxied = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "router_inflight_requests":
                inflight += s.value
            elif s.name == "router_decisions_total":
                decisions += s.value
            elif s.name == "router_proxy_requests_total":
                proxied += s.value
    assert inflight == 0
    assert proxied == len(jobs) + groups
    assert decisions >= proxied


def test_a_replica_started_after_the_traffic_agrees(fleet: tuple[list[Proc], Proc, Path]) -> None:
    _, serve, path = fleet
    replica = start_serve(path)
    try:

        def same() -> bool:
            a, b = workers_by_id(serve), workers_by_id(replica)
            return all(
                a[w]["state"] == b[w]["state"] == "ok"
                and a[w]["blocks_indexed"] == b[w]["blocks_indexed"]
                for w in a
            )

        poll("the late replica catches up", same, timeout_s=60)
    finally:
        replica.stop()
