"""``router-sim serve``: the router as an HTTP service (aiohttp) in front of a fleet.

Endpoints:

- ``POST /route`` ``{"prompt": [ids], "lora_id"?, "lora_name"?, "cache_salt"?}``: the chosen
  worker and the decision's explanation (overlap per candidate, costs, reason, decision time);
  or the prompt packed (``application/octet-stream``, little-endian int32 ids) with the other
  fields as query parameters, for clients that route at high rates; or a text prompt, a batch
  of prompts (one decision each) or chat ``messages`` (:mod:`router_sim.service.proxy`);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI-style, routed by the
  prompt's tokens (text and chat through the model's tokenizer) and forwarded as sent to the
  chosen worker; streamed answers are relayed as they come (:mod:`router_sim.service.proxy`).
  The answer carries ``X-Router-Worker``. The load view counts what was forwarded (see
  :mod:`router_sim.service.inflight`); ``GET /v1/models``: what the fleet serves;
- ``GET /workers`` (per-worker stream and health), ``POST /workers`` (add one: a fleet-file
  entry as JSON), ``DELETE /workers/{id}``;
- ``GET /healthz``, ``GET /metrics`` (Prometheus text format).

Bad requests get a 4xx with a JSON error (:mod:`router_sim.service.protocol`); a worker
that refuses the connection is skipped until its health probe answers again and the request
goes to the next choice; a worker that fails after that is a 502, or an error event at the end
of a stream already started; no eligible worker is 503.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import prometheus_client
from aiohttp import web

from events.stream.endpoints import EndpointError
from events.stream.security import curve_client_from
from events.tools.cli_args import TCP_PORT_MAX, check_float, check_int, check_utf8
from router_sim.router.policies import POLICIES, NoWorkersError
from router_sim.service import proxy, settings
from router_sim.service.core import SERVICE, FleetConflict, RouterService
from router_sim.service.fleet import FleetError, FleetFile, load_fleet, parse_worker
from router_sim.service.http_limits import (
    GUARD,
    ConnectionGuard,
    GuardedSite,
    add_arguments,
    body_form,
    limits_from,
    unsupported,
)
from router_sim.service.protocol import (
    MAX_BODY_BYTES,
    PACKED_TOKENS,
    BadRequest,
    Handler,
    RouteQuery,
    error_response,
    json_answer,
    json_errors,
    packed_tokens,
    parse_query,
    parse_route_body,
    read_body,
)
from router_sim.service.tokenizer import PromptTokenizer


async def route(request: web.Request) -> web.Response:
    """``POST /route``: the request path that runs at high rates, so it does the least it
    can: one read of the body, the query validated only when there is one, a JSON prompt's
    ids read without their range (the hashing checks it; see the ``except BadRequest``), the
    answer encoded by msgspec (see :func:`~router_sim.service.protocol.json_answer`)."""
    svc = request.app[SERVICE]
    raw = await request.read()
    prompt: Sequence[int]
    lora_id: int | None = None
    lora_name: str | None = None
    salt: str | None = None
    form = body_form(request, PACKED_TOKENS)
    if form is None:
        return unsupported(request, PACKED_TOKENS)
    if form == "packed":
        prompt = packed_tokens(raw)
        if request.query_string:
            query = parse_query(RouteQuery, request.query)
            lora_id, lora_name, salt = query.lora_id, query.lora_name, query.cache_salt
    else:
        try:
            body = parse_route_body(raw, check_ids=False)
        except BadRequest as exc:  # the checked reading refuses it too, with this message
            return await _json_route(svc, raw, exc)
        prompt = body.prompt
        lora_id, lora_name, salt = body.lora_id, body.lora_name, body.cache_salt
    try:
        lora = lora_id if lora_name is None else svc.resolve_lora(lora_id, lora_name)
        decision = svc.decide(prompt, lora, salt)
    except NoWorkersError as exc:
        return proxy.no_workers(exc)
    except BadRequest:
        if form == "packed":
            raise
        # a JSON prompt read unchecked and refused after (an id the hashing refuses, an
        # unknown adapter): answered as the checked reading answers it, so that an id out
        # of range is reported as it always was, before anything else
        try:
            parse_route_body(raw)
        except BadRequest as exc:
            return await _json_route(svc, raw, exc)
        raise
    return json_answer(svc.explain(decision))


async def _json_route(svc: RouterService, raw: bytes, refused: BadRequest) -> web.Response:
    """A JSON ``POST /route`` body that the token-id reading refuses (``refused``): a text
    prompt, a batch or chat messages (:func:`~router_sim.service.proxy.route_text`), else
    ``refused`` raised."""
    text = await proxy.route_text(svc, raw)
    if text is None:
        raise refused
    return text


async def list_workers(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return json_answer({"workers": [svc.worker_report(w) for w in sorted(svc.workers)]})


async def add_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    try:
        entry = parse_worker(await read_body(request))
        await svc.add_worker(entry)
    except FleetConflict as exc:
        return error_response(409, str(exc))
    except (FleetError, EndpointError) as exc:
        return error_response(400, str(exc))
    return json_answer(svc.worker_report(entry.id), status=201)


async def remove_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    text = request.match_info["worker"]
    if not text.isdigit():
        return error_response(400, f"worker id must be a non-negative integer, got {text!r}")
    try:
        await svc.remove_worker(int(text))
    except FleetConflict as exc:
        return error_response(404, str(exc))
    return json_answer({"removed": int(text)})


async def healthz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    up = sum(1 for s in svc.workers.values() if s.up)
    # without its event pump the index goes stale: a load balancer should stop using this one
    ok = svc.pump.alive
    body = {"status": "ok" if ok else "events_stopped", "workers": len(svc.workers)}
    return json_answer({**body, "workers_up": up}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    data = request.app[SERVICE].metrics.exposition()
    return web.Response(body=data, headers={"Content-Type": "text/plain; version=0.0.4"})


@web.middleware
async def count_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """:func:`~router_sim.service.protocol.json_errors`, and a count of the 4xx answers. One
    middleware calling the other: aiohttp wraps each middleware around the handler on every
    request, which costs a few microseconds apiece. Inside, the HTTP guard
    (:meth:`~router_sim.service.http_limits.ConnectionGuard.guarded`) reads the body within
    its deadline before the handler runs."""
    resp = await json_errors(request, partial(request.app[GUARD].guarded, handler))
    if 400 <= resp.status < 500:
        request.app[SERVICE].metrics.bad_requests.inc()
    return resp


def build_app(service: RouterService, guard: ConnectionGuard | None = None) -> web.Application:
    """The aiohttp application; ``service`` is started on startup and closed on cleanup.
    ``guard``: its time bounds and JSON errors (:mod:`router_sim.service.http_limits`; default
    limits when None), kept as ``app[GUARD]`` for the site that serves it."""
    guard = ConnectionGuard() if guard is None else guard
    app = web.Application(middlewares=[count_refusals], client_max_size=MAX_BODY_BYTES)
    app[SERVICE] = service
    app[GUARD] = guard

    async def lifecycle(app: web.Application) -> Any:
        await service.start()
        yield
        await service.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/route", route)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers/{worker}", remove_worker)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


# ------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> None:
    """The ``serve`` subcommand's arguments (``sub``: argparse's subparsers)."""
    p = sub.add_parser(
        "serve",
        help="run the router as an HTTP service in front of a fleet",
        description="The KV-aware router as an OpenAI-compatible HTTP service in front of "
        "router-sim workers or vLLM, SGLang and TensorRT-LLM engines (see docs/SERVE.md).",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of these options (e.g. port = 9000, health-interval = 0.2); options "
        "given here override it",
    )
    p.add_argument("--fleet", help="fleet file (JSON); without it the fleet starts empty")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the model's tokenizer on local disk (a tokenizer.json or its directory, with its "
        "tokenizer_config.json and chat template): text and chat prompts are tokenized with it "
        "(the fleet file's models.NAME.tokenizer overrides it for that model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument(
        "--policy",
        default="kv_overlap",
        choices=sorted(set(POLICIES) - {"oracle"}),
        help="routing policy",
    )
    p.add_argument("--policy-options", default="{}", help="JSON, e.g. '{\"overlap_weight\": 2}'")
    p.add_argument(
        "--tokens-per-block", type=int, help="block size when there is no --fleet (none: 16 tokens)"
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=0.5,
        help="seconds between two health and load probes of a worker",
    )
    p.add_argument(
        "--replay-timeout-ms",
        type=int,
        default=1000,
        help="how long a worker's replay socket may take to answer before the events it "
        "should replay count as lost (the worker's view is then rebuilt)",
    )
    p.add_argument(
        "--curve-key",
        help="this router's CURVE key pair (.key_secret, from kv-events keygen); with "
        "--curve-server-key, every worker's event stream is read encrypted and authenticated",
    )
    p.add_argument("--curve-server-key", help="the workers' CURVE public key (.key)")
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT, so that several serve processes (replicas, each "
        "subscribed to the whole fleet) share one port and the kernel spreads connections",
    )
    p.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="uvloop needs the uvloop package; measured with scripts/bench_serve.py it was "
        "no cheaper per decision than asyncio's own loop here",
    )
    p.add_argument(
        "--log-level", choices=settings.LOG_LEVELS, default="info", help="least level logged"
    )
    add_arguments(p)  # the HTTP server's timeouts and connection cap
    settings.defer_defaults(p)  # every help shows its default; --config fills what is not given


def _config(args: argparse.Namespace) -> tuple[FleetFile, dict[str, Any]]:
    fleet = load_fleet(args.fleet) if args.fleet else FleetFile()
    if args.tokens_per_block is not None:
        if args.fleet:
            raise FleetError("--tokens-per-block comes from the fleet file when one is given")
        fleet = FleetFile(tokens_per_block=args.tokens_per_block)
    try:
        options = json.loads(args.policy_options)
    except json.JSONDecodeError as exc:
        raise FleetError(f"--policy-options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise FleetError("--policy-options must be a JSON object")
    if not args.health_interval > 0:
        raise FleetError(f"--health-interval must be > 0, got {args.health_interval}")
    check_float("--health-interval", args.health_interval, 0.0, 3600.0, low_open=True)
    check_int("--port", args.port, 0, TCP_PORT_MAX)
    check_int("--replay-timeout-ms", args.replay_timeout_ms, 1, 3_600_000)
    check_utf8("--host", args.host)
    return fleet, options


async def serve(args: argparse.Namespace) -> None:
    fleet, options = _config(args)
    limits = limits_from(args)
    service = RouterService(
        fleet,
        args.policy,
        options,
        health_interval_s=args.health_interval,
        replay_timeout_ms=args.replay_timeout_ms,
        curve=curve_client_from(args.curve_key, args.curve_server_key),
        tokenizer=PromptTokenizer.load(args.tokenizer) if args.tokenizer else None,
    )
    guard = ConnectionGuard(limits)
    runner = web.AppRunner(build_app(service, guard), access_log=None, **guard.runner_kwargs())
    await runner.setup()
    freeze_heap()
    try:
        site = GuardedSite(runner, guard, args.host, args.port, reuse_port=args.reuse_port or None)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(
            json.dumps({"http": f"http://{host}:{port}", "workers": len(service.workers)}),
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def freeze_heap() -> int:
    """Take every object the process holds once started (its modules, classes, pydantic
    schemas, the app: ~55,000 objects) out of the garbage collector's reach, and return how
    many. A full collection traverses every tracked object and holds every thread meanwhile:
    over that heap it took 14-40 ms here, a few times a minute under ``POST /route`` load,
    and each request that arrived meanwhile waited for it (``router_gc_pause_seconds``). The
    index does not add to it (dicts of ints are not tracked). Objects made later, requests'
    included, are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _runner(name: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """asyncio's ``run``, or uvloop's (libuv's event loop and transports)."""
    if name == "asyncio":
        return asyncio.run
    try:
        uvloop = importlib.import_module("uvloop")  # optional: not a dependency
    except ImportError:
        raise ValueError("--event-loop uvloop: the uvloop package is not installed") from None
    run: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    return run


def main(args: argparse.Namespace) -> int:
    """Entry point of ``router-sim serve``."""
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        settings.resolve(args)
        settings.setup_logging(args.log_level)
        _runner(args.event_loop)(serve(args))
    except (FleetError, EndpointError, TypeError, ValueError, OSError) as exc:
        sys.stderr.write(f"router-sim serve: {exc}\n")
        return 2
    return 0
