"""Text and chat prompts through the model's tokenizer: the router hashes what the engine will
see. The tokenizer is made in the test (tests/tokenizer_fixture.py), so each expected id is
derived by hand from its vocabulary."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from engine_standins import EngineStandIn
from hypothesis import given, settings
from hypothesis import strategies as st
from service_procs import fleet_file, poll, post_json, start_serve, start_worker, workers_by_id
from test_service_engines import _all_up, overlap, run, until
from tokenizer_fixture import BOS, ROLE_IDS, make_tokenizer, word, words

from router_sim.service.core import RouterService
from router_sim.service.protocol import BadRequest, read_prompts
from router_sim.service.proxy import INLINE_CHARS
from router_sim.service.tokenizer import PromptTokenizer, TokenizerError

pytestmark = pytest.mark.timeout(60)
TPB = 16


def test_text_and_chat_ids_are_those_derived_by_hand(tmp_path: Path) -> None:
    tok = PromptTokenizer.load(make_tokenizer(tmp_path))
    assert tok.encode("w1 w2") == [BOS, word(1), word(2)]
    assert tok.encode("w1 w2", add_special_tokens=False) == [word(1), word(2)]
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]
    assert tok.render_chat(messages) == "<s><|system|> w1 w2 <|user|> w3 <|assistant|>"
    want = [BOS, ROLE_IDS["system"], word(1), word(2), ROLE_IDS["user"], word(3)]
    assert tok.encode_chat(messages) == [*want, ROLE_IDS["assistant"]]
    assert tok.encode_chat(messages, add_generation_prompt=False) == want


def test_the_template_is_found_where_models_ship_it(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path, template=None)
    assert PromptTokenizer.load(folder).chat_template is None
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = PromptTokenizer.load(folder)
    assert tok.render_chat([{"role": "user", "content": "w5"}]) == "w5!"
    assert (
        PromptTokenizer.load(folder / "tokenizer.json").chat_template
        == "{{ messages[0]['content'] }}!"
    )
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "d"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert PromptTokenizer.load(folder).chat_template == "d"


def test_a_tokenizer_that_cannot_be_loaded_names_its_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=str(tmp_path / "nowhere")):
        PromptTokenizer.load(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=str(bad)):
        PromptTokenizer.load(bad)
    folder = make_tokenizer(tmp_path / "t", template="{% for %}")
    with pytest.raises(TokenizerError, match="does not parse"):
        PromptTokenizer.load(folder)


def test_a_template_that_refuses_the_messages_is_a_bad_request(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path, template="{{ raise_exception('no system role') }}")
    with pytest.raises(BadRequest, match="no system role"):
        PromptTokenizer.load(folder).render_chat([{"role": "user", "content": "w1"}])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**32) | st.floats() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_any_prompt_value_is_read_or_refused_with_a_bad_request(value: Any) -> None:
    try:
        prompts = read_prompts(value)
    except BadRequest:
        return
    assert prompts
    for p in prompts:
        if isinstance(p, str):
            assert p
        else:
            assert p and all(type(t) is int and 0 <= t < 2**31 for t in p)


# ------------------------------------------------------------------ through the router


def test_text_and_chat_route_to_the_blocks_the_engine_announced(tmp_path: Path) -> None:
    """The engine tokenizes on its own (tests/engine_standins.py); the router's hashes of
    its own tokenization must find the blocks the engine announced for them."""
    text = words(range(word(100), word(164)))  # 64 words: <s> + 64 ids = 4 full blocks + 1
    ids = [BOS, *range(word(100), word(164))]
    chat = [{"role": "user", "content": words(range(word(200), word(262)))}]
    chat_ids = [BOS, ROLE_IDS["user"], *range(word(200), word(262)), ROLE_IDS["assistant"]]

    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        body = {"prompt": text, "max_tokens": 2, "temperature": 0.5}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        w = int(resp.headers["X-Router-Worker"])
        assert ins[w].bodies[-1] == body  # forwarded as the client sent it
        assert ins[w].prompts[-1] == ids
        await until("text blocks indexed", lambda: _overlap_is(client, ids, w, 4))
        by_text = await (await client.post("/route", json={"prompt": text})).json()
        by_ids = await (await client.post("/route", json={"prompt": ids})).json()
        for key in ("worker", "overlaps", "num_tokens", "num_blocks"):
            assert by_text[key] == by_ids[key], key
        resp = await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 2})
        assert resp.status == 200, await resp.text()
        w = int(resp.headers["X-Router-Worker"])
        assert ins[w].prompts[-1] == chat_ids
        await until("chat blocks indexed", lambda: _overlap_is(client, chat_ids, w, 4))
        by_chat = await (await client.post("/route", json={"messages": chat})).json()
        assert by_chat["num_tokens"] == len(chat_ids) and by_chat["overlaps"][str(w)] == 4
        # a batch of text prompts is routed per prompt on /route
        batch = await (await client.post("/route", json={"prompt": [text, "w1 w2"]})).json()
        assert [d["num_tokens"] for d in batch["decisions"]] == [len(ids), 3]
        batch = await (await client.post("/route", json={"prompt": [ids]})).json()
        assert [d["overlaps"] for d in batch["decisions"]] == [by_ids["overlaps"]]

    run(tmp_path, ["vllm", "sglang"], scenario)


async def _overlap_is(client: TestClient[Any, Any], ids: list[int], w: int, n: int) -> bool:
    return await overlap(client, ids, w) == n


BAD = [
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty list"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "an object"),
    ("/v1/completions", {"prompt": "w1", "model": "nope"}, 404, "test-model"),
    ("/v1/completions", {"prompt": "w1 " * 5000}, 400, "context is 4096"),
    ("/v1/completions", {"prompt": "w1 " * 4000, "max_tokens": 200}, 400, "200 to generate"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "only text parts",
    ),
    ("/route", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/route", {"messages": [{"role": "user"}]}, 400, "needs content"),
]


def test_bad_prompts_are_a_clear_4xx_and_leave_the_service_healthy(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        for path, body, status, says in BAD:
            resp = await client.post(path, json=body)
            got = await resp.json()
            assert resp.status == status, (path, body, got)
            assert says in got["error"]["message"], (path, body, got)
            assert got["error"]["code"] == status
        assert not any(s.bodies for s in ins)  # nothing bad reached an engine
        assert (await client.get("/healthz")).status == 200
        resp = await client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1})
        assert resp.status == 200

    run(tmp_path, ["vllm"], scenario)


def test_a_router_without_a_tokenizer_says_how_to_give_one(tmp_path: Path) -> None:
    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        resp = await client.post("/v1/completions", json={"prompt": "w1 w2"})
        assert resp.status == 400
        assert "--tokenizer" in (await resp.json())["error"]["message"]

    run(tmp_path, ["vllm"], scenario, router_tokenizer=False)


def test_long_prompts_are_tokenized_off_the_event_loop(tmp_path: Path) -> None:
    threads: list[str] = []

    async def scenario(
        client: TestClient[Any, Any], svc: RouterService, ins: list[EngineStandIn]
    ) -> None:
        await until("up", lambda: _all_up(client))
        tok = svc.model_view(None).tokenizer
        assert tok is not None
        encode = tok.encode

        def spy(text: str, *, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.current_thread().name)
            return encode(text, add_special_tokens=add_special_tokens)

        tok.encode = spy  # type: ignore[method-assign]
        short, long = "w1 w2", words(range(word(0), word(600)))
        assert len(short) <= INLINE_CHARS < len(long)
        for body in (
            {"prompt": short},
            {"prompt": long},
            {"messages": [{"role": "user", "content": long}]},
        ):
            resp = await client.post("/route", json=body)
            assert resp.status == 200, await resp.text()
        assert threads[0] == threading.main_thread().name
        assert all(t.startswith("router-tokenize") for t in threads[1:]), threads

    run(tmp_path, ["vllm"], scenario)


def test_a_native_worker_with_a_tokenizer_takes_text_and_chat_as_an_engine_does(
    tmp_path: Path,
) -> None:
    folder = make_tokenizer(tmp_path)
    plain = start_worker(0)
    worker = start_worker(1, tokenizer=str(folder))
    serve = None
    try:
        text = words(range(word(300), word(340)))  # <s> + 40 ids: 2 full blocks + 9
        status, _, got = post_json(worker.http + "/v1/completions", {"prompt": text})
        assert status == 200 and got["usage"]["prompt_tokens"] == 41
        chat = {"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 2}
        status, _, got = post_json(worker.http + "/v1/chat/completions", chat)
        assert status == 200, got
        assert got["usage"]["prompt_tokens"] == 5  # <s> <|user|> w7 w8 <|assistant|>
        assert got["object"] == "chat.completion" and got["choices"][0]["message"]["content"]
        status, _, got = post_json(plain.http + "/v1/completions", {"prompt": text})
        assert status == 400 and "--tokenizer" in got["error"]["message"]
        # through the router: routed by the same ids, the second time served from cache
        fleet = fleet_file(tmp_path / "fleet.json", [worker])
        serve = start_serve(fleet, "--tokenizer", str(folder))
        poll("worker up", lambda: workers_by_id(serve)[1]["up"])
        routed = words(range(word(400), word(440)))  # not sent before
        body = {"prompt": routed, "max_tokens": 1}
        status, _, first = post_json(serve.http + "/v1/completions", body)
        # only the <s> its earlier prompts began with (a partial first block is reused)
        assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
        ids = [BOS, *range(word(400), word(440))]

        def indexed() -> bool:
            return bool(post_json(serve.http + "/route", {"prompt": ids})[2]["overlaps"]["1"] == 2)

        poll("the routed text's blocks indexed under its ids", indexed)
        status, _, again = post_json(serve.http + "/v1/completions", body)
        # all but the last of its 41 tokens (two full blocks and the partial third it stored)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    finally:
        for p in (serve, worker, plain):
            if p is not None:
                p.stop()
