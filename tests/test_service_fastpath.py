"""The router service's request path under load: event rounds applied in slices, the event
loop it runs on, and several serve processes sharing one port."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_procs import Proc, _start, get_json, request

from router_sim.service.app import _runner
from router_sim.service.protocol import (
    UNCHECKED_IDS_MAX_BYTES,
    BadRequest,
    RouteBody,
    RouteRequest,
    json_answer,
    parse_body,
    parse_route_body,
)
from router_sim.service.pump import EventPump, PumpItem, WorkerRemoved

pytestmark = pytest.mark.timeout(60)


def _spin(seconds: float) -> None:
    """Hold the loop (and the GIL) for ``seconds`` of work, as applying a batch does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_large_round_is_applied_in_slices_and_requests_run_between_them() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        timeline: list[str] = []
        slices: list[float] = []

        def apply(items: list[PumpItem]) -> None:
            for item in items:
                assert isinstance(item, WorkerRemoved)
                _spin(0.0004)
                timeline.append(f"item {item.worker}")

        pump = EventPump(loop, apply, slice_s=0.001, on_slice=slices.append)
        items: list[PumpItem] = [WorkerRemoved(w) for w in range(20)]
        handed = threading.Event()

        def pump_thread() -> None:
            pump._hand_over(items)  # returns once the whole round is applied
            handed.set()

        # a request that arrives once the round started must not wait for the whole round
        def request_arrives() -> None:
            timeline.append("request")

        def on_first_item() -> None:
            if not timeline:
                loop.call_soon(on_first_item)
                return
            loop.call_soon(request_arrives)

        loop.call_soon(on_first_item)
        thread = threading.Thread(target=pump_thread)
        thread.start()
        deadline = time.monotonic() + 10
        while not handed.is_set():
            assert time.monotonic() < deadline, "the round was never applied"
            await asyncio.sleep(0.001)  # let the loop run the slices
        thread.join(5)
        applied = [t for t in timeline if t != "request"]
        assert applied == [f"item {w}" for w in range(20)]  # every message, in order
        assert 3 <= len(slices) <= 20  # 20 x 0.4 ms in slices of ~1 ms
        assert max(slices) < 0.5  # each slice stops soon after its budget (loose: CI noise)
        position = timeline.index("request")
        assert 0 < position < len(timeline) - 1  # it ran between two slices, not after all

        pump.stop()
        pump._sub.close()  # the pump's thread, which closes it, never ran

    asyncio.run(scenario())


ROUTE_BODIES = [
    b'{"prompt": [1, 2, 3]}',
    b'{"prompt": [0, 2147483647], "lora_id": 18446744073709551615, "cache_salt": "t"}',
    b'{"prompt": [5], "lora_name": "a", "temperature": 0.5, "extra": {"x": [1]}}',
    b'{"prompt": [5], "lora_id": null, "lora_name": null, "cache_salt": null}',
    b'{"prompt": [1, true]}',
    b'{"prompt": [1, 2.0]}',
    b'{"prompt": [1, "2"]}',
    b'{"prompt": [-1]}',
    b'{"prompt": [2147483648]}',
    b'{"prompt": []}',
    b'{"prompt": 7}',
    b"{}",
    b"[1, 2]",
    b'{"prompt": [1], "lora_id": -1}',
    b'{"prompt": [1], "lora_id": 18446744073709551616}',
    b'{"prompt": [1], "lora_id": 1.5}',
    b'{"prompt": [1], "lora_name": 3}',
    b'{"prompt": [1], "cache_salt": "' + b"s" * 4097 + b'"}',
    b'{"prompt": [1]',
    b"",
    # spellings of the prompt: the plain ones are read natively, the others by msgspec
    b'{"prompt":[1,2,3]}',
    b'{"prompt": [ 1 ,\n\t2\r, 3 ] }',
    b'{"prompt": [0, 10, 100]}',
    b'{"prompt": [01]}',
    b'{"prompt": [1e3]}',
    b'{"prompt": [1.5]}',
    b'{"prompt": [-0]}',
    b'{"prompt": [1,]}',
    b'{"prompt": [,1]}',
    b'{"prompt": [1 2]}',
    b'{"prompt": [[1]]}',
    b'{"prompt": [99999999999999999999999]}',
    b'{"prompt": [1], "prompt": [2]}',
    b'{"prompt": [1],}',
    b'{"prompt": [1]} x',
    b'{"prompt": [1]}\n',
    b'{"prompt": [1] , "lora_id": 3, "cache_salt": "s", "extra": [1, {"a": 2}]}',
    b'{"prompt": [1], "lora_id": 3, "prompt": [2]}',
    b'{"prompt": [1], "lora_id": 3,}',
    b'{"prompt": [1], "lora_id": 18446744073709551615}',
    b'{"prompt": [1], "lora_id": 18446744073709551616}',
    b'{"prompt": [1], "cache_salt": 5}',
    b'{"prompt": [1], ,"lora_id": 3}',
    b'{"prompt": [1]}}',
]


def _read_like_the_pydantic_model(raw: bytes) -> None:
    """``parse_route_body`` accepts and refuses ``raw`` as ``RouteBody`` does, with the same
    values."""
    try:
        want: RouteBody | None = parse_body(RouteBody, raw)
    except BadRequest:
        want = None
    if want is None:
        with pytest.raises(BadRequest):
            parse_route_body(raw)
        return
    got = parse_route_body(raw)
    assert (list(got.prompt), got.lora_id, got.lora_name, got.cache_salt) == (
        want.prompt,
        want.lora_id,
        want.lora_name,
        want.cache_salt,
    )


@pytest.mark.parametrize("raw", ROUTE_BODIES)
def test_route_json_bodies_are_read_like_the_pydantic_model(raw: bytes) -> None:
    """``POST /route`` reads JSON with msgspec; it accepts and refuses what ``RouteBody``
    (the model the worker and the completions proxy use) does, with the same values."""
    _read_like_the_pydantic_model(raw)


@st.composite
def _json_prompts(draw: st.DrawFn) -> bytes:
    """A JSON array of ids (some out of range) with random whitespace, often damaged."""
    ids = draw(st.lists(st.integers(-3, 2**31 + 3) | st.integers(0, 99), max_size=12))
    ws = st.sampled_from(["", " ", "\n", "\t", "\r", "  "])
    body = draw(ws) + "[" + ",".join(draw(ws) + str(t) + draw(ws) for t in ids) + "]" + draw(ws)
    data = body.encode()
    if draw(st.booleans()):  # damage: a byte replaced, inserted or cut
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"", b"0", b".", b"e", b"-", b",", b"]", b"[", b"x", b"1"]))
        cut = draw(st.integers(0, 1))
        data = data[:at] + junk + data[at + cut :]
    return data


@st.composite
def _route_bodies(draw: st.DrawFn) -> bytes:
    """Route bodies in many spellings: the prompt first or not, other members, whitespace,
    sometimes damaged."""
    ws = st.sampled_from(["", " ", "\n", "  "])
    members = [f'"prompt"{draw(ws)}:{draw(ws)}{draw(_json_prompts()).decode()}']
    others = {
        "lora_id": st.sampled_from(["3", "-1", "18446744073709551616", "null", "1.5"]),
        "lora_name": st.sampled_from(['"a"', "3", "null"]),
        "cache_salt": st.sampled_from(['"s"', "5", "null"]),
        "extra": st.sampled_from(["[1, {}]", '"x"']),
        "prompt": st.sampled_from(["[9]", "[]"]),
    }
    # a name once (but "prompt" twice): with a member repeated, pydantic keeps the last
    # value, msgspec refuses an earlier one it cannot read (stricter, and left as it is)
    for name in draw(st.lists(st.sampled_from(sorted(others)), max_size=3, unique=True)):
        members.append(f'"{name}":{draw(ws)}{draw(others[name])}')
    if draw(st.booleans()):
        members = draw(st.permutations(members))
    data = ("{" + draw(ws) + f"{draw(ws)},{draw(ws)}".join(members) + draw(ws) + "}").encode()
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"", b",", b"}", b"{", b"x", b'"', b" "]))
        data = data[:at] + junk + data[at + draw(st.integers(0, 1)) :]
    return data


@settings(max_examples=600, deadline=None)
@given(_route_bodies())
def test_route_bodies_in_any_spelling_are_read_like_the_pydantic_model(raw: bytes) -> None:
    _read_like_the_pydantic_model(raw)


def _read_unchecked_like_the_checked_reading(raw: bytes) -> None:
    """``parse_route_body(raw, check_ids=False)`` reads what the checked reading reads, with
    the same values, and besides only bodies whose every other member reads as in the
    checked reading and whose prompt holds an int outside the token ids' range."""
    try:
        want: RouteRequest | None = parse_route_body(raw)
    except BadRequest:
        want = None
    try:
        got: RouteRequest | None = parse_route_body(raw, check_ids=False)
    except BadRequest:
        got = None
    if want is not None:
        assert got == want
    elif got is not None:
        assert any(type(t) is not int or not 0 <= t < 2**31 for t in got.prompt)
        ok = json.dumps({**json.loads(raw), "prompt": [0]}).encode()
        assert parse_route_body(ok)[1:] == got[1:]


@settings(max_examples=600, deadline=None)
@given(_route_bodies())
def test_route_bodies_read_unchecked_are_those_read_checked_or_with_an_id_out_of_range(
    raw: bytes,
) -> None:
    _read_unchecked_like_the_checked_reading(raw)


def test_ids_out_of_range_are_read_unchecked_only_when_asked_and_in_a_small_body() -> None:
    raw = json.dumps({"prompt": [1, -1, 2**31, 2**64], "lora_id": 3}).encode()
    with pytest.raises(BadRequest, match=r"Expected `int` >= 0 - at `\$.prompt\[1\]`"):
        parse_route_body(raw)
    got = parse_route_body(raw, check_ids=False)
    assert got == RouteRequest([1, -1, 2**31, 2**64], 3, None, None)
    # a larger body is read checked: its ids are refused at the first bad one
    big = json.dumps({"prompt": [-1] + [7] * (UNCHECKED_IDS_MAX_BYTES // 3)}).encode()
    assert len(big) > UNCHECKED_IDS_MAX_BYTES
    with pytest.raises(BadRequest, match="Expected `int` >= 0"):
        parse_route_body(big, check_ids=False)
    good = json.dumps({"prompt": [7] * (UNCHECKED_IDS_MAX_BYTES // 3)}).encode()
    assert len(parse_route_body(good, check_ids=False).prompt) == UNCHECKED_IDS_MAX_BYTES // 3


def test_json_answers_encode_like_the_standard_library() -> None:
    body = {"worker": 3, "costs": {0: 1.5, 2: 2.0}, "reason": "lowest cost", "none": None}
    resp = json_answer(body, status=201)
    assert resp.status == 201 and resp.content_type == "application/json"
    assert isinstance(resp.body, bytes)
    assert json.loads(resp.body) == json.loads(json.dumps(body))


def test_the_event_loop_choice() -> None:
    assert _runner("asyncio") is asyncio.run
    try:
        import uvloop
    except ImportError:
        with pytest.raises(ValueError, match="not installed"):
            _runner("uvloop")
    else:
        assert _runner("uvloop") is uvloop.run


def _serve(tmp_path: Path, *extra: str) -> Proc:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"tokens_per_block": 16, "workers": []}))
    return _start(["serve", "--fleet", str(fleet), *extra])


def test_serve_processes_share_a_port_with_reuse_port(tmp_path: Path) -> None:
    procs: list[Proc] = []
    try:
        first = _serve(tmp_path, "--port", "0", "--reuse-port", "--event-loop", "asyncio")
        procs.append(first)
        port = first.http.rsplit(":", 1)[1]
        second = _serve(tmp_path, "--port", port, "--reuse-port")
        procs.append(second)
        assert second.http == first.http
        assert get_json(first.http + "/healthz")["status"] == "ok"
        # a third without the option is refused the port, with a one-line error
        fleet = tmp_path / "fleet.json"
        with pytest.raises(RuntimeError, match="did not start"):
            procs.append(_start(["serve", "--fleet", str(fleet), "--port", port], 10.0))
        first.stop()  # the other one keeps serving the port
        status, _, data = request("GET", second.http + "/healthz")
        assert status == 200, data
    finally:
        for p in procs:
            p.stop()
