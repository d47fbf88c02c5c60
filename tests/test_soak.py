"""Randomized fault soak: worker processes over tcp, a subscriber, and a seeded schedule of every
fault the stream knows (frames lost on the network, event buffers overflowing, publisher queues
overflowing, workers killed and restarted with a new cache on the same ports, a replay flood).
After quiescence each worker's view must be exact, or reported not ok with no stale block:
never "ok" and wrong. A short form runs by default; the long one is marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq_helpers import SEQ, free_tcp_port, zmq_context

from events.stream.subscriber import BatchDelivery, ResyncRequired, ZmqEventSubscriber
from events.wire.model import AllBlocksCleared, Removed, Stored

Ctx = zmq.Context[zmq.Socket[bytes]]
WORKER = Path(__file__).with_name("soak_worker.py")


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


class Worker:
    def __init__(self, ctx: Ctx, wid: int, seed: int) -> None:
        self.ctx = ctx
        self.wid = wid
        self.seed = seed
        self.ports = (free_tcp_port(), free_tcp_port(), free_tcp_port())
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.started = 0.0

    @property
    def live(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[0]}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    def start(self) -> None:
        self.starts += 1
        self.started = time.monotonic()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        args = [str(p) for p in (*self.ports, self.seed * 100 + self.starts)]
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], env=env)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def command(self, what: str, timeout_s: float = 15.0) -> str:
        req = self.ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{self.ports[2]}")
        try:
            req.send_string(what)
            if not req.poll(int(timeout_s * 1000)):
                raise AssertionError(f"worker {self.wid} did not answer {what!r}")
            return req.recv_string()
        finally:
            req.close(linger=0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(AssertionError):
                self.command("exit", 5)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class View:
    """What a router holds per worker: block hash -> tier, rebuilt from deliveries."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, int]] = {}

    def apply(self, messages: list[BatchDelivery | ResyncRequired]) -> None:
        for m in messages:
            held = self.blocks.setdefault(m.worker, {})
            if isinstance(m, ResyncRequired):
                held.clear()
                continue
            for event in m.batch.events:
                data = event.data
                if isinstance(data, Stored):
                    for b in data.blocks:
                        held[str(b.block_hash)] = b.cache_level
                elif isinstance(data, Removed):
                    for h in data.block_hashes:
                        held.pop(str(h), None)
                elif isinstance(data, AllBlocksCleared):
                    held.clear()


def flood(ctx: Ctx, endpoint: str, stop: threading.Event) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        while not stop.wait(0.001):
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart([b"", SEQ.pack(0)], zmq.NOBLOCK)
            while dealer.poll(0):
                dealer.recv_multipart()
    finally:
        dealer.close(linger=0)


def run_soak(ctx: Ctx, seed: int, workers: int, seconds: float) -> dict[str, int]:
    rng = random.Random(seed)
    fleet = [Worker(ctx, w, seed * 10 + w) for w in range(workers)]
    view = View()
    stop = threading.Event()
    flooders: list[threading.Thread] = []
    try:
        for w in fleet:
            w.start()
        with ZmqEventSubscriber(
            context=ctx, replay_timeout_ms=500, snapshot_timeout_ms=3000, probe_interval_ms=300
        ) as sub:
            for w in fleet:
                sub.add_worker(w.wid, w.live, w.replay)
            end = time.monotonic() + seconds
            next_fault = time.monotonic() + rng.uniform(0.3, 1.0)
            kills = 0
            while time.monotonic() < end:
                view.apply(sub.poll(10))
                if time.monotonic() >= next_fault:
                    next_fault = time.monotonic() + rng.uniform(0.3, 1.0)
                    victim = rng.choice(fleet)
                    if rng.random() < 0.7 and time.monotonic() - victim.started > 1.0:
                        victim.kill()  # its cache is gone; a new one starts on the same ports
                        victim.start()
                        kills += 1
                    elif not flooders:
                        t = threading.Thread(
                            target=flood, args=(ctx, victim.replay, stop), daemon=True
                        )
                        t.start()
                        flooders.append(t)
            stop.set()
            for t in flooders:
                t.join(5)
            for w in fleet:
                w.command("pause")
            truth = {w.wid: json.loads(w.command("state")) for w in fleet}

            def settled() -> bool:
                return all(
                    sub.status(w.wid).state == "ok" and view.blocks.get(w.wid, {}) == truth[w.wid]
                    for w in fleet
                )

            deadline = time.monotonic() + 20
            while not settled() and time.monotonic() < deadline:
                view.apply(sub.poll(20))
            result = {"kills": kills, "ok": 0, "degraded": 0}
            for w in fleet:
                status = sub.status(w.wid)
                for name in ("gaps", "restarts", "resyncs", "snapshots", "duplicates"):
                    result[name] = result.get(name, 0) + getattr(status, name)
                held = view.blocks.get(w.wid, {})
                if status.state == "ok":
                    result["ok"] += 1
                    assert held == truth[w.wid], f"worker {w.wid} is ok and wrong: {status}"
                else:
                    result["degraded"] += 1
                    stale = set(held) - set(truth[w.wid])
                    assert not stale, f"worker {w.wid}: {len(stale)} stale blocks ({status})"
            return result
    finally:
        stop.set()
        for w in fleet:
            w.stop()


@pytest.mark.timeout(120)
def test_fault_soak_short(ctx: Ctx) -> None:
    result = run_soak(ctx, seed=1, workers=2, seconds=4.0)
    # with snapshots every worker ends exact, not just "not wrong"
    assert result["ok"] == 2, result
    # under load a killed worker may not have been seen yet: its restart is then invisible
    assert result["kills"] >= 1 and result["snapshots"] >= 1, result


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", range(5))
def test_fault_soak_long(ctx: Ctx, seed: int) -> None:
    result = run_soak(ctx, seed=100 + seed, workers=4, seconds=60.0)
    assert result["ok"] == 4, result
