"""Engine-shaped stand-ins for the service tests: what vLLM, SGLang and trtllm-serve expose.

CI runs no engine, so these serve exactly an engine's public surface, built from its
documented behaviour (not its code):

- HTTP (aiohttp, on 127.0.0.1): ``GET /health`` (an empty 200, or 503 when told it is dead),
  ``GET /metrics`` (vLLM and SGLang: Prometheus text written by prometheus-client, the library
  both engines use, under their metric names and labels; trtllm-serve: a JSON list of
  iteration statistics, drained by each read), ``GET /v1/models`` (OpenAI's model list with
  ``max_model_len``), ``POST /v1/completions`` and ``POST /v1/chat/completions`` (text or
  token-id prompts; streamed answers end with ``data: [DONE]``). There is no ``/healthz``.
- KV events: ZeroMQ PUB frames ``[topic, seq (8 bytes, big-endian), payload]`` from seq 0 at
  every start, in the engine's event layout (:mod:`router_sim.sim.dialects`), and a ROUTER
  replay socket that answers ``[id, "", start]`` with every buffered batch from ``start`` as
  ``[id, "", topic, seq, payload]`` (vLLM 0.26-0.33, SGLang 0.5; ``replay_topic=False``:
  ``[id, "", seq, payload]``, as vLLM 0.25 did) and then the end marker ``[id, "", "", -1,
  ""]``, with no incarnation or snapshot (engines have neither). The HTTP surface used here
  (``/health``, the three gauges, ``/v1/models``) is the same in vLLM 0.26.0 and 0.33.0.

The prompt is tokenized with the ``tokenizers`` library and chat messages are rendered with
jinja2 directly (a few lines here, independent of the router's own tokenizer module), then
the blocks are stored by a real :class:`kvcache.manager.KVCacheManager`, whose events are
published: what an engine announces after prefilling the prompt.

Faults, set by a test: ``dead`` (``/health`` answers 503), ``cut_after`` (the connection is
dropped after that many streamed chunks), ``end_without_done`` (the stream ends cleanly but
short: no final chunk, no ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from typing import Any, Final

import jinja2.sandbox
import tokenizers
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from events.manager import KVCacheEventManager
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from router_sim.sim.dialects import make_dialect

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)

# (running, waiting, usage) gauge names and their labels, as each engine names them
PROM: Final = {
    "vllm": (
        ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
        ("model_name", "engine"),
    ),
    "sglang": (
        ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
        ("model_name", "engine_type", "tp_rank", "pp_rank"),
    ),
}


async def _bind_again(sock: zmq.asyncio.Socket, addr: str, timeout_s: float = 5.0) -> None:
    """Bind ``addr``, which the previous start's socket may hold a moment longer (ZeroMQ
    closes sockets on its I/O thread): retried until a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or loop.time() > deadline:
                raise
        await asyncio.sleep(0.01)  # retry interval; the deadline bounds the wait


class EngineStandIn:
    """One engine process as a router sees it (see the module docstring)."""

    def __init__(
        self,
        engine: str,
        worker_id: int,
        tokenizer_file: str,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        model: str = "test-model",
        max_model_len: int = 4096,
        tokens_per_block: int = 16,
        device_blocks: int = 4096,
        answer_tokens: int = 4,
        metrics: bool = True,
        replay_topic: bool = True,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.model = model
        self.max_model_len = max_model_len
        self.tokens_per_block = tokens_per_block
        self.answer_tokens = answer_tokens
        self.tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
        self.chat_template = chat_template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = None if chat_template is None else env.from_string(chat_template)
        self.special_tokens = dict(special_tokens or {})
        self.dead = False
        self.metrics_enabled = metrics
        self.replay_topic = replay_topic  # vLLM >= 0.26 and SGLang 0.5 send it; 0.25 did not
        self.cut_after: int | None = None
        self.end_without_done = False
        self.running = 0
        self.waiting = 0
        self.prompts: list[list[int]] = []  # every prompt's ids, as this engine tokenized it
        self.bodies: list[dict[str, Any]] = []  # every request body, as received
        self._device_blocks = device_blocks
        self._iteration_stats: list[dict[str, Any]] = []
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.http = self.events = self.replay = ""
        self._ports: tuple[int, int, int] | None = None
        self._fresh_engine()

    def _fresh_engine(self) -> None:
        """A new process: an empty cache and seqs from 0."""
        self.seq = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self._events = KVCacheEventManager(
            hash_algo="v1_block_key",
            max_entries=100_000,
            moves_as="removed_stored",
            tokens_per_block=self.tokens_per_block,
        )
        tiers = [TierConfig(name="device", num_blocks=self._device_blocks)]
        self._cache = KVCacheManager(
            KVCacheManagerConfig(tokens_per_block=self.tokens_per_block, tiers=tiers),
            event_sink=self._events,
        )
        self._dialect = make_dialect(self.engine, self.worker_id, self.tokens_per_block)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind (the same ports again after :meth:`stop`, as a restarted engine would)."""
        http_port, events_port, replay_port = self._ports or (0, 0, 0)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        if events_port:
            await _bind_again(self._pub, f"tcp://127.0.0.1:{events_port}")
            await _bind_again(self._replay, f"tcp://127.0.0.1:{replay_port}")
        else:
            events_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
            replay_port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self._replay_task = asyncio.create_task(self._serve_replay())
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", http_port)
        await site.start()
        http_port = int(self._runner.addresses[0][1])
        self._ports = (http_port, events_port, replay_port)
        self.http = f"http://127.0.0.1:{http_port}"
        self.events = f"tcp://127.0.0.1:{events_port}"
        self.replay = f"tcp://127.0.0.1:{replay_port}"

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    async def restart(self) -> None:
        """Stop, forget everything, start again on the same ports."""
        await self.stop()
        self._fresh_engine()
        await self.start()

    def close(self) -> None:
        self._ctx.term()

    def entry(self) -> dict[str, Any]:
        """This engine's fleet-file entry."""
        return {
            "id": self.worker_id,
            "engine": self.engine,
            "http": self.http,
            "events": self.events,
            "replay": self.replay,
        }

    # ------------------------------------------------------------ KV events

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._ring):
                if seq >= first:
                    topic = [b""] if self.replay_topic else []
                    await self._replay.send_multipart(
                        [client, b"", *topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def publish(self) -> None:
        """Publish what the cache announced since the last call, as one batch."""
        events, _ = self._events.end_step()
        if not events or self._pub is None:
            return
        payload = self._dialect.encode(events, time.time())
        seq = self.seq
        self.seq += 1
        self._ring.append((seq, payload))
        await self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _prefill(self, ids: list[int]) -> int:
        """Compute the prompt's KV (store its blocks) and announce it; the tokens reused."""
        cache = self._cache.create_kv_cache(ids, reuse_scope=ReuseScope())
        reused = cache.num_reused_tokens
        cache.commit(ids[cache.num_tokens :])
        cache.stop_committing()
        cache.close()
        await self.publish()
        return reused

    # ------------------------------------------------------------ HTTP

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_enabled:
            raise web.HTTPNotFound()  # SGLang without --enable-metrics
        if self.engine == "trtllm":
            drained, self._iteration_stats = self._iteration_stats, []
            return web.json_response(drained)
        (running, waiting, usage), labels = PROM[self.engine]
        registry = CollectorRegistry()
        values = {"model_name": self.model, "engine": "0", "engine_type": "unified"}
        values.update(tp_rank="0", pp_rank="0")
        label_values = [values[k] for k in labels]
        usage_now = self._cache.kv_usage(0)
        for name, doc, value in (
            (running, "Number of requests in model execution batches.", self.running),
            (waiting, "Number of requests waiting to be processed.", self.waiting),
            (usage, "KV-cache usage. 1 means 100 percent usage.", usage_now),
        ):
            g = Gauge(name, doc, labels, registry=registry)
            g.labels(*label_values).set(value)
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    def record_iteration(self, active: int, queued: int, used_blocks: int) -> None:
        """trtllm-serve: one iteration's statistics, returned by the next ``/metrics``."""
        self._iteration_stats.append(
            {
                "iter": len(self._iteration_stats),
                "numActiveRequests": active,
                "numQueuedRequests": queued,
                "kvCacheStats": {
                    "maxNumBlocks": self._device_blocks,
                    "usedNumBlocks": used_blocks,
                    "freeNumBlocks": self._device_blocks - used_blocks,
                    "tokensPerBlock": self.tokens_per_block,
                },
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": self.engine,
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    def _encode(self, prompt: Any, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._encode(prompt[0], add_special_tokens)
        return [int(t) for t in prompt]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat template over ``messages`` (jinja2, sandboxed, blocks trimmed)."""
        assert self._template is not None
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        ids = self._encode(body["prompt"], body.get("add_special_tokens", True))
        return await self._answer(request, body, ids, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        text = self.render(body["messages"], body.get("add_generation_prompt", True))
        ids = self._encode(text, body.get("add_special_tokens", False))
        return await self._answer(request, body, ids, chat=True)

    async def _answer(
        self, request: web.Request, body: dict[str, Any], ids: list[int], *, chat: bool
    ) -> web.StreamResponse:
        self.prompts.append(ids)
        self.running += 1
        try:
            reused = await self._prefill(ids)
            n = min(int(body.get("max_tokens") or self.answer_tokens), self.answer_tokens)
            words = [f"w{i}" for i in range(n)]
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
                "prompt_tokens_details": {"cached_tokens": reused},
            }
            kind = "chat.completion" if chat else "text_completion"
            if not body.get("stream"):
                if self.cut_after is not None:
                    assert request.transport is not None
                    request.transport.abort()  # the engine died before answering
                    return web.Response()
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": " ".join(words)}
                else:
                    choice["text"] = " ".join(words)
                answer = {"id": "x", "object": kind, "model": self.model, "choices": [choice]}
                return web.json_response({**answer, "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, word in enumerate(words):
                if self.cut_after is not None and i == self.cut_after:
                    assert request.transport is not None
                    request.transport.abort()  # the engine died mid-answer
                    return resp
                piece: dict[str, Any] = {"index": 0, "finish_reason": None}
                if chat:
                    piece["delta"] = {"content": word}
                else:
                    piece["text"] = word
                chunk = {"id": "x", "object": f"{kind}.chunk" if chat else kind}
                chunk.update(model=self.model, choices=[piece])
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.end_without_done:
                await resp.write_eof()
                return resp
            last: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            last.update({"delta": {}} if chat else {"text": ""})
            final = {"id": "x", "object": kind, "choices": [last], "usage": usage}
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1


def main() -> None:
    """``python tests/engine_standins.py --engine vllm --tokenizer DIR``: one stand-in as a
    process (for benchmarks); prints its fleet entry as a JSON line, runs until SIGTERM."""
    import argparse
    import signal
    from pathlib import Path

    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="vllm", choices=("vllm", "sglang", "trtllm"))
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--tokenizer", required=True, help="directory of tokenizer.json")
    args = p.parse_args()
    folder = Path(args.tokenizer)
    config = json.loads((folder / "tokenizer_config.json").read_text())

    async def run() -> None:
        s = EngineStandIn(
            args.engine,
            args.id,
            str(folder / "tokenizer.json"),
            chat_template=config.get("chat_template"),
            special_tokens={"bos_token": config["bos_token"]} if config.get("bos_token") else None,
            device_blocks=1 << 20,
        )
        await s.start()
        print(json.dumps(s.entry()), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        await s.stop()
        s.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
