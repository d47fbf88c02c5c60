"""Benchmark of ``router-sim serve`` against a fleet of real ``router-sim worker`` processes.

Run: ``python scripts/bench_serve.py`` (about a minute; ``--quick`` for a short run).

What it measures, all in one run on this machine:

1. ``POST /route`` throughput and client-side latency (p50/p99) for prompts of
   ``--prompt-tokens`` tokens (default 8,192), ``--concurrency`` requests in flight, while a
   separate process keeps the workers busy with fresh prompts (each one 512 new blocks at 16
   tokens per block), so the router ingests live events during the whole measurement. The
   router's own decision time comes from its ``/metrics`` histogram.
   That is a closed loop (each connection sends its next request when its answer is in): it
   gives the saturation throughput, but its latency is queueing by construction (Little's
   law: mean latency = concurrency / throughput). ``--rate R`` or ``--rates R1,R2,...``
   measure open loop instead (:mod:`router_sim.service.openloop`): requests sent on a fixed
   schedule at R/s whatever the answers, each latency charged from its scheduled send time,
   one line per rate (the latency-vs-load curve), with the same live event load.
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

from router_sim.service.openloop import http_request, run_open_loop

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


def pin(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` (ZeroMQ's I/O threads too) on ``cpus`` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_s(pid: int) -> float:
    """Seconds the threads of a process have spent runnable but waiting for a core (Linux
    schedstat, second field): time the scheduler, not the process, put on its latency."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


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


async def route_load(
    url: str, bodies: list[bytes], seconds: float, concurrency: int, content_type: str
) -> tuple[int, list[float]]:
    """``concurrency`` keep-alive connections, each sending its next request as soon as the
    previous answer is complete (closed loop)."""
    base, path = url.split("//", 1)[1].split("/", 1)
    host, port = base.rsplit(":", 1)
    requests = [http_request(host, int(port), "/" + path, content_type, b) for b in bodies]
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


async def proxy_overhead(
    serve: str, worker: str, body: bytes, n: int, *, settle_s: float = 10.0
) -> tuple[list[float], list[float], int, int]:
    """``n`` pairs of the same prompt sent straight to ``worker`` (worker 0) and through the
    router. First a warm-up, until the router picks worker 0 twice running (its direct
    requests cache the prompt there again if the event load's fresh prompts evicted it, and
    the router learns it from the events); then the pairs, and how many of them the router
    sent elsewhere (their latencies still count: that is what the proxy cost), and how many
    requests went through the router in all, warm-up included."""
    direct: list[float] = []
    routed: list[float] = []
    elsewhere = 0
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def post(base: str) -> tuple[float, str]:
            t = time.perf_counter()
            async with session.post(base + "/v1/completions", data=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{base}: HTTP {resp.status}")
                return time.perf_counter() - t, resp.headers.get("X-Router-Worker", "0")

        deadline = time.perf_counter() + settle_s
        running = warm = 0
        while running < 2:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the router did not settle on worker 0 in {settle_s} s")
            await post(worker)
            running = running + 1 if (await post(serve))[1] == "0" else 0
            warm += 1
        for _ in range(n):
            direct.append((await post(worker))[0])
            took, chosen = await post(serve)
            routed.append(took)
            elsewhere += chosen != "0"
    return direct, routed, elsewhere, warm + n


def router_side(metrics: str) -> dict[str, Any]:
    """What a run reads from the router's ``/metrics``: events applied, and the decision-time
    and event-slice histograms (cumulative buckets), to be subtracted run by run."""
    out: dict[str, Any] = {"events": 0.0, "decision": {}, "slice": {}, "gc": {}}
    names = {
        "router_decision_seconds": "decision",
        "router_event_apply_seconds": "slice",
        "router_gc_pause_seconds": "gc",  # all generations together
    }
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == "router_events_applied_total":
                out["events"] = s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in names:
                hist = out[names[s.name[: -len("_bucket")]]]
                le = float(s.labels["le"])
                hist[le] = hist.get(le, 0.0) + s.value
    return out


def side_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Between two snapshots: events applied, decisions and their p50/p99 bucket bounds,
    event slices and their p99/max bucket bounds (upper bounds: histogram buckets)."""

    def diff(name: str) -> tuple[list[tuple[float, float]], float]:
        b = sorted((le, c - before[name].get(le, 0.0)) for le, c in after[name].items())
        return b, (b[-1][1] if b else 0.0)

    def bound(buckets: list[tuple[float, float]], count: float, q: float) -> float:
        return next((le for le, c in buckets if c >= q * count), float("inf")) * 1e3

    dec, n = diff("decision")
    sl, m = diff("slice")
    pauses, k = diff("gc")
    return {
        "gc": k,
        "gc_max_le_ms": bound(pauses, k, 1.0),
        "events": after["events"] - before["events"],
        "decisions": n,
        "p50_le_ms": bound(dec, n, 0.5),
        "p99_le_ms": bound(dec, n, 0.99),
        "slices": m,
        "slice_p99_le_ms": bound(sl, m, 0.99),
        "slice_max_le_ms": bound(sl, m, 1.0),
    }


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
        "--router-cpu",
        type=int,
        help="give the routers this CPU to themselves and every other process (workers, event "
        "load, load generator) the remaining ones: a router deployed on a core of its own",
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
    ap.add_argument(
        "--rate",
        type=float,
        help="open loop: POST /route at this many requests/s (latency from the scheduled "
        "send time) instead of the closed loop",
    )
    ap.add_argument(
        "--rates", default="", help="open loop at each of these rates (comma-separated), in turn"
    )
    ap.add_argument("--poisson", action="store_true", help="open loop: Poisson arrivals")
    ap.add_argument(
        "--connections",
        type=int,
        default=128,
        help="open loop: keep-alive connections (one request in flight each)",
    )
    ap.add_argument("--warmup", type=float, default=0.5, help="open loop: unmeasured seconds")
    ap.add_argument("-v", "--verbose", action="store_true", help="open loop: more per rate")
    args = ap.parse_args()
    if args.rate is not None:
        args.rates = f"{args.rate:g}" + ("," + args.rates if args.rates else "")
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
        if args.router_cpu is not None:
            others = os.sched_getaffinity(0) - {args.router_cpu}
            if not others or args.router_cpu not in os.sched_getaffinity(0):
                raise SystemExit(f"--router-cpu {args.router_cpu}: needs that CPU and another")
            for p in procs:
                pin(p.pid, {args.router_cpu} if p in routers else others)
            pin(os.getpid(), others)  # this process, and the event load it starts below

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
        stop, loaded = multiprocessing.Event(), multiprocessing.Event()
        phases = len(args.encodings.split(",")) * max(1, len(args.rates.split(",")))
        count = int(args.event_rps * (phases * (args.seconds + args.warmup + 3) + 10))
        loader = multiprocessing.Process(
            target=event_load,
            args=([e["http"] for e in entries], args.event_rps, tokens, count, loaded, stop),
        )

        def fleet_cpu_s() -> float:
            pids = [p.pid for p in procs if p not in routers]
            if loader.pid is not None:
                pids.append(loader.pid)
            return sum(cpu_s(pid) for pid in pids)

        if args.event_rps > 0:
            loader.start()
            if not loaded.wait(300):
                raise RuntimeError("the event load generator did not start")
            time.sleep(1.0)  # pacing: the event load runs at its rate before the measurement
        rates = [float(r) for r in args.rates.split(",")] if args.rates else []
        mode = (
            f"open loop at {', '.join(f'{r:g}' for r in rates)} requests/s"
            f"{' (Poisson arrivals)' if args.poisson else ''}, {args.connections} keep-alive "
            f"connections, latency from the scheduled send time, {args.warmup:g} s warm-up"
            if rates
            else f"closed loop, concurrency {args.concurrency}"
        )
        print(
            f"POST /route, {tokens}-token prompts sharing a cached prefix, {args.workers} "
            f"workers fed {args.event_rps:g} fresh {tokens}-token prompts/s "
            f"({args.event_rps * tokens / TPB:.0f} new blocks/s), {mode}, "
            f"{args.seconds:g} s per run"
            + (f", routers at nice {args.router_nice}" if args.router_nice else "")
            + (f", routers on CPU {args.router_cpu} alone" if args.router_cpu is not None else "")
        )
        if rates:
            print(
                "  body    offered achieved | latency from schedule, ms: p50    p90    p99  "
                "p99.9    max | errors late waited | router: CPU us/decision, route() p99 <= ms, "
                "event slices (max <= ms), events applied\n"
                "  (errors: not 200 or unanswered; late: sent > 1 ms behind schedule; waited: "
                "for a free connection)"
            )
        host, port = serve.split("//", 1)[1].rsplit(":", 1)
        for name in args.encodings.split(","):
            ctype, bodies = encodings[name]
            runs: list[float | None] = [*rates] if rates else [None]
            for rate in runs:
                before = router_side(asyncio.run(fetch(serve + "/metrics")))
                spy = None
                if args.profile:
                    os.makedirs(args.profile, exist_ok=True)
                    tag = name if rate is None else f"{name}-{rate:g}"
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
                            os.path.join(args.profile, f"route-{tag}.txt"),
                            "-r",
                            "200",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                c0 = router_cpu_s()
                fleet0 = fleet_cpu_s()
                waited0 = sum(runqueue_wait_s(p.pid) for p in routers)
                own_wait0 = runqueue_wait_s(os.getpid())
                own0 = time.process_time()
                t0 = time.perf_counter()
                if rate is None:
                    n, lat = asyncio.run(
                        route_load(serve + "/route", bodies, args.seconds, args.concurrency, ctype)
                    )
                else:
                    requests = [http_request(host, int(port), "/route", ctype, b) for b in bodies]
                    report = run_open_loop(
                        host,
                        int(port),
                        requests,
                        rate,
                        args.seconds,
                        warmup_s=args.warmup,
                        connections=args.connections,
                        poisson=args.poisson,
                    )
                wall = time.perf_counter() - t0
                router_cpu = router_cpu_s() - c0
                client_cpu = time.process_time() - own0
                fleet_cpu = fleet_cpu_s() - fleet0
                waited = sum(runqueue_wait_s(p.pid) for p in routers) - waited0
                own_waited = runqueue_wait_s(os.getpid()) - own_wait0
                if spy is not None:
                    spy.wait(30)
                side = side_delta(before, router_side(asyncio.run(fetch(serve + "/metrics"))))
                if rate is None:
                    print(
                        f"  {name:6} {n / wall:6.0f} decisions/s   "
                        f"latency p50 {pct(lat, 0.5) * 1e3:5.2f} ms"
                        f"  p99 {pct(lat, 0.99) * 1e3:6.2f} ms (client side)   "
                        + (
                            f"Stored events applied meanwhile {side['events']:.0f}\n"
                            if len(routers) == 1
                            else f"({len(routers)} routers)\n"
                        )
                        + f"         service CPU {router_cpu / n * 1e6:4.0f} us per decision "
                        f"(= {n / router_cpu:.0f} decisions/s per core); load generator CPU "
                        f"{client_cpu / n * 1e6:.0f} us per request"
                    )
                else:
                    ms = {k: v * 1e3 for k, v in report.latency_s.items()}
                    # every router's decisions (the metrics read above are one router's
                    # when several share the port): the answers the client counted
                    per = router_cpu / report.answered_total * 1e6 if report.answered_total else 0.0
                    print(
                        f"  {name:6} {report.offered_rate:7.0f} {report.achieved_rate:8.0f} | "
                        f"{' ' * 25}{ms['p50']:6.2f} {ms['p90']:6.2f} {ms['p99']:6.2f} "
                        f"{ms['p99.9']:6.2f} {ms['max']:6.2f} | "
                        f"{report.errors + report.unanswered:6d} {report.late_sends:4d} "
                        f"{report.waited_for_connection:6d} | {per:4.0f}, "
                        f"{side['p99_le_ms']:.2f}, {side['slices']:.0f} "
                        f"({side['slice_max_le_ms']:.1f}), {side['events']:.0f}"
                    )
                    if args.verbose:
                        print(
                            f"         client: lag p99 {report.send_lag_p99_s * 1e3:.2f} ms, "
                            f"max {report.send_lag_max_s * 1e3:.2f} ms; p99 from the actual "
                            f"send {report.service_p99_s * 1e3:.2f} ms; CPU "
                            f"{client_cpu / max(1, report.answered_total) * 1e6:.0f} us/request; "
                            f"route() p50 <= {side['p50_le_ms']:.2f} ms, slices p99 <= "
                            f"{side['slice_p99_le_ms']:.2f} ms; GC pauses {side['gc']:.0f}, max "
                            f"<= {side['gc_max_le_ms']:.2f} ms\n"
                            f"         cores busy (of 2): router {router_cpu / wall:.2f}, "
                            f"load generator {client_cpu / wall:.2f}, workers and event load "
                            f"{fleet_cpu / wall:.2f}; waiting for a core: router "
                            f"{waited / wall * 1e3:.0f} ms/s, load generator "
                            f"{own_waited / wall * 1e3:.0f} ms/s"
                        )
        stop.set()
        if args.event_rps > 0:
            loader.join(30)
        if not rates:
            print(
                f"  route() inside the service, last run: p50 <= {side['p50_le_ms']:.2f} ms, "
                f"p99 <= {side['p99_le_ms']:.2f} ms; event application held the loop "
                f"{side['slices']:.0f} times, p99 <= {side['slice_p99_le_ms']:.2f} ms, max <= "
                f"{side['slice_max_le_ms']:.2f} ms (histogram bucket bounds"
                + (")" if len(routers) == 1 else ", one of the routers)")
            )
        if args.proxy_requests < 1:
            return
        pr = shared[0] + [1]
        body = json.dumps({"prompt": pr, "max_tokens": 1}).encode()
        c0 = router_cpu_s()
        direct, routed, elsewhere, through = asyncio.run(
            proxy_overhead(serve, entries[0]["http"], body, args.proxy_requests)
        )
        proxy_cpu_us = (router_cpu_s() - c0) / through * 1e6
        d50, r50 = statistics.median(direct), statistics.median(routed)
        print(
            f"proxy: /v1/completions, {tokens}-token cached prompt, max_tokens 1, sequential, "
            f"{len(direct)} each"
            + (f" ({elsewhere} routed to another worker than the cached one)" if elsewhere else "")
            + "\n"
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
