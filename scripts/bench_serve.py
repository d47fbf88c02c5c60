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


def event_load(urls: list[str], rps: float, tokens: int, stop: Any) -> None:
    """Another process: fresh prompts to the workers at ``rps`` (new blocks -> live events)."""

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            t0 = time.monotonic()
            pending: set[asyncio.Task[Any]] = set()
            while not stop.is_set():
                body = json.dumps({"prompt": prompt(10_000_000 + i, tokens), "max_tokens": 4})
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


async def route_load(
    url: str, bodies: list[bytes], seconds: float, concurrency: int, content_type: str
) -> tuple[int, list[float]]:
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        i = k
        while time.monotonic() < deadline:
            t = time.perf_counter()
            async with session.post(url, data=bodies[i % len(bodies)]) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - t)
            i += concurrency

    headers = {"Content-Type": content_type}
    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(*(client(k, session) for k in range(concurrency)))
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


def decision_quantiles(metrics: str) -> dict[str, float]:
    buckets: list[tuple[float, float]] = []
    count = 0.0
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == "router_decision_seconds_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == "router_decision_seconds_count":
                count = s.value
            elif s.name == "router_events_applied_total":
                events = s.value
    out = {"events_applied": events, "decisions": count}
    for q in (0.5, 0.99):
        out[f"p{round(q * 100)}_le_ms"] = (
            next(le for le, c in sorted(buckets) if c >= q * count) * 1e3
        )
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
        serve_proc, ready = start(["serve", "--fleet", str(fleet), "--port", "0"])
        procs.append(serve_proc)
        serve = ready["http"]
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
        stop = multiprocessing.Event()
        loader = multiprocessing.Process(
            target=event_load,
            args=([e["http"] for e in entries], args.event_rps, tokens, stop),
        )
        if args.event_rps > 0:
            loader.start()
        print(
            f"POST /route, {tokens}-token prompts sharing a cached prefix, {args.workers} "
            f"workers fed {args.event_rps:g} fresh {tokens}-token prompts/s "
            f"({args.event_rps * tokens / TPB:.0f} new blocks/s), concurrency {args.concurrency}, "
            f"{args.seconds:g} s per encoding"
        )
        for name, (ctype, bodies) in encodings.items():
            before = decision_quantiles(asyncio.run(fetch(serve + "/metrics")))
            c0 = cpu_s(serve_proc.pid)
            t0 = time.perf_counter()
            n, lat = asyncio.run(
                route_load(serve + "/route", bodies, args.seconds, args.concurrency, ctype)
            )
            wall = time.perf_counter() - t0
            cpu_us = (cpu_s(serve_proc.pid) - c0) / n * 1e6
            after = decision_quantiles(asyncio.run(fetch(serve + "/metrics")))
            ingested = after["events_applied"] - before["events_applied"]
            print(
                f"  {name:6} {n / wall:6.0f} decisions/s   "
                f"latency p50 {pct(lat, 0.5) * 1e3:5.2f} ms"
                f"  p99 {pct(lat, 0.99) * 1e3:6.2f} ms (client side)   "
                f"Stored events applied meanwhile {ingested:.0f}\n"
                f"         service CPU {cpu_us:4.0f} us per decision "
                f"(= {1e6 / cpu_us:.0f} decisions/s per core)"
            )
        stop.set()
        if args.event_rps > 0:
            loader.join(30)
        print(
            f"  route() inside the service, all decisions: p50 <= {after['p50_le_ms']:.2f} ms, "
            f"p99 <= {after['p99_le_ms']:.2f} ms (histogram bucket bounds)"
        )
        pr = shared[0] + [1]
        body = json.dumps({"prompt": pr, "max_tokens": 1}).encode()
        c0 = cpu_s(serve_proc.pid)
        direct, routed = asyncio.run(
            proxy_overhead(serve, entries[0]["http"], body, args.proxy_requests)
        )
        proxy_cpu_us = (cpu_s(serve_proc.pid) - c0) / len(routed) * 1e6
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
