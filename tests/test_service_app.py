"""The router service in process (aiohttp's test server), without workers: the edge cases."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from router_sim.service import protocol
from router_sim.service.app import build_app, freeze_heap
from router_sim.service.core import RouterService
from router_sim.service.fleet import FleetFile

pytestmark = pytest.mark.timeout(30)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(scenario: Callable[[TestClient[Any, Any], RouterService], Awaitable[None]]) -> None:
    async def main() -> None:
        svc = RouterService(FleetFile(), health_interval_s=0.05, probe_timeout_s=0.5)
        async with TestClient(TestServer(build_app(svc))) as client:
            await scenario(client, svc)

    asyncio.run(main())


def test_no_worker_is_a_503_with_a_json_error() -> None:
    async def scenario(client: TestClient[Any, Any], svc: RouterService) -> None:
        for path in ("/route", "/v1/completions"):
            resp = await client.post(path, data=json.dumps({"prompt": [1, 2, 3]}))
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "service_unavailable"

    run(scenario)


JSON = {"Content-Type": "application/json"}
BAD_IDS = [
    [-1],
    [2**31],
    [3, 2**63],
    [5, 2**64 + 1],
    [1] * 16 + [2**31],  # in the tail after the last full block, which is not hashed
    [1] * 32 + [-5],
    [1] * 40 + [-(2**63) - 1],
    [1] * 17,  # in range: the other errors
    [2**31 - 1] * 17,
]


@pytest.mark.parametrize("algo", ["v1_block_key", "v2_sha256", "v2_sha256_64"])
def test_json_prompts_read_unchecked_are_answered_as_when_read_checked(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POST /route`` reads a JSON prompt's ids without their range and lets the hashing
    refuse them; every answer is still the one of the checked reading (an id out of range
    reported as such, before an unknown adapter or the lack of a worker)."""

    async def answers() -> list[tuple[int, Any]]:
        fleet = FleetFile(tokens_per_block=16, hash_algo=algo, loras={"known": 4})
        svc = RouterService(fleet, health_interval_s=0.05, probe_timeout_s=0.5)
        out = []
        async with TestClient(TestServer(build_app(svc))) as client:
            for ids in BAD_IDS:
                for extra in ({}, {"lora_name": "unknown"}, {"lora_name": "known"}):
                    raw = json.dumps({"prompt": ids, **extra}).encode()
                    resp = await client.post("/route", data=raw, headers=JSON)
                    out.append((resp.status, await resp.json()))
        return out

    unchecked = asyncio.run(answers())
    assert {status for status, _ in unchecked} == {400, 503}
    monkeypatch.setattr(protocol, "UNCHECKED_IDS_MAX_BYTES", 0)  # every body read checked
    assert asyncio.run(answers()) == unchecked


def test_a_worker_that_does_not_answer_is_listed_down_and_never_chosen() -> None:
    async def scenario(client: TestClient[Any, Any], svc: RouterService) -> None:
        port = _closed_port()
        entry = {
            "id": 4,
            "http": f"http://127.0.0.1:{port}",
            "events": f"tcp://127.0.0.1:{port}",
        }
        resp = await client.post("/workers", data=json.dumps(entry))
        assert resp.status == 201
        report = await resp.json()
        assert report["state"] == "down" and report["up"] is False
        assert report["probe_error"].startswith(
            f"cannot connect to http://127.0.0.1:{port}/healthz"
        )
        resp = await client.post("/route", data=json.dumps({"prompt": [1, 2, 3]}))
        assert resp.status == 503
        resp = await client.delete("/workers/4")
        assert resp.status == 200
        assert (await (await client.get("/workers")).json()) == {"workers": []}

    run(scenario)


def test_healthz_fails_once_the_event_pump_is_gone() -> None:
    async def scenario(client: TestClient[Any, Any], svc: RouterService) -> None:
        resp = await client.get("/healthz")
        assert resp.status == 200
        assert await resp.json() == {"status": "ok", "workers": 0, "workers_up": 0}
        await asyncio.get_running_loop().run_in_executor(None, svc.pump.stop)
        resp = await client.get("/healthz")
        assert resp.status == 503 and (await resp.json())["status"] == "events_stopped"

    run(scenario)


def test_oversized_bodies_are_a_json_413() -> None:
    async def scenario(client: TestClient[Any, Any], svc: RouterService) -> None:
        resp = await client.post("/route", data=b"[" + b"1," * (9 << 20) + b"1]")
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == 413

    run(scenario)


def _gc_pauses(text: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "router_gc_pause_seconds_count" and s.labels["generation"] == "2"
    )


def test_garbage_collections_are_timed_while_the_service_runs() -> None:
    svc_seen: list[RouterService] = []

    async def scenario(client: TestClient[Any, Any], svc: RouterService) -> None:
        before = _gc_pauses(await (await client.get("/metrics")).text())
        gc.collect()
        gc.collect()
        after = _gc_pauses(await (await client.get("/metrics")).text())
        assert after - before == 2
        svc_seen.append(svc)

    run(scenario)
    (svc,) = svc_seen  # closed now: its callback is gone
    gc.collect()
    text = svc.metrics.exposition().decode()
    gc.collect()
    assert _gc_pauses(svc.metrics.exposition().decode()) == _gc_pauses(text)


def test_freeze_heap_takes_the_started_process_out_of_full_collections() -> None:
    try:
        frozen = freeze_heap()
        assert frozen == gc.get_freeze_count() > 10_000  # at least the imported modules
        assert len(gc.get_objects(generation=2)) < frozen
    finally:
        gc.unfreeze()
