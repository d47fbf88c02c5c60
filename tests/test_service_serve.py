"""``router-sim serve`` in front of 4 real ``router-sim worker`` processes, on loopback.

One fleet for the module (starting processes is the slow part); the tests run in file order and
each leaves the fleet as it found it (every worker up and subscribed).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_procs import (
    Proc,
    fleet_file,
    get_json,
    poll,
    post_json,
    request,
    start_serve,
    start_worker,
    workers_by_id,
)

pytestmark = pytest.mark.timeout(120)

TPB = 16
OCTETS = "application/octet-stream"
LORAS = {"adapter-a": 7}


class Fleet:
    def __init__(self, workers: list[Proc], serve: Proc, path: Path) -> None:
        self.workers = {w.ready["id"]: w for w in workers}
        self.serve = serve
        self.path = path

    def route(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        status, _, body = post_json(self.serve.http + "/route", {"prompt": prompt, **extra})
        assert status == 200, body
        return dict(body)

    def complete(self, prompt: list[int], **extra: Any) -> tuple[int, dict[str, Any]]:
        """A completion through the router: (worker, usage)."""
        body = {"prompt": prompt, "max_tokens": 2, **extra}
        status, headers, data = request("POST", self.serve.http + "/v1/completions", body)
        assert status == 200, data
        if extra.get("stream"):
            chunks = [e for e in data.decode().split("\n\n") if e and e != "data: [DONE]"]
            answer = json.loads(chunks[-1][len("data: ") :])
        else:
            answer = json.loads(data)
        return int(headers["X-Router-Worker"]), answer["usage"]


def prefix(k: int, blocks: int = 4) -> list[int]:
    return [10_000 * (k + 1) + i for i in range(blocks * TPB)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workers: list[Proc] = []
    serve = None
    try:
        for i in range(4):
            workers.append(start_worker(i))
        path = fleet_file(tmp_path_factory.mktemp("fleet") / "fleet.json", workers, loras=LORAS)
        serve = start_serve(path)
        f = Fleet(workers, serve, path)
        poll("all 4 workers up", lambda: all(w["up"] for w in workers_by_id(serve).values()))
        yield f
        workers = list(f.workers.values())  # a test may have replaced one
    finally:
        for p in [serve, *workers]:
            if p is not None:
                p.stop()


def indexed(f: Fleet, prompt: list[int], worker: int, blocks: int, **extra: Any) -> bool:
    return bool(f.route(prompt, **extra)["overlaps"].get(str(worker)) == blocks)


def test_shared_prefixes_go_to_the_worker_holding_them(fleet: Fleet) -> None:
    for k in range(3):
        p = prefix(k)
        first, usage = fleet.complete([*p, 1, 2, 3])
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0

        def held(p: list[int] = p, first: int = first) -> bool:
            return indexed(fleet, p, first, 4)

        poll(f"prefix {k} indexed on worker {first}", held)
        stats_before = get_json(fleet.workers[first].http + "/stats")
        decision = fleet.route([*p, 9])
        assert decision["worker"] == first
        assert decision["best_overlap"] == decision["chosen_overlap"] == 4
        assert decision["num_blocks"] == 4
        again, usage = fleet.complete([*p, 4, 5], stream=True)
        assert again == first
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * TPB
        stats_after = get_json(fleet.workers[first].http + "/stats")
        assert stats_after["cached_tokens"] - stats_before["cached_tokens"] == 4 * TPB
    report = workers_by_id(fleet.serve)
    assert all(w["state"] == "ok" and w["lag"] == 0 for w in report.values()), report
    assert sum(w["blocks_indexed"] for w in report.values()) >= 3 * 4
    # the lag as gauges: native workers tell their last seq, so the seqs behind are known
    _, _, text = request("GET", fleet.serve.http + "/metrics")
    lag = {
        (s.name, s.labels["worker"]): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
        if s.name in ("router_event_lag_seqs", "router_event_lag_seconds")
    }
    assert all(lag[("router_event_lag_seqs", str(w))] == 0 for w in range(4)), lag
    assert lag[("router_event_lag_seconds", str(first))] >= 0.0


def test_lora_names_resolve_to_the_fleet_files_ids(fleet: Fleet) -> None:
    p = prefix(10)
    worker, _ = fleet.complete([*p, 1], model="adapter-a")
    poll("LoRA blocks indexed", lambda: indexed(fleet, p, worker, 4, lora_id=7))
    # the same tokens without the adapter are another namespace: nobody holds them
    assert max(fleet.route(p)["overlaps"].values()) == 0
    assert fleet.route(p, lora_name="adapter-a")["overlaps"][str(worker)] == 4
    status, _, body = post_json(fleet.serve.http + "/route", {"prompt": p, "lora_name": "zzz"})
    assert status == 400 and "unknown lora_name" in body["error"]["message"]


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def test_packed_prompts_route_like_json_ones(fleet: Fleet) -> None:
    url = fleet.serve.http + "/route"
    for p, query, extra in (
        ([*prefix(0), 7], "", {}),
        ([*prefix(10), 7], "?lora_name=adapter-a", {"lora_id": 7}),
        ([*prefix(10), 7], "?lora_id=7&cache_salt=x", {"lora_id": 7, "cache_salt": "x"}),
    ):
        as_json = fleet.route(p, **extra)
        status, _, data = request("POST", url + query, raw=packed(p), content_type=OCTETS)
        assert status == 200, data
        got = json.loads(data)
        for key in ("overlaps", "costs", "num_tokens", "num_blocks", "best_overlap"):
            assert got[key] == as_json[key], key
        assert got["worker"] == as_json["worker"]  # ties too: broken by the prompt's content
    assert got["best_overlap"] == 0  # the salt is another namespace
    for body, query in (
        (b"\x01\x00\x00", ""),  # not whole int32s
        (b"", ""),
        (packed([1, 2]) + b"\xff\xff\xff\xff", ""),  # -1
        (packed([1, 2]), "?lora_id=abc"),
        (packed([1, 2]), "?lora_name=nope"),
    ):
        status, _, data = request("POST", url + query, raw=body, content_type=OCTETS)
        assert status == 400, (body, query, data)
        assert json.loads(data)["error"]["code"] == 400


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_metrics_parse_and_count_decisions(fleet: Fleet) -> None:
    prompts = [prefix(20 + k) for k in range(3)]
    for k, p in enumerate(prompts):  # each held by a worker, whichever tests ran before
        worker, _ = fleet.complete([*p, 1])

        def held(p: list[int] = p, worker: int = worker) -> bool:
            return indexed(fleet, p, worker, 4)

        poll(f"prefix {20 + k} indexed", held)
    before = _samples(request("GET", fleet.serve.http + "/metrics")[2].decode())
    for p in prompts:
        fleet.route(p)
    request("POST", fleet.serve.http + "/route", raw=b"{}")
    status, headers, data = request("GET", fleet.serve.http + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    after = _samples(data.decode())

    def grew(name: str) -> float:  # a family shows only once it has a sample (test order)
        return after[name] - before.get(name, 0.0)

    assert grew("router_decisions_total") == 3
    assert grew("router_decision_seconds_count") == 3
    assert grew("router_overlap_blocks_total") == 12
    assert grew("router_bad_requests_total") == 1
    assert after["router_events_applied_total"] > 0
    assert after["router_event_apply_seconds_count"] > 0  # the loop's time applying events
    report = workers_by_id(fleet.serve)
    assert after["router_index_entries"] == sum(w["blocks_indexed"] for w in report.values())
    assert after["router_worker_up"] == 4
    # batches published before the router joined came from replays alone (recovered), and a
    # replay also re-sends what came live meanwhile
    assert after["router_stream_replayed_total"] >= after["router_stream_recovered_total"]
    # the started process's heap is out of the collector's full passes (freeze_heap)
    assert after["router_gc_frozen_objects"] > 10_000
    assert after["router_gc_pause_seconds_count"] > 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/route", b"{", 400),
        ("POST", "/route", b'{"prompt": [1, "2"]}', 400),
        ("POST", "/route", b'{"prompt": [1], "lora_id": -1}', 400),
        ("POST", "/route", b'{"prompt": [1], "lora_id": 3, "lora_name": "adapter-a"}', 400),
        ("POST", "/v1/completions", b'{"prompt": [1], "stream": "yes"}', 400),
        ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": -5}', 400),
        ("POST", "/workers", b'{"id": 9}', 400),
        ("POST", "/workers", b'{"id": 9, "http": "ftp://x", "events": "tcp://127.0.0.1:1"}', 400),
        ("POST", "/workers", b'{"id": 9, "http": "http://a:1", "events": "tcp://*:5"}', 400),
        ("POST", "/workers", b'{"id": 0, "http": "http://a:1", "events": "tcp://1.2.3.4:5"}', 409),
        ("DELETE", "/workers/abc", None, 400),
        ("DELETE", "/workers/99", None, 404),
        ("GET", "/nowhere", None, 404),
        ("PUT", "/route", b"{}", 405),
    ],
)
def test_bad_requests_get_4xx_with_a_json_error(
    fleet: Fleet, method: str, path: str, body: bytes | None, status: int
) -> None:
    got, headers, data = request(method, fleet.serve.http + path, raw=body)
    assert got == status, data
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(data)["error"]["code"] == status


def test_workers_are_removed_and_added_at_run_time(fleet: Fleet) -> None:
    entry = {k: fleet.workers[3].ready[k] for k in ("id", "http", "events", "replay")}
    status, _, _data = request("DELETE", fleet.serve.http + "/workers/3")
    assert status == 200
    assert 3 not in workers_by_id(fleet.serve)
    for k in range(4):
        decision = fleet.route(prefix(20 + k))
        assert decision["worker"] != 3 and "3" not in decision["overlaps"]
    status, _, body = post_json(fleet.serve.http + "/workers", entry)
    assert status == 201 and body["id"] == 3 and body["up"]
    # the new subscription replays worker 3's whole stream: its blocks are back
    poll("worker 3 re-indexed", lambda: workers_by_id(fleet.serve)[3]["state"] == "ok")
    assert "3" in fleet.route(prefix(0))["overlaps"]


def test_a_worker_with_another_block_size_is_refused(fleet: Fleet) -> None:
    odd = start_worker(7, tokens_per_block=32)
    try:
        entry = {k: odd.ready[k] for k in ("id", "http", "events", "replay")}
        status, _, body = post_json(fleet.serve.http + "/workers", entry)
        assert status == 201
        assert body["state"] == "misconfigured" and body["up"] is False
        assert "32 tokens per block, the fleet 16" in body["probe_error"]
        for k in range(3):
            assert fleet.route(prefix(k))["worker"] != 7
        status, _, _ = request("DELETE", fleet.serve.http + "/workers/7")
        assert status == 200
    finally:
        odd.stop()


def test_a_killed_worker_is_seen_and_routing_recovers_after_restart(fleet: Fleet) -> None:
    old = fleet.workers[1]
    # a second router that probes rarely: it learns of the death from the refused connection
    blind = start_serve(fleet.path, "--health-interval", "60")
    try:
        p = prefix(50)
        status, _, _ = post_json(old.http + "/v1/completions", {"prompt": [*p, 1], "max_tokens": 1})
        assert status == 200

        def blind_route() -> dict[str, Any]:
            return dict(post_json(blind.http + "/route", {"prompt": p})[2])

        poll("prefix 50 indexed on worker 1", lambda: blind_route()["overlaps"]["1"] == 4)
        assert blind_route()["worker"] == 1
        old.kill()
        status, headers, _ = request(
            "POST", blind.http + "/v1/completions", {"prompt": [*p, 2], "max_tokens": 1}
        )
        assert status == 200 and headers["X-Router-Worker"] != "1"  # the next choice served it
        assert workers_by_id(blind)[1]["state"] == "down"
        metrics = _samples(request("GET", blind.http + "/metrics")[2].decode())
        assert metrics["router_worker_up"] == 3
    finally:
        blind.stop()
    poll("worker 1 down", lambda: workers_by_id(fleet.serve)[1]["state"] == "down")
    for k in range(4):
        worker, _ = fleet.complete(prefix(30 + k))
        assert worker != 1
    new = start_worker(1, ports=old.ready)
    fleet.workers[1] = new

    def back() -> bool:
        w = workers_by_id(fleet.serve)[1]
        return bool(w["up"] and w["incarnation"] == new.ready["incarnation"] and w["state"] == "ok")

    poll("worker 1 back with its new incarnation", back)
    # its old cache died with it: nothing of it is left in the index
    assert workers_by_id(fleet.serve)[1]["blocks_indexed"] == 0
    p = prefix(40)
    status, _, _ = post_json(new.http + "/v1/completions", {"prompt": [*p, 1], "max_tokens": 1})
    assert status == 200
    poll("the new incarnation's blocks indexed", lambda: indexed(fleet, p, 1, 4))
    worker, usage = fleet.complete([*p, 2, 3])
    assert worker == 1 and usage["prompt_tokens_details"]["cached_tokens"] == 4 * TPB


def test_two_replicas_agree_after_quiescence(fleet: Fleet) -> None:
    fleet_file(fleet.path, list(fleet.workers.values()), loras=LORAS)  # current ports
    replica = start_serve(fleet.path)
    try:
        poll(
            "replica sees the fleet", lambda: all(w["up"] for w in workers_by_id(replica).values())
        )

        def same_view() -> bool:
            a, b = workers_by_id(fleet.serve), workers_by_id(replica)
            keys = ("blocks_indexed", "last_seq", "state", "in_flight")
            return (
                all(
                    a[w]["state"] == "ok"
                    and a[w]["in_flight"] == 0  # quiescent: no answer of an earlier test pending
                    and all(a[w][k] == b[w][k] for k in keys)
                    for w in a
                )
                and a.keys() == b.keys()
            )

        poll("both replicas reach the same index", same_view)
        held = 0
        for k in (0, 1, 2, 10, 30, 31, 32, 33, 40):
            p = [*prefix(k), 7]
            first = fleet.route(p)
            status, _, second = post_json(replica.http + "/route", {"prompt": p})
            assert status == 200
            assert first["overlaps"] == second["overlaps"] and first["costs"] == second["costs"]
            if first["best_overlap"] > 0:  # no tie: ties are broken by each replica's own RNG
                assert first["worker"] == second["worker"], (first, second)
                held += 1
        assert held >= 5  # 30..33 went to live workers, 40 to the restarted one
    finally:
        replica.stop()
