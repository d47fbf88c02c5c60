"""``router-sim serve`` in front of engine-shaped stand-ins of vLLM, SGLang and trtllm-serve
(tests/engine_standins.py): health and load from each engine's own endpoints, probe failures
explained, restarts seen on the event stream, per-worker counters that never go back."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestClient, TestServer
from engine_standins import EngineStandIn
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tokenizer_fixture import CHAT_TEMPLATE, make_tokenizer

from router_sim.service.app import build_app
from router_sim.service.core import RouterService, WorkerState
from router_sim.service.fleet import FleetError, FleetFile, WorkerEntry, parse_fleet
from router_sim.service.probes import prometheus_load, read_gauges, trtllm_load
from router_sim.service.tokenizer import PromptTokenizer

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
TPB = 16
Scenario = Callable[[TestClient[Any, Any], RouterService, list[EngineStandIn]], Awaitable[None]]


async def until(what: str, probe: Callable[[], Awaitable[T | None]], timeout_s: float = 10.0) -> T:
    """Await ``probe`` until it returns something truthy; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: T | None = None
    while loop.time() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.02)  # poll interval; the deadline bounds the wait
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def run(
    tmp_path: Path,
    engines: list[str],
    scenario: Scenario,
    *,
    entry_engine: str | None = None,
    router_tokenizer: bool = True,
    models: list[str] | None = None,
    policy: str = "kv_overlap",
    **standin: Any,
) -> None:
    """``scenario`` against a router (in process) in front of one stand-in per engine named,
    all speaking the tokenizer of tests/tokenizer_fixture.py."""
    tok = make_tokenizer(tmp_path)
    standin = {"chat_template": CHAT_TEMPLATE, "special_tokens": {"bos_token": "<s>"}, **standin}

    async def main() -> None:
        file = str(tok / "tokenizer.json")
        names = models or ["test-model"] * len(engines)
        ins = [EngineStandIn(e, i, file, model=names[i], **standin) for i, e in enumerate(engines)]
        try:
            for s in ins:
                await s.start()
            entries = []
            for s in ins:
                e = s.entry()
                if entry_engine is not None:
                    e["engine"] = entry_engine
                    if entry_engine == "native":
                        del e["engine"]  # an entry without "engine": the default
                entries.append(WorkerEntry.model_validate(e))
            svc = RouterService(
                FleetFile(tokens_per_block=TPB, workers=entries),
                policy,
                health_interval_s=0.05,
                probe_timeout_s=0.5,
                replay_timeout_ms=200,
                tokenizer=PromptTokenizer.load(tok) if router_tokenizer else None,
            )
            async with TestClient(TestServer(build_app(svc))) as client:
                await scenario(client, svc, ins)
        finally:
            for s in ins:
                await s.stop()
                s.close()

    asyncio.run(main())


async def report(client: TestClient[Any, Any]) -> dict[int, dict[str, Any]]:
    resp = await client.get("/workers")
    assert resp.status == 200
    return {w["id"]: w for w in (await resp.json())["workers"]}


async def metric(client: TestClient[Any, Any], name: str, worker: int) -> float | None:
    text = await (await client.get("/metrics")).text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("worker") == str(worker):
                return float(s.value)
    return None


def prefix(k: int, blocks: int = 4) -> list[int]:
    return [1000 * (k + 1) + i for i in range(blocks * TPB)]


async def complete(client: TestClient[Any, Any], prompt: Any, **extra: Any) -> int:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra})
    assert resp.status == 200, await resp.text()
    await resp.read()
    return int(resp.headers["X-Router-Worker"])


async def _completes(client: TestClient[Any, Any], prompt: list[int]) -> bool:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    await resp.read()
    return resp.status == 200


async def overlap(client: TestClient[Any, Any], prompt: list[int], worker: int) -> int:
    resp = await client.post("/route", json={"prompt": prompt})
    assert resp.status == 200, await resp.text()
    return int((await resp.json())["overlaps"].get(str(worker), 0))


# ------------------------------------------------------------------ the Prometheus reader

_NAMES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
        "sglang:num_queue_reqs",
        "other_metric",
    ]
)
_LABEL_VALUE = st.text(alphabet='ab }{"\\\n=,', max_size=6)
_VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-5, 10**6))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def _expositions(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        name = draw(_NAMES)
        labels = draw(
            st.dictionaries(
                st.sampled_from(["engine", "model_name", "le"]), _LABEL_VALUE, max_size=3
            )
        )
        value = draw(_VALUE)
        text = repr(float(value)) if isinstance(value, float) else str(value)
        text = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}.get(text, text)
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        stamp = draw(st.sampled_from(["", " 1700000000000"]))
        if draw(st.booleans()):
            lines.append(f"# HELP {name} some help text {{with braces}}")
        lines.append(
            f"{name}{{{body}}} {text}{stamp}"
            if labels or draw(st.booleans())
            else f"{name} {text}{stamp}"
        )
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(_expositions())
def test_the_gauge_reader_agrees_with_prometheus_clients_parser(text: str) -> None:
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
    want: dict[str, list[float]] = {n: [] for n in names}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want and math.isfinite(s.value):
                want[s.name].append(float(s.value))
    got = read_gauges(text.encode(), [n.encode() for n in names])
    assert {k.decode(): v for k, v in got.items()} == want


def test_engine_load_sums_requests_and_takes_the_fullest_engine() -> None:
    # two data-parallel engines behind one vLLM server (written as vLLM 0.33 labels them)
    page = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""
    assert prometheus_load("vllm", page) == (6, 0.5)
    old = page.replace(b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
    assert prometheus_load("vllm", old) == (6, 0.5)  # the name before vLLM 0.10
    with pytest.raises(ValueError, match="no vllm:kv_cache_usage_perc or vllm:gpu_cache"):
        prometheus_load("vllm", page.replace(b"kv_cache_usage_perc", b"x"))
    with pytest.raises(ValueError, match=r"no sglang:num_running_reqs.*--enable-metrics"):
        prometheus_load("sglang", page)


def test_trtllm_iteration_stats_give_the_last_iterations_load() -> None:
    stats = [
        {"numActiveRequests": 9, "numQueuedRequests": 9, "kvCacheStats": {"maxNumBlocks": 10}},
        {
            "numActiveRequests": 2,
            "numQueuedRequests": 3,
            "kvCacheStats": {"maxNumBlocks": 200, "usedNumBlocks": 50, "freeNumBlocks": 150},
        },
    ]
    assert trtllm_load(stats) == (5, 0.25)
    assert trtllm_load(
        [{"numActiveRequests": 1, "kvCacheStats": {"maxNumBlocks": 8, "freeNumBlocks": 6}}]
    ) == (1, 0.25)
    assert trtllm_load([]) is None  # nothing ran since the last read
    with pytest.raises(ValueError):
        trtllm_load({"numActiveRequests": 1})


# ------------------------------------------------------------------ engines as they are


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_are_probed_on_their_own_endpoints_and_routed_by_their_events(
    tmp_path: Path, engine: str
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("both up", lambda: _all_up(client))
        ins[1].running, ins[1].waiting = 3, 2
        got = await until("worker 1's reported load", lambda: _reported(client, 1, 5))
        assert got["load_error"] is None and got["probe_error"] is None
        assert got["models"] == ["test-model"]
        # routed by the events the engine published in its own layout
        p = prefix(0)
        w = await complete(client, [*p, 1, 2])
        assert ins[w].bodies[-1]["prompt"] == [*p, 1, 2]  # forwarded as sent
        await until("prefix indexed", lambda: _eq(overlap(client, p, w), 4))
        assert await complete(client, [*p, 7]) == w
        listed = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["test-model"]
        assert listed["data"][0]["max_model_len"] == 4096

    run(tmp_path, [engine, engine], scenario)


async def _eq(value: Awaitable[Any], want: Any) -> bool:
    return bool(await value == want)


async def _all_up(client: TestClient[Any, Any]) -> bool:
    return all(w["up"] for w in (await report(client)).values())


async def _reported(client: TestClient[Any, Any], worker: int, want: int) -> dict[str, Any] | None:
    got = (await report(client))[worker]
    return got if got["load"]["reported_requests"] == want else None


def test_sglang_without_metrics_is_routed_and_says_why_its_load_is_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        got = await until("worker up", lambda: _up_report(client, 0))
        assert "--enable-metrics" in got["load_error"]
        assert await complete(client, prefix(1)) == 0
        assert any("--enable-metrics" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="router_sim.service")
    run(tmp_path, ["sglang"], scenario, metrics=False)


async def _up_report(client: TestClient[Any, Any], worker: int) -> dict[str, Any] | None:
    got = (await report(client))[worker]
    return got if got["up"] else None


def test_an_engine_listed_as_native_is_down_and_the_reason_says_what_to_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        got = await until("a probe error", lambda: _probe_error(client, 0))
        assert "/healthz answered 404" in got and '"engine"' in got
        resp = await client.post("/route", json={"prompt": [1, 2, 3]})
        assert resp.status == 503
        assert any("/healthz answered 404" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="router_sim.service")
    run(tmp_path, ["vllm"], scenario, entry_engine="native")


async def _probe_error(client: TestClient[Any, Any], worker: int) -> str | None:
    got = (await report(client))[worker]["probe_error"]
    return None if got is None else str(got)


def test_a_dead_vllm_engine_is_down_until_its_health_answers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _up_report(client, 0))
        ins[0].dead = True
        got = await until("down", lambda: _probe_error(client, 0))
        assert "answered 503" in got and "engine has died" in got
        ins[0].dead = False
        await until("back up", lambda: _up_report(client, 0))
        lines = [r.getMessage() for r in caplog.records]
        assert any("worker 0 is down" in m for m in lines)
        assert any("worker 0 is back up" in m for m in lines)

    caplog.set_level(logging.INFO, logger="router_sim.service")
    run(tmp_path, ["vllm"], scenario)


def test_trtllm_serve_load_comes_from_its_iteration_stats(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _up_report(client, 0))
        ins[0].record_iteration(active=4, queued=1, used_blocks=1024)
        got = await until("load read", lambda: _reported(client, 0, 5))
        assert got["load"]["kv_usage"] == 0.25
        # later reads drain nothing: the last load stands
        await until("a later probe", lambda: _probes_after(svc, 0))
        assert (await report(client))[0]["load"]["reported_requests"] == 5

    run(tmp_path, ["trtllm"], scenario)


async def _probes_after(svc: RouterService, worker: int) -> bool:
    for _ in range(3):
        await svc.probe(worker)
    return True


@pytest.mark.parametrize(
    ("engine", "replay_topic"),
    [("vllm", True), ("vllm", False), ("sglang", True)],
    ids=["vllm-0.26+", "vllm-0.25", "sglang-0.5"],
)
def test_an_engine_restart_is_read_from_its_event_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engine: str, replay_topic: bool
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _up_report(client, 0))
        old, new = prefix(2), prefix(3)
        for k in range(3):
            await complete(client, [*old[: (k + 2) * TPB], k])
        await until("old prefix indexed", lambda: _eq(overlap(client, old, 0), 4))
        received = await metric(client, "router_stream_received_total", 0)
        assert received is not None and received >= 1
        await ins[0].restart()  # same ports, an empty cache, seqs from 0 again
        # a probe that ran while it was stopping may mark it down a moment: poll for the answer
        await until("a completion after the restart", lambda: _completes(client, [*new, 5]))
        await until("new prefix indexed", lambda: _eq(overlap(client, new, 0), 4))
        assert await overlap(client, old, 0) == 0  # the restart emptied the engine's cache
        got = (await report(client))[0]
        assert got["restarts"] == 1 and got["state"] == "ok"
        assert await metric(client, "router_stream_restarts_total", 0) == 1
        after = await metric(client, "router_stream_received_total", 0)
        assert after is not None and after >= received  # counters never go back
        assert any("worker 0 restarted" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="router_sim.service")
    run(tmp_path, [engine], scenario, replay_topic=replay_topic)


def test_per_worker_counters_survive_removal_and_re_adding(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _up_report(client, 0))
        sent = iter(range(10, 10_000))

        async def one_more_then_count() -> bool:
            # "up" is the health probe; the subscription may not have joined yet, so a batch
            # published before it is lost (ZeroMQ's slow joiner): keep completing until three
            # came live
            await complete(client, prefix(next(sent)))
            return await _metric_at_least(client, "router_stream_received_total", 0, 3)

        await until("3 live batches", one_more_then_count)
        before = await metric(client, "router_stream_received_total", 0)
        decisions = await metric(client, "router_decisions_total", 0)
        resp = await client.delete("/workers/0")
        assert resp.status == 200
        resp = await client.post("/workers", json=ins[0].entry())
        assert resp.status == 201
        await until("up again", lambda: _up_report(client, 0))
        again = await metric(client, "router_stream_received_total", 0)
        assert again is not None and before is not None and again >= before
        assert await metric(client, "router_decisions_total", 0) == decisions
        # lag gauges: seconds for every engine (seqs only where the worker tells its seq)
        assert (await metric(client, "router_event_lag_seconds", 0) or 0.0) >= 0.0

    run(tmp_path, ["vllm"], scenario)


async def _metric_at_least(client: TestClient[Any, Any], name: str, worker: int, n: float) -> bool:
    return (await metric(client, name, worker) or 0.0) >= n


def test_a_fleet_entry_names_its_engine_and_a_bad_one_is_refused() -> None:
    entry = {"id": 0, "http": "http://127.0.0.1:1", "events": "tcp://127.0.0.1:2"}
    fleet = parse_fleet(json.dumps({"workers": [entry]}))
    assert fleet.workers[0].engine == "native"  # fleet files without it keep working
    for engine in ("vllm", "sglang", "trtllm"):
        got = parse_fleet(json.dumps({"workers": [{**entry, "engine": engine}]}))
        assert got.workers[0].engine == engine
    with pytest.raises(FleetError, match=r"workers\.0\.engine: Input should be 'native'"):
        parse_fleet(json.dumps({"workers": [{**entry, "engine": "vLLM"}]}))
    with pytest.raises(FleetError, match=r"models\.m\.max_model_len"):
        parse_fleet(json.dumps({"models": {"m": {"max_model_len": 0}}}))


def test_a_request_naming_a_model_goes_only_to_the_workers_serving_it(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("both up", lambda: _all_up(client))
        listed = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["model-a", "model-b"]
        for k in range(4):  # whatever the load, model-b's requests find only worker 1
            assert await complete(client, prefix(20 + k), model="model-b") == 1
            assert await complete(client, prefix(30 + k), model="model-a") == 0
        resp = await client.post("/v1/completions", json={"prompt": [1, 2], "model": "model-c"})
        assert resp.status == 404
        message = (await resp.json())["error"]["message"]
        assert "model-c" in message and "['model-a', 'model-b']" in message

    run(tmp_path, ["vllm", "vllm"], scenario, models=["model-a", "model-b"])


def test_an_adapter_listed_by_an_engine_is_routed_by_its_name() -> None:
    """vLLM and SGLang list a LoRA adapter in /v1/models with its base as ``parent`` and key
    its blocks by the adapter's name: the router hashes the request that way."""
    entry = WorkerEntry(id=0, engine="vllm", http="http://127.0.0.1:1", events="tcp://127.0.0.1:2")
    svc = RouterService(FleetFile(tokens_per_block=TPB, models={"base": {"max_model_len": 100}}))
    state = WorkerState(entry, models={"base": {"id": "base"}})
    state.models["sql-lora"] = {"id": "sql-lora", "parent": "base", "max_model_len": None}
    svc.workers[0] = state
    adapter, base = svc.model_view("sql-lora"), svc.model_view("base")
    assert (adapter.lora_name, adapter.workers, adapter.max_model_len) == ("sql-lora", {0}, 100)
    assert base.lora_name is None and svc.model_view(None).max_model_len == 100
    ids = prefix(40)
    named = svc.router.hash_request(ids, lora_name="sql-lora")
    assert named != svc.router.hash_request(ids) and len(named) == 4


def test_an_engines_own_request_count_steers_a_load_aware_policy(tmp_path: Path) -> None:
    """Requests other routers sent count: the engine's running + waiting gauges are part of
    the load the policy reads, beside what this router forwarded."""

    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("both up", lambda: _all_up(client))
        for busy, idle in ((0, 1), (1, 0)):
            ins[busy].running, ins[busy].waiting = 8, 30
            ins[idle].running = ins[idle].waiting = 0
            await until("the load read", lambda busy=busy: _reported(client, busy, 38))
            await until("the other idle", lambda idle=idle: _reported(client, idle, 0))
            for k in range(3):
                resp = await client.post("/route", json={"prompt": prefix(50 + k)})
                assert (await resp.json())["worker"] == idle

    run(tmp_path, ["sglang", "sglang"], scenario, policy="least_loaded")
