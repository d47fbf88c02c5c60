"""The OpenAI-style side of ``router-sim serve``: completions and chat completions routed by
their tokens and relayed to the chosen worker, text prompts on ``POST /route``, the fleet's
model list.

A prompt is routed by the token ids the engine will see: ids as sent, text through the
model's tokenizer (special tokens added, as engines do for completions), chat messages
through the model's chat template (:mod:`router_sim.service.tokenizer`). The request is
forwarded to the worker as the client sent it; the answer carries ``X-Router-Worker``.

Failures, told honestly: a worker that refuses the connection is skipped until its probe
answers again and the request goes to the next choice (up to :data:`MAX_ATTEMPTS` workers):
nothing had been sent, so nothing is repeated. Once the worker accepted the request there is
no retry. A non-streamed answer that breaks is a 502 naming the worker; a stream that breaks,
or ends without its ``data: [DONE]``, after chunks were relayed ends with an OpenAI-shaped
error event (``data: {"error": {...}}``: OpenAI's clients raise on it) and no ``[DONE]``, so
a truncated answer never looks complete; the log names the worker and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import aiohttp
from aiohttp import web

from router_sim.router.policies import NoWorkersError
from router_sim.router.routing import RoutingDecision
from router_sim.service import tokenizer
from router_sim.service.core import SERVICE, ModelView, RouterService
from router_sim.service.protocol import (
    BadRequest,
    ChatBody,
    CompletionBody,
    Prompt,
    TextRouteBody,
    error_response,
    json_answer,
    parse_body,
    read_body,
    read_prompts,
)
from router_sim.service.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_ATTEMPTS: Final = 3
"""Workers tried per request when the chosen one refuses the connection (it died since its
last health probe); each refusal takes that worker out of routing until it answers again."""

_DONE: Final = b"data: [DONE]"


def no_workers(exc: NoWorkersError) -> web.Response:
    return error_response(503, f"no worker is available: {exc}", "service_unavailable")


# ------------------------------------------------------------------ prompts


def _tokenizer(view: ModelView) -> PromptTokenizer:
    if view.tokenizer is None:
        model = "" if view.name is None else f" for the model {view.name!r}"
        raise BadRequest(
            f"this router has no tokenizer{model}: send token ids, or start it with "
            "--tokenizer PATH (or the fleet file's models.NAME.tokenizer)"
        )
    return view.tokenizer


INLINE_CHARS: Final = 2048
"""Text up to this long is tokenized on the event loop; longer text on the service's
tokenizer threads (the ``tokenizers`` library releases the GIL while it encodes, and an
8,192-token prompt takes ~10 ms of CPU here, which no other request should wait for)."""


async def off_loop(svc: RouterService, chars: int, fn: Callable[[], T]) -> T:
    """``fn()`` on the loop when its text is short, else on the tokenizer threads."""
    if chars <= INLINE_CHARS:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(svc.tokenizer_threads, fn)


def _chars(messages: ChatBody) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else 0 for m in messages.messages)


def prompt_ids(view: ModelView, prompt: Prompt, add_special_tokens: bool | None) -> Sequence[int]:
    """The ids the engine sees for ``prompt`` (see :func:`.tokenizer.prompt_ids`)."""
    if not isinstance(prompt, str):
        return prompt
    return tokenizer.prompt_ids(_tokenizer(view), prompt, add_special_tokens)


def chat_ids(view: ModelView, body: ChatBody) -> list[int]:
    """The ids the engine sees for ``body``'s messages (see :func:`.tokenizer.chat_body_ids`)."""
    return tokenizer.chat_body_ids(_tokenizer(view), body)


def check_context(view: ModelView, prompt_tokens: int, max_tokens: int | None) -> None:
    """A 400, as the engine would answer, for a prompt beyond the model's context."""
    limit = view.max_model_len
    if limit is None:
        return
    want = prompt_tokens + (max_tokens or 0)
    if prompt_tokens >= limit or want > limit:
        more = f" + {max_tokens} to generate" if max_tokens else ""
        raise BadRequest(
            f"the model's context is {limit} tokens; this request has {prompt_tokens} in "
            f"its prompt{more}"
        )


# ------------------------------------------------------------------ handlers


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``: any of OpenAI's prompt forms, one prompt per request."""
    svc = request.app[SERVICE]
    raw = await read_body(request)
    body = parse_body(CompletionBody, raw)
    prompts = read_prompts(body.prompt)
    if len(prompts) > 1:
        raise BadRequest(
            f"prompt: a batch of {len(prompts)} prompts; send one prompt per request (each "
            "is routed to the worker that holds its prefix), or ask POST /route for all"
        )
    view = svc.model_view(body.model)
    prompt = prompts[0]
    ids = await off_loop(
        svc,
        len(prompt) if isinstance(prompt, str) else 0,
        lambda: prompt_ids(view, prompt, body.add_special_tokens),
    )
    check_context(view, len(ids), body.max_tokens)
    lora = svc.resolve_lora(body.lora_id, body.lora_name, body.model)
    if lora != body.lora_id:  # resolved from a name: the worker keys its cache by the id
        raw = json.dumps({**json.loads(raw), "lora_id": lora}).encode()
    return await relay(
        request, svc, raw, ids, lora, body.cache_salt, view, "/v1/completions", body.stream
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: routed by the tokens of the rendered chat template."""
    svc = request.app[SERVICE]
    raw = await read_body(request)
    body = parse_body(ChatBody, raw)
    view = svc.model_view(body.model)
    ids = await off_loop(svc, _chars(body) or INLINE_CHARS + 1, lambda: chat_ids(view, body))
    check_context(view, len(ids), body.max_completion_tokens or body.max_tokens)
    lora = svc.resolve_lora(body.lora_id, body.lora_name, body.model)
    return await relay(
        request, svc, raw, ids, lora, body.cache_salt, view, "/v1/chat/completions", body.stream
    )


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: what the fleet serves, in OpenAI's shape."""
    svc = request.app[SERVICE]
    data = []
    now = int(time.time())
    for name, found in sorted(svc.served_models().items()):
        card = found["card"]
        data.append(
            {
                "id": name,
                "object": "model",
                "created": card.get("created", now),
                "owned_by": card.get("owned_by", "router-sim"),
                "root": card.get("root", name),
                "parent": card.get("parent"),
                "max_model_len": svc.model_view(name).max_model_len,
            }
        )
    return json_answer({"object": "list", "data": data})


async def route_text(svc: RouterService, raw: bytes) -> web.Response | None:
    """``POST /route`` with text, a batch or chat messages; None when the body is none of
    those (the caller then reports the token-id reading's error)."""
    try:
        body = parse_body(TextRouteBody, raw)
    except BadRequest:
        return None
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give either prompt or messages")
    view = svc.model_view(body.model)
    lora = svc.resolve_lora(body.lora_id, body.lora_name, body.model)
    if body.messages is not None:
        chat = body.as_chat()
        prompts: list[Sequence[int]] = [
            await off_loop(svc, _chars(chat), lambda: chat_ids(view, chat))
        ]
    else:
        read = read_prompts(body.prompt)
        if not _is_batch(body.prompt) and not isinstance(read[0], str):
            return None  # plain token ids: the fast reader's error stands
        size = sum(len(p) for p in read if isinstance(p, str))
        prompts = await off_loop(
            svc, size, lambda: [prompt_ids(view, p, body.add_special_tokens) for p in read]
        )
    decisions = []
    for ids in prompts:
        check_context(view, len(ids), None)
        try:
            d = svc.decide(
                ids, lora, body.cache_salt, workers=view.workers, lora_name=view.lora_name
            )
        except NoWorkersError as exc:
            return no_workers(exc)
        decisions.append(svc.explain(d))
    if _is_batch(body.prompt):
        return json_answer({"decisions": decisions})
    return json_answer(decisions[0])


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


# ------------------------------------------------------------------ relaying


async def relay(
    request: web.Request,
    svc: RouterService,
    raw: bytes,
    ids: Sequence[int],
    lora: int | None,
    salt: str | None,
    view: ModelView,
    path: str,
    stream: bool,
) -> web.StreamResponse:
    """Route ``ids`` and forward ``raw`` to the chosen worker's ``path``; the next choice
    when a worker refuses the connection (see the module docstring)."""
    refused: list[str] = []
    for _ in range(MAX_ATTEMPTS):
        try:
            decision = svc.decide(ids, lora, salt, workers=view.workers, lora_name=view.lora_name)
        except NoWorkersError as exc:
            return no_workers(exc)
        resp = await _forward(request, svc, raw, decision, path, stream, len(ids))
        if resp is not None:
            return resp
        refused.append(str(decision.worker))
    return error_response(
        502, f"workers {', '.join(refused)} refused the connection", "bad_gateway"
    )


class _StreamEnd:
    """Whether a relayed event stream reached its ``data: [DONE]`` (the marker may be split
    across chunks: the tail of the previous chunk is kept)."""

    __slots__ = ("_tail", "done")

    def __init__(self) -> None:
        self.done = False
        self._tail = b""

    def see(self, chunk: bytes) -> None:
        if self.done:
            return
        window = self._tail + chunk  # chunks are single events: small
        if _DONE in window:
            self.done = True
        self._tail = window[1 - len(_DONE) :]


async def _stream_error(resp: web.StreamResponse, worker: int, why: str, relayed: int) -> None:
    """End a relayed stream with an OpenAI-shaped error event (and log why)."""
    log.warning("worker %d failed mid-stream after %d bytes: %s", worker, relayed, why)
    error = {
        "error": {
            "message": f"worker {worker} failed mid-stream: {why}; the answer is incomplete",
            "type": "server_error",
            "code": 502,
        }
    }
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone too
        await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")


async def _forward(
    request: web.Request,
    svc: RouterService,
    raw: bytes,
    decision: RoutingDecision,
    path: str,
    stream: bool,
    prompt_tokens: int,
) -> web.StreamResponse | None:
    """Forward to the decided worker and relay its answer; None when it refused the
    connection (nothing was sent: another worker may take the request)."""
    worker = decision.worker
    url = svc.workers[worker].entry.http + path
    cached = decision.chosen_overlap * svc.fleet.tokens_per_block
    ticket = svc.load.begin(worker, prompt_tokens, cached)
    svc.metrics.inflight.labels(str(worker)).inc()
    headers = {"X-Router-Worker": str(worker)}
    resp: web.StreamResponse | None = None
    outcome = "error"
    relayed = 0
    assert svc.session is not None
    try:
        async with svc.session.post(
            url, data=raw, headers={"Content-Type": "application/json"}
        ) as upstream:
            if not stream or upstream.status != 200:
                data = await upstream.read()
                outcome = str(upstream.status)
                return web.Response(
                    body=data,
                    status=upstream.status,
                    content_type=upstream.content_type,
                    headers=headers,
                )
            resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
            await resp.prepare(request)
            end = _StreamEnd()
            async for chunk in upstream.content.iter_any():
                svc.load.first_token(ticket)
                end.see(chunk)
                relayed += len(chunk)
                await resp.write(chunk)
            if end.done:
                outcome = "200"
            else:
                outcome = "truncated"
                await _stream_error(resp, worker, "its stream ended without [DONE]", relayed)
            await resp.write_eof()
            return resp
    except aiohttp.ClientConnectorError as exc:
        svc.mark_down(worker, f"{type(exc).__name__}: {exc}")
        outcome = "refused"
        return None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        if resp is not None:
            outcome = "broken"
            await _stream_error(resp, worker, why, relayed)
            return resp
        log.warning("worker %d failed: %s", worker, why)
        return error_response(502, f"worker {worker} failed: {why}", "bad_gateway")
    finally:
        svc.load.end(ticket)
        svc.metrics.inflight.labels(str(worker)).dec()
        svc.metrics.proxied.labels(str(worker), outcome).inc()
