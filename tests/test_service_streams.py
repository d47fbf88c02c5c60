"""Honest answers: a worker that fails while the router relays its answer never looks like a
complete one (engine-shaped stand-ins, tests/engine_standins.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from engine_standins import EngineStandIn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_service_engines import _all_up, prefix, run, until

from router_sim.service.core import RouterService
from router_sim.service.proxy import _StreamEnd

pytestmark = pytest.mark.timeout(60)


def events(data: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    return [e[len("data: ") :] for e in data.decode().split("\n\n") if e.startswith("data: ")]


async def stream(
    client: TestClient[Any, Any], path: str, body: dict[str, Any]
) -> tuple[int, int, list[str]]:
    resp = await client.post(path, json={**body, "stream": True, "max_tokens": 4})
    data = await resp.read()
    return resp.status, int(resp.headers.get("X-Router-Worker", -1)), events(data)


@pytest.mark.parametrize("fault", ["cut", "short"])
def test_a_stream_that_breaks_ends_with_an_error_event_naming_the_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        if fault == "cut":
            ins[0].cut_after = 2  # the engine dies after two chunks
        else:
            ins[0].end_without_done = True  # the stream ends cleanly but short
        status, worker, got = await stream(client, "/v1/completions", {"prompt": prefix(0)})
        assert status == 200 and worker == 0
        assert "[DONE]" not in got
        tokens = [json.loads(e) for e in got[:-1]]
        assert [t["choices"][0]["text"] for t in tokens] == (
            ["w0", "w1"] if fault == "cut" else ["w0", "w1", "w2", "w3"]
        )
        error = json.loads(got[-1])["error"]
        assert error["code"] == 502 and error["type"] == "server_error"
        assert "worker 0 failed mid-stream" in error["message"]
        assert any("worker 0 failed mid-stream" in r.getMessage() for r in caplog.records)
        # the service is fine: the next answer is whole
        ins[0].cut_after, ins[0].end_without_done = None, False
        status, _, got = await stream(client, "/v1/completions", {"prompt": prefix(1)})
        assert status == 200 and got[-1] == "[DONE]"

    caplog.set_level(logging.WARNING, logger="router_sim.service")
    run(tmp_path, ["vllm"], scenario)


def test_a_whole_stream_is_relayed_as_the_engine_sent_it(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        status, _, got = await stream(
            client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2"}]}
        )
        assert status == 200
        assert got[-1] == "[DONE]" and len(got) == 4 + 2
        assert [json.loads(e)["choices"][0]["delta"].get("content") for e in got[:4]] == [
            "w0",
            "w1",
            "w2",
            "w3",
        ]
        assert not any("error" in json.loads(e) for e in got[:-1])

    run(tmp_path, ["vllm"], scenario)


def test_a_broken_unstreamed_answer_is_a_502_naming_the_worker_and_is_not_retried(
    tmp_path: Path,
) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        for s in ins:
            s.cut_after = 0  # whichever is chosen drops the connection before answering
        resp = await client.post("/v1/completions", json={"prompt": prefix(2), "max_tokens": 2})
        assert resp.status == 502
        body = await resp.json()
        worker = int(resp.headers["X-Router-Worker"]) if "X-Router-Worker" in resp.headers else None
        assert body["error"]["type"] == "bad_gateway"
        chosen = [s.worker_id for s in ins if s.bodies]
        assert len(chosen) == 1 and sum(len(s.bodies) for s in ins) == 1  # sent once, no retry
        assert f"worker {chosen[0]} failed" in body["error"]["message"]
        assert worker in (None, chosen[0])

    run(tmp_path, ["vllm", "vllm"], scenario)


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.lists(st.integers(0, 200), max_size=6))
def test_the_done_marker_is_found_however_the_stream_is_cut(done: bool, cuts: list[int]) -> None:
    body = b'data: {"choices": [{"text": "a"}]}\n\n' * 3 + (b"data: [DONE]\n\n" if done else b"")
    points = sorted({min(c, len(body)) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    end = _StreamEnd()
    for piece in pieces:
        end.see(piece)
    assert end.done == done


def test_openais_own_client_sees_a_truncated_stream_as_an_error(tmp_path: Path) -> None:
    """What a user runs: the ``openai`` package against the router. A broken stream raises
    instead of returning normally with ``finish_reason=None``; models, text and chat work."""
    openai = pytest.importorskip("openai")

    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none")
        try:
            assert [m.id async for m in api.models.list()] == ["test-model"]
            done = await api.completions.create(model="test-model", prompt="w1 w2", max_tokens=2)
            assert done.usage.prompt_tokens == 3 and done.choices[0].finish_reason == "length"
            messages = [{"role": "user", "content": "w1"}]
            ins[0].cut_after = 2
            seen = []
            with pytest.raises(openai.APIError, match="worker 0 failed mid-stream"):
                stream = await api.chat.completions.create(
                    model="test-model", messages=messages, max_tokens=4, stream=True
                )
                async for chunk in stream:
                    seen.append(chunk.choices[0].delta.content)
            assert seen == ["w0", "w1"]
        finally:
            await api.close()

    run(tmp_path, ["vllm"], scenario)
