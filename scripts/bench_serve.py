"""Benchmark of ``router-sim serve`` against a fleet of real ``router-sim worker`` processes.

Run: ``python scripts/bench_serve.py`` (about a minute; ``--quick`` for a short run).

What it measures, all in one run on this machine:

1. ``POST /route`` throughput and client-side latency (p50/p99) for prompts of
   ``--prompt-tokens`` tokens (default 8,192), ``--concurrency`` requests in flight, while a
   separate process keeps the workers busy with fresh prompts (each one 512 new blocks at 16
   tokens per block), so the router ingests live events during the whole measurement. The
   router's own decision time comes from its ``/metrics`` histogram.
2. The proxy's overhead: the same fully cached prompt sent alternately straight to a worker's
   ``/v1/completions`` and through the router's (which picks that worker), one at a time;
   the difference of the latencies is the price of the extra hop and the decision.

Every process is started here and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TPB = 16


def start(argv: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    p = subprocess.Popen(
        [sys.executable, "-m", "router_sim", *argv], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"router-sim {' '.join(argv)} failed to start")
    return p, json.loads(line)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def event_load(urls: list[str], rps: float, tokens: int, count: int, ready: Any, stop: Any) -> None:
    """Another process: fresh prompts to the workers at ``rps`` (new blocks -> live events).

    The first ``count`` bodies are built before ``ready`` is set: building an 8,192-token
    random prompt and its JSON takes milliseconds of the cores the router runs on, which is
    the load generator's cost, not the event load's (the workers receive the same prompts).
    """
    bodies = [fresh_body(i, tokens) for i in range(count)]
    ready.set()

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            t0 = time.monotonic()
            pending: set[asyncio.Task[Any]] = set()
            while not stop.is_set():
                body = bodies[i] if i < len(bodies) else fresh_body(i, tokens)
                url = urls[i % len(urls)] + "/v1/completions"
                task = asyncio.create_task(session.post(url, data=body))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / rps - time.monotonic()))  # pacing
            for task in list(pending):
                resp = await task
                resp.release()

    asyncio.run(run())


def fresh_body(i: int, tokens: int) -> bytes:
    """The ``i``-th prompt of the event load: new token ids, so new blocks on its worker."""
    return json.dumps({"prompt": prompt(10_000_000 + i, tokens), "max_tokens": 4}).encode()


class _KeepAlive(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection sending the same kind of request over and over.

    The load generator shares the machine's cores with the router and the workers, so it is
    as cheap as it can be: each request is prebuilt bytes, the answer is only framed (status
    line and ``Content-Length``), nothing is parsed. The router's answers are checked for
    status 200 and framed exactly; any other answer stops the run.
    """

    def __init__(self, requests: list[bytes], first: int, step: int, deadline: float) -> None:
        self.requests, self.i, self.step, self.deadline = requests, first, step, deadline
        self.latencies: list[float] = []
        self.buf = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.sent = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.sent = time.perf_counter()
        self.transport.write(self.requests[self.i % len(self.requests)])
        self.i += self.step

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end]
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        if len(self.buf) < head_end + 4 + length:
            return
        now = time.perf_counter()
        if not head.startswith(b"HTTP/1.1 200"):
            self._finish(RuntimeError(f"answer {head[:40]!r}"))
            return
        self.buf = self.buf[head_end + 4 + length :]
        self.latencies.append(now - self.sent)
        if now < self.deadline:
            self._send()
        else:
            self._finish(None)

    def _finish(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the router closed the connection"))


def http_post(url: str, path_query: str, content_type: str, body: bytes) -> bytes:
    host = url.split("//", 1)[1].split("/", 1)[0]
    head = (
        f"POST {path_query} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def route_load(
    url: str, bodies: list[bytes], seconds: float, concurrency: int, content_type: str
) -> tuple[int, list[float]]:
    """``concurrency`` keep-alive connections, each sending its next request as soon as the
    previous answer is complete (closed loop)."""
    base, path = url.split("//", 1)[1].split("/", 1)
    host, port = base.rsplit(":", 1)
    requests = [http_post(url, "/" + path, content_type, b) for b in bodies]
    deadline = time.perf_counter() + seconds
    loop = asyncio.get_running_loop()
    conns = []
    for k in range(concurrency):
        _, proto = await loop.create_connection(
            lambda k=k: _KeepAlive(requests, k, concurrency, deadline),  # type: ignore[misc]
            host,
            int(port),
        )
        conns.append(proto)
    await asyncio.gather(*(c.done for c in conns))
    latencies = [x for c in conns for x in c.latencies]
    return len(latencies), latencies


async def proxy_overhead(serve: str, worker: str, body: bytes, n: int) -> tuple[list[float], ...]:
    direct: list[float] = []
    routed: list[float] = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for i in range(2 * n + 4):
            for base, out in ((worker, direct), (serve, routed)):
                t = time.perf_counter()
                async with session.post(base + "/v1/completions", data=body) as resp:
                    await resp.read()
                    assert resp.status == 200
                    # the router must pick the worker that holds the prompt (worker 0)
                    assert resp.headers.get("X-Router-Worker", "0") == "0"
                if i >= 4:  # warm-up
                    out.append(time.perf_counter() - t)
    return direct, routed


def _histogram(metrics: str, name: str) -> tuple[list[tuple[float, float]], float]:
    buckets: list[tuple[float, float]] = []
    count = 0.0
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == name + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == name + "_count":
                count = s.value
    return sorted(buckets), count


def _bound(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """The histogram bucket bound under which a share ``q`` of the observations fall."""
    return next((le for le, c in buckets if c >= q * count), float("inf"))


def decision_quantiles(metrics: str) -> dict[str, float]:
    events = 0.0
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == "router_events_applied_total":
                events = s.value
    buckets, count = _histogram(metrics, "router_decision_seconds")
    out = {"events_applied": events, "decisions": count}
    for q in (0.5, 0.99):
        out[f"p{round(q * 100)}_le_ms"] = _bound(buckets, count, q) * 1e3
    slices, n = _histogram(metrics, "router_event_apply_seconds")
    out["slices"] = n
    out["slice_p99_le_ms"] = _bound(slices, n, 0.99) * 1e3
    out["slice_max_le_ms"] = _bound(slices, n, 1.0) * 1e3
    return out


async def fetch(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--event-rps", type=float, default=8.0, help="fresh prompts/s to the workers (0: none)"
    )
    ap.add_argument("--speedup", type=float, default=20.0, help="workers' --speedup")
    ap.add_argument("--proxy-requests", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="3 s of /route, 10 proxy requests")
    ap.add_argument(
        "--routers",
        type=int,
        default=1,
        help="serve processes sharing one port (--reuse-port), each subscribed to the fleet",
    )
    ap.add_argument("--event-loop", help="serve's --event-loop (asyncio or uvloop)")
    ap.add_argument(
        "--router-nice",
        type=int,
        default=0,
        help="diagnosis only: the routers' scheduling priority (negative needs root), to see "
        "how much of the tail is the router waiting for a core the other processes hold",
    )
    ap.add_argument(
        "--encodings", default="json,packed", help="comma-separated /route bodies to measure"
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="record the router with py-spy during each /route run (DIR/route-ENC.txt, "
        "collapsed stacks)",
    )
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.proxy_requests = 3.0, 10
    procs: list[subprocess.Popen[str]] = []
    tokens = args.prompt_tokens
    try:
        entries = []
        for i in range(args.workers):
            p, ready = start(["worker", "--id", str(i), "--speedup", str(args.speedup)])
            procs.append(p)
            entries.append({k: ready[k] for k in ("id", "http", "events", "replay")})
        fleet = Path(tempfile.mkdtemp()) / "fleet.json"
        fleet.write_text(json.dumps({"tokens_per_block": TPB, "workers": entries}))
        serve_args = ["serve", "--fleet", str(fleet)]
        if args.event_loop:
            serve_args += ["--event-loop", args.event_loop]
        if args.routers > 1:
            serve_args.append("--reuse-port")
        serve_proc, ready = start([*serve_args, "--port", "0"])
        procs.append(serve_proc)
        serve = ready["http"]
        routers = [serve_proc]
        for _ in range(args.routers - 1):
            port = serve.rsplit(":", 1)[1]
            routers.append(start([*serve_args, "--port", port])[0])
            procs.append(routers[-1])

        for p in routers:
            if args.router_nice:
                os.setpriority(os.PRIO_PROCESS, p.pid, args.router_nice)

        def router_cpu_s() -> float:
            return sum(cpu_s(p.pid) for p in routers)

        # a warm index: 4 prefixes per worker; the /route prompts share them (plus a tail)
        shared = [prompt(i, tokens - 64) for i in range(4 * args.workers)]

        async def warm() -> None:
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(
                    *(
                        s.post(
                            entries[i % args.workers]["http"] + "/v1/completions",
                            data=json.dumps({"prompt": pr, "max_tokens": 1}),
                        )
                        for i, pr in enumerate(shared)
                    )
                )

        asyncio.run(warm())
        tails = [shared[i % len(shared)] + prompt(-i - 1, 64) for i in range(64)]
        encodings = {
            "json": ("application/json", [json.dumps({"prompt": t}).encode() for t in tails]),
            "packed": (
                "application/octet-stream",
                [struct.pack(f"<{len(t)}i", *t) for t in tails],
            ),
        }
        stop, ready = multiprocessing.Event(), multiprocessing.Event()
        phases = len(args.encodings.split(","))
        count = int(args.event_rps * (phases * (args.seconds + 3) + 10))
        loader = multiprocessing.Process(
            target=event_load,
            args=([e["http"] for e in entries], args.event_rps, tokens, count, ready, stop),
        )
        if args.event_rps > 0:
            loader.start()
            if not ready.wait(300):
                raise RuntimeError("the event load generator did not start")
            time.sleep(1.0)  # pacing: the event load runs at its rate before the measurement
        print(
            f"POST /route, {tokens}-token prompts sharing a cached prefix, {args.workers} "
            f"workers fed {args.event_rps:g} fresh {tokens}-token prompts/s "
            f"({args.event_rps * tokens / TPB:.0f} new blocks/s), concurrency {args.concurrency}, "
            f"{args.seconds:g} s per encoding"
            + (f", routers at nice {args.router_nice}" if args.router_nice else "")
        )
        for name in args.encodings.split(","):
            ctype, bodies = encodings[name]
            before = decision_quantiles(asyncio.run(fetch(serve + "/metrics")))
            spy = None
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                spy = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "-p",
                        str(serve_proc.pid),
                        "-d",
                        str(int(args.seconds)),
                        "-f",
                        "raw",
                        "-o",
                        os.path.join(args.profile, f"route-{name}.txt"),
                        "-r",
                        "200",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            c0 = router_cpu_s()
            own0 = time.process_time()
            t0 = time.perf_counter()
            n, lat = asyncio.run(
                route_load(serve + "/route", bodies, args.seconds, args.concurrency, ctype)
            )
            wall = time.perf_counter() - t0
            cpu_us = (router_cpu_s() - c0) / n * 1e6
            client_us = (time.process_time() - own0) / n * 1e6
            if spy is not None:
                spy.wait(30)
            after = decision_quantiles(asyncio.run(fetch(serve + "/metrics")))
            ingested = after["events_applied"] - before["events_applied"]
            print(
                f"  {name:6} {n / wall:6.0f} decisions/s   "
                f"latency p50 {pct(lat, 0.5) * 1e3:5.2f} ms"
                f"  p99 {pct(lat, 0.99) * 1e3:6.2f} ms (client side)   "
                + (
                    f"Stored events applied meanwhile {ingested:.0f}\n"
                    if len(routers) == 1
                    else f"({len(routers)} routers)\n"
                )
                + f"         service CPU {cpu_us:4.0f} us per decision "
                f"(= {1e6 / cpu_us:.0f} decisions/s per core); load generator CPU "
                f"{client_us:.0f} us per request"
            )
        stop.set()
        if args.event_rps > 0:
            loader.join(30)
        print(
            f"  route() inside the service, all decisions: p50 <= {after['p50_le_ms']:.2f} ms, "
            f"p99 <= {after['p99_le_ms']:.2f} ms; event application held the loop "
            f"{after['slices']:.0f} times, p99 <= {after['slice_p99_le_ms']:.2f} ms, max <= "
            f"{after['slice_max_le_ms']:.2f} ms (histogram bucket bounds"
            + (")" if len(routers) == 1 else ", one of the routers)")
        )
        pr = shared[0] + [1]
        body = json.dumps({"prompt": pr, "max_tokens": 1}).encode()
        c0 = router_cpu_s()
        direct, routed = asyncio.run(
            proxy_overhead(serve, entries[0]["http"], body, args.proxy_requests)
        )
        proxy_cpu_us = (router_cpu_s() - c0) / len(routed) * 1e6
        d50, r50 = statistics.median(direct), statistics.median(routed)
        print(
            f"proxy: /v1/completions, {tokens}-token cached prompt, max_tokens 1, sequential, "
            f"{len(direct)} each\n"
            f"  direct p50 {d50 * 1e3:6.2f} ms   via router p50 {r50 * 1e3:6.2f} ms   "
            f"overhead {(r50 - d50) * 1e3:5.2f} ms per request; "
            f"service CPU {proxy_cpu_us:.0f} us per proxied request"
        )
        print(f"load average during the run: {os.getloadavg()[0]:.2f} (2 cores)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
