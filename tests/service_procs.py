"""Real ``router-sim worker`` / ``router-sim serve`` processes for the service tests.

Every wait is a handshake or a poll with a deadline: a process is ready when it prints its
ready line (read with ``select`` under a deadline), a state is reached when an HTTP poll sees
it. Processes are killed at the end whatever happened.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

STARTUP_S = 30.0
SPEEDUP = "200"  # step times / 200: a 64-token prefill takes ~0.1 ms


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    ready: dict[str, Any]
    argv: list[str] = field(default_factory=list)

    @property
    def http(self) -> str:
        return str(self.ready["http"])

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def _start(argv: list[str], timeout_s: float = STARTUP_S) -> Proc:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "router_sim", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    line = p.stdout.readline() if ready else ""
    if not line:
        p.kill()
        p.wait()
        raise RuntimeError(f"router-sim {' '.join(argv)} did not start within {timeout_s} s")
    return Proc(p, json.loads(line), argv)


def start_worker(worker_id: int, *, ports: dict[str, Any] | None = None, **opts: Any) -> Proc:
    """A worker on free ports (or on the ports of ``ports``, a previous ready line)."""
    argv = ["worker", "--id", str(worker_id), "--speedup", SPEEDUP]
    if ports is not None:
        argv += [
            "--port",
            ports["http"].rsplit(":", 1)[1],
            "--events-port",
            ports["events"].rsplit(":", 1)[1],
            "--replay-port",
            ports["replay"].rsplit(":", 1)[1],
        ]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return _start(argv)


def fleet_file(path: Path, workers: list[Proc], **extra: Any) -> Path:
    entries = [{k: w.ready[k] for k in ("id", "http", "events", "replay")} for w in workers]
    path.write_text(json.dumps({"tokens_per_block": 16, **extra, "workers": entries}))
    return path


def start_serve(fleet: Path, *extra: str) -> Proc:
    return _start(
        ["serve", "--fleet", str(fleet), "--port", "0", "--health-interval", "0.1", *extra]
    )


def request(
    method: str,
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    timeout: float = 10.0,
    content_type: str = "application/json",
) -> tuple[int, dict[str, str], bytes]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(url: str) -> Any:
    status, _, data = request("GET", url)
    assert status == 200, (status, data)
    return json.loads(data)


def post_json(url: str, body: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, data = request("POST", url, body)
    return status, headers, json.loads(data)


def poll(what: str, probe: Callable[[], T | None], timeout_s: float = 15.0) -> T:
    """Call ``probe`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (OSError, urllib.error.URLError):
            last = None
        if last:
            return last
        time.sleep(0.02)  # poll interval, not a barrier: the deadline bounds the wait
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def workers_by_id(serve: Proc) -> dict[int, dict[str, Any]]:
    return {w["id"]: w for w in get_json(serve.http + "/workers")["workers"]}
