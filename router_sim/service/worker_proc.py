"""``router-sim worker``: one simulated engine as a real process, with an OpenAI-style API.

The process runs a :class:`~router_sim.service.engine.LiveEngine` (real KV cache manager, event
manager and ZeroMQ publisher; step times from the simulator's timing model) and serves:

- ``POST /v1/completions``: token-id prompts (text too with ``--tokenizer``), streaming
  (server-sent events, one chunk per token, then ``data: [DONE]``) or not;
  ``usage.prompt_tokens_details.cached_tokens`` says how much of the prompt the cache served;
- ``POST /v1/chat/completions`` with ``--tokenizer``: the messages through its chat template,
  tokenized as an engine does (:mod:`router_sim.service.tokenizer`);
- ``GET /healthz``: liveness, the engine's incarnation (new at every start, so a router can tell
  a restart from a pause), the last published seq, the block size and hash algorithm, the load;
- ``GET /stats``: the engine's counters and its cache's;
- ``GET /v1/models``: the model it serves (``--model``), in OpenAI's shape.

When a subscriber joins, and after ``--heartbeat`` seconds without a batch, the worker
publishes an empty batch: a router that subscribes to an idle worker learns its current seq
from it and replays what it missed (seq 0 onwards), and a lost last batch shows as a gap.

When it is ready it prints one JSON line on stdout, ``{"id", "http", "events", "replay",
"tokens_per_block", "hash_algo", "incarnation"}``: the fleet-file entry for this worker (ports
given as 0 are then the ones the OS chose). ``--count N`` starts N such processes instead and
writes the fleet file for them (``--fleet-out``), so a whole fleet is one command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Final

from aiohttp import web

from events.stream.publisher import ZmqEventPublisher
from events.stream.security import CurveServer, SecurityError, load_allowed_keys, load_keypair
from events.tools.cli_args import (
    MAX_BLOCK_TOKENS,
    TCP_PORT_MAX,
    check_float,
    check_int,
    check_utf8,
)
from kvcache.hashing import HashAlgo
from kvcache.scope import ReuseScope
from router_sim.service.engine import LiveEngine, LiveRequest, RequestTooLarge
from router_sim.service.protocol import (
    MAX_BODY_BYTES,
    BadRequest,
    ChatBody,
    CompletionBody,
    error_response,
    json_errors,
    parse_body,
    read_body,
    read_prompts,
    usage,
)
from router_sim.service.settings import LOG_LEVELS, setup_logging, show_defaults
from router_sim.service.tokenizer import PromptTokenizer, chat_body_ids, prompt_ids
from router_sim.sim.timing import default_step_timing

ENGINE: web.AppKey[LiveEngine] = web.AppKey("engine", LiveEngine)
DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's default for completions
INFO: web.AppKey[dict[str, Any]] = web.AppKey("info", dict)


def _choice(token: int | None, chat: bool, finish_reason: str | None) -> dict[str, Any]:
    text = "" if token is None else f" {token}"
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["delta"] = {} if token is None else {"content": text}
    else:
        choice["text"] = text
    choice["token_ids"] = [] if token is None else [token]
    choice["finish_reason"] = finish_reason
    return choice


def _chunk(
    rid: str, created: int, model: str, token: int | None, chat: bool = False, **extra: Any
) -> bytes:
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(token, chat, extra.pop("finish_reason", None))],
        **extra,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _tokenizer(request: web.Request) -> PromptTokenizer:
    tok: PromptTokenizer | None = request.app[INFO].get("tokenizer")
    if tok is None:
        raise BadRequest(
            "this worker has no tokenizer: send token ids, or start it with --tokenizer PATH"
        )
    return tok


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``: token ids, or text when the worker has a tokenizer."""
    body = parse_body(CompletionBody, await read_body(request))
    prompts = read_prompts(body.prompt)
    if len(prompts) != 1:
        raise BadRequest(f"prompt: one prompt per request, got a batch of {len(prompts)}")
    prompt = prompts[0]
    tok = _tokenizer(request) if isinstance(prompt, str) else None
    ids = prompt_ids(tok, prompt, body.add_special_tokens)
    return await _generate(request, body, ids, body.max_tokens, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: the messages through the tokenizer's chat template."""
    body = parse_body(ChatBody, await read_body(request))
    ids = chat_body_ids(_tokenizer(request), body)
    return await _generate(
        request, body, ids, body.max_completion_tokens or body.max_tokens, chat=True
    )


async def _generate(
    request: web.Request,
    body: CompletionBody | ChatBody,
    ids: list[int],
    max_tokens: int | None,
    *,
    chat: bool,
) -> web.StreamResponse:
    engine = request.app[ENGINE]
    scope = ReuseScope.for_request(lora_id=body.lora_id, cache_salt=body.cache_salt)
    live = LiveRequest(ids, max_tokens or DEFAULT_MAX_TOKENS, scope)
    try:
        engine.submit(live)
    except RequestTooLarge as exc:
        return error_response(400, str(exc))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
    created = int(time.time())
    model = body.model or request.app[INFO]["model"]
    try:
        if not body.stream:
            tokens = [t async for t in _tokens(live)]
            if live.error is not None:
                return error_response(500, f"the engine failed: {live.error}")
            text = "".join(f" {t}" for t in tokens)
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(token_ids=tokens, finish_reason="length")
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage(len(live.prompt), len(tokens), live.cached_tokens),
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 0
        async for t in _tokens(live):
            n += 1
            await resp.write(_chunk(rid, created, model, t, chat))
        if live.error is not None:
            err = {"error": {"message": f"the engine failed: {live.error}", "code": 500}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        final = usage(len(live.prompt), n, live.cached_tokens)
        await resp.write(
            _chunk(rid, created, model, None, chat, finish_reason="length", usage=final)
        )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        if not live.finished:
            engine.cancel(live)  # the client went away (or writing failed)


async def _tokens(live: LiveRequest) -> AsyncIterator[int]:
    while (t := await live.tokens.get()) is not None:
        yield t


async def healthz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    load = engine.load()
    info = request.app[INFO]
    return web.json_response(
        {
            "status": "ok",
            "id": info["id"],
            "incarnation": info["incarnation"],
            "last_seq": engine.publisher.next_seq - 1,
            "tokens_per_block": engine.tokens_per_block,
            "hash_algo": engine.events.hash_algo.value,
            "load": {
                "active_requests": load.active_requests,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "kv_usage": load.kv_usage,
                "decode_blocks": load.decode_blocks,
            },
        }
    )


async def stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    s = engine.stats
    cache = engine.manager.stats
    return web.json_response(
        {
            **dataclasses.asdict(s),
            "cached_blocks": engine.manager.num_cached_blocks,
            "kv_usage": engine.manager.kv_usage(0),
            "cache_hit_tokens": cache.hit_tokens,
            "incarnation": request.app[INFO]["incarnation"],
        }
    )


async def models(request: web.Request) -> web.Response:
    card = {
        "id": request.app[INFO]["model"],
        "object": "model",
        "created": request.app[INFO]["created"],
        "owned_by": "router-sim",
    }
    return web.json_response({"object": "list", "data": [card]})


def build_app(engine: LiveEngine, info: dict[str, Any]) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[INFO] = info
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/v1/models", models)
    return app


async def _heartbeats(engine: LiveEngine, idle_s: float, period_s: float = 0.05) -> None:
    """Publish an empty batch when the publisher gains a subscriber (its XPUB sees each
    subscription) and after ``idle_s`` without any batch (0: never). The first lets a router
    that joins an idle worker replay its history at once; the second bounds how long a lost
    last batch goes unnoticed (a gap is only seen when a later seq arrives)."""
    seen = 0
    while True:
        now = engine.publisher.stats.subscribers
        idle = idle_s > 0 and time.monotonic() - engine.last_publish >= idle_s
        if now > seen or idle:
            engine.heartbeat()
        else:  # an idle engine still answers snapshot requests (None while events are pending)
            engine.publisher.serve_snapshots()
        seen = now
        await asyncio.sleep(period_s)  # the check period


def add_parser(sub: Any) -> None:
    """The ``worker`` subcommand's arguments (``sub``: argparse's subparsers)."""
    p = sub.add_parser("worker", help="run simulated engine(s) serving completions + KV events")
    p.add_argument("--id", type=int, default=0, help="worker id (first id with --count)")
    p.add_argument("--host", default="127.0.0.1", help="interface for HTTP and events")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    p.add_argument("--events-port", type=int, default=0, help="event PUB port (0: any)")
    p.add_argument("--replay-port", type=int, default=0, help="replay ROUTER port (0: any)")
    p.add_argument("--tokens-per-block", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--device-blocks", type=int, default=16384, help="KV blocks of the cache")
    p.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="prompt tokens computed per step"
    )
    p.add_argument(
        "--hash-algo",
        default="v1_block_key",
        help="block hash of its events: v1_block_key, v2_sha256 or v2_sha256_64",
    )
    p.add_argument("--replay-steps", type=int, default=10000, help="batches kept for replay")
    p.add_argument(
        "--speedup", type=float, default=1.0, help="divide every step time by this (> 0)"
    )
    p.add_argument("--model", default="router-sim", help="model name in responses")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer on local disk (tokenizer.json or its directory, with its chat "
        "template): text prompts and POST /v1/chat/completions are tokenized with it",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        help="publish an empty batch after this many idle seconds (0: never)",
    )
    p.add_argument(
        "--curve-key",
        help="this worker's CURVE key pair (.key_secret, from kv-events keygen): the event and "
        "replay sockets then admit only the --curve-allow clients, encrypted",
    )
    p.add_argument(
        "--curve-allow",
        action="append",
        default=[],
        metavar="CLIENT.key",
        help="a router's CURVE public key to admit (repeat for several)",
    )
    p.add_argument("--count", type=int, default=1, help="start this many worker processes")
    p.add_argument("--fleet-out", help="with --count: write the fleet file here")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="least level logged")
    show_defaults(p)


def _curve_server(key_file: str | None, allowed: list[str]) -> CurveServer | None:
    """CURVE settings from ``--curve-key`` and ``--curve-allow`` (both or neither: one alone
    is refused, never a silently plain socket)."""
    if key_file is None and not allowed:
        return None
    if key_file is None or not allowed:
        raise SecurityError("CURVE needs --curve-key and at least one --curve-allow")
    return CurveServer(load_keypair(key_file), load_allowed_keys(allowed))


def _endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port if port else '*'}"


async def serve_worker(args: argparse.Namespace, ready: asyncio.Event | None = None) -> None:
    """Run one worker until cancelled or signalled."""
    if not args.speedup > 0:
        raise ValueError(f"--speedup must be > 0, got {args.speedup}")
    engine: LiveEngine | None = None  # the snapshot provider reads the engine once it exists
    publisher = ZmqEventPublisher(
        _endpoint(args.host, args.events_port),
        replay_endpoint=_endpoint(args.host, args.replay_port),
        buffer_steps=args.replay_steps,
        bind=True,
        snapshot_provider=lambda: None if engine is None else engine.snapshot(),
        curve=_curve_server(args.curve_key, args.curve_allow),
    )
    try:
        engine = LiveEngine(
            tokens_per_block=args.tokens_per_block,
            device_blocks=args.device_blocks,
            timing=default_step_timing(args.speedup),
            publisher=publisher,
            hash_algo=args.hash_algo,
            max_batch_tokens=args.max_batch_tokens,
        )
        engine.announce()
        info = {
            "id": args.id,
            "incarnation": uuid.uuid4().hex,
            "model": args.model,
            "created": int(time.time()),
            "tokenizer": PromptTokenizer.load(args.tokenizer) if args.tokenizer else None,
        }
        runner = web.AppRunner(build_app(engine, info), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"  # the ready line gives an address to connect to
        tasks = [
            asyncio.create_task(engine.run()),
            asyncio.create_task(_heartbeats(engine, args.heartbeat)),
        ]
        line = {
            "id": args.id,
            "http": f"http://{host}:{port}",
            "events": publisher.endpoint,
            "replay": publisher.replay_endpoint,
            "tokens_per_block": args.tokens_per_block,
            "hash_algo": args.hash_algo,
            "incarnation": info["incarnation"],
        }
        print(json.dumps(line), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.close()
            await runner.cleanup()
    finally:
        publisher.close(timeout_s=1.0)


MAX_LOCAL_WORKERS: Final = 256
"""Most processes ``--count`` starts on one machine (each is a Python process of ~40 MB)."""


def check_worker_args(args: argparse.Namespace) -> None:
    """Every flag in range before any process starts (:class:`ArgError` names the flag)."""
    check_int("--count", args.count, 1, MAX_LOCAL_WORKERS)
    check_int("--id", args.id, 0, 2**31 - 1)
    for flag, port in (
        ("--port", args.port),
        ("--events-port", args.events_port),
        ("--replay-port", args.replay_port),
    ):
        # --count N takes N ports (events and replay: 2N) from each base
        span = 2 * args.count if flag != "--port" else args.count
        check_int(flag, port, 0, TCP_PORT_MAX - span if port else 0)
    check_int("--tokens-per-block", args.tokens_per_block, 1, MAX_BLOCK_TOKENS)
    check_int("--device-blocks", args.device_blocks, 1, 2**31)
    check_int("--max-batch-tokens", args.max_batch_tokens, 1, 2**31)
    check_int("--replay-steps", args.replay_steps, 0, 10**7)
    check_float("--speedup", args.speedup, 0.0, 1e6, low_open=True)
    check_float("--heartbeat", args.heartbeat, 0.0, 86_400.0)
    HashAlgo.parse(args.hash_algo)
    check_utf8("--model", args.model)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``router-sim worker``."""
    setup_logging(getattr(args, "log_level", "warning"))
    try:
        check_worker_args(args)
    except ValueError as exc:
        sys.stderr.write(f"router-sim worker: {exc}\n")
        return 2
    if args.count > 1 or args.fleet_out:
        from router_sim.service.fleet import run_fleet

        return run_fleet(args)
    try:
        asyncio.run(serve_worker(args))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"router-sim worker: {exc}\n")
        return 2
    return 0
