"""``router-sim worker`` as a real process: completions, streaming, KV events, bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from service_procs import Proc, get_json, post_json, request, start_worker

from events.stream.subscriber import BatchDelivery, ZmqEventSubscriber
from events.wire.model import AllBlocksCleared, Stored
from kvcache.hashing import chain_hashes
from kvcache.scope import ReuseScope

pytestmark = pytest.mark.timeout(60)


def lcg(prev: int, n: int) -> list[int]:
    """The worker's answer, restated: each token is (prev * 1103515245 + 12345) mod 32000."""
    out = []
    for _ in range(n):
        prev = (prev * 1103515245 + 12345) % 32000
        out.append(prev)
    return out


@pytest.fixture(scope="module")
def worker() -> Iterator[Proc]:
    w = start_worker(3, device_blocks=64)
    try:
        yield w
    finally:
        w.stop()


def test_ready_line_names_every_endpoint(worker: Proc) -> None:
    assert worker.ready["id"] == 3
    assert worker.ready["http"].startswith("http://127.0.0.1:")
    assert worker.ready["events"].startswith("tcp://127.0.0.1:")
    assert worker.ready["replay"].startswith("tcp://127.0.0.1:")
    health = get_json(worker.http + "/healthz")
    assert health["status"] == "ok" and health["id"] == 3
    assert health["incarnation"] == worker.ready["incarnation"]


def test_completion_answers_and_reuses_the_cached_prefix(worker: Proc) -> None:
    prompt = list(range(1000, 1064))  # 4 full blocks of 16
    status, _, first = post_json(
        worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 5}
    )
    assert status == 200
    assert first["choices"][0]["token_ids"] == lcg(1063, 5)
    assert first["usage"]["prompt_tokens"] == 64
    assert first["usage"]["completion_tokens"] == 5
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, _, again = post_json(
        worker.http + "/v1/completions", {"prompt": [*prompt, 7, 8], "max_tokens": 2}
    )
    assert status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # another tenant's salt is another namespace: nothing reused
    status, _, salted = post_json(
        worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "t1"}
    )
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_sends_one_chunk_per_token_then_done(worker: Proc) -> None:
    prompt = list(range(2000, 2040))
    status, headers, data = request(
        "POST", worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "stream": True}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert tokens == lcg(2039, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_published_events_carry_the_prompt_block_hashes(worker: Proc) -> None:
    sub = ZmqEventSubscriber(replay_timeout_ms=2000)
    try:
        sub.add_worker(3, worker.ready["events"], worker.ready["replay"])
        assert sub.wait_connected(10)
        prompt = list(range(5000, 5048))  # 3 full blocks
        status, _, _ = post_json(
            worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 1}
        )
        assert status == 200
        want = chain_hashes(prompt, 16, ReuseScope())
        stored: list[int] = []
        cleared = False
        deadline = time.monotonic() + 10
        while not set(want) <= set(stored) and time.monotonic() < deadline:
            for msg in sub.poll(100):
                if isinstance(msg, BatchDelivery):
                    for ev in msg.batch.events:
                        if isinstance(ev.data, Stored):
                            stored += [b.block_hash for b in ev.data.blocks]
                        cleared |= isinstance(ev.data, AllBlocksCleared)
        assert set(want) <= set(stored)
        assert cleared  # seq 0 (replayed: it was sent before this subscriber) is the announce
        assert sub.status(3).state == "ok"
    finally:
        sub.close()


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"{}",
        b'{"prompt": []}',
        b'{"prompt": "hello"}',
        b'{"prompt": [1, -2]}',
        b'{"prompt": [1, 2.5]}',
        b'{"prompt": [true]}',
        b'{"prompt": [2147483648]}',
        b'{"prompt": [[1, 2], [3]]}',  # a batch (one prompt per request)
        b'{"prompt": [[1, 2], "a"]}',
        b'{"prompt": [1], "max_tokens": 0}',
        b'{"prompt": [1], "max_tokens": "3"}',
        b'{"prompt": [1], "cache_salt": 5}',
        b'{"prompt": [1], "max_tokens": 2000}',  # 2001 tokens > 64 blocks of 16
        b"[1, 2, 3]",
    ],
)
def test_bad_requests_get_400_with_a_json_error(worker: Proc, body: bytes) -> None:
    status, headers, data = request("POST", worker.http + "/v1/completions", raw=body)
    assert status == 400, data
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(data)["error"]["type"] == "invalid_request_error"


def test_unknown_paths_and_methods_are_json_4xx(worker: Proc) -> None:
    status, _, data = request("GET", worker.http + "/nope")
    assert status == 404 and json.loads(data)["error"]["code"] == 404
    status, _, data = request("GET", worker.http + "/v1/completions")
    assert status == 405 and "error" in json.loads(data)


def test_stats_count_what_was_served(worker: Proc) -> None:
    before = get_json(worker.http + "/stats")
    prompt = list(range(9000, 9032))
    post_json(worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    post_json(worker.http + "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    after = get_json(worker.http + "/stats")
    assert after["requests"] - before["requests"] == 2
    assert after["generated_tokens"] - before["generated_tokens"] == 6
    # an identical prompt reuses all but its last token (kvcache: the engine always computes
    # the last token; the partial reuse of the second block covers 15 of its 16)
    assert after["cached_tokens"] - before["cached_tokens"] == 31
