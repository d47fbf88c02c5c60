"""Health and load probes, one per engine: each worker is asked through its own endpoints.

A fleet entry names its engine (``"engine"``; ``native`` when absent). The router asks each
one what that engine serves, and nothing else:

- ``native`` (this project's ``router-sim worker``): ``GET /healthz``, a JSON document with the
  worker's incarnation, last published seq, block size, hash algorithm and load.
- ``vllm``: ``GET /health`` (an empty 200; 503 once its engine core has died), then the
  Prometheus text of ``GET /metrics``: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full;
  vLLM 0.26-0.33, ``vllm/v1/metrics/loggers.py``), or the older name
  ``vllm:gpu_cache_usage_perc``. Each is labelled by ``model_name`` and ``engine`` (one series
  per data-parallel engine behind the server): requests are summed, usage is the fullest.
- ``sglang``: ``GET /health`` (200; 503 while it starts or shuts down) and ``GET /metrics``,
  served only when SGLang runs with ``--enable-metrics``: ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` and ``sglang:token_usage`` (a fraction of the KV pool; SGLang 0.5,
  ``sglang/srt/observability/metrics_collector.py``).
- ``trtllm`` (``trtllm-serve``): ``GET /health``, and ``GET /metrics``, which answers a JSON list
  of the iteration statistics gathered since the previous call (so often an empty list: then
  the load read last stands): the last entry's ``numActiveRequests``, ``numQueuedRequests``
  and ``kvCacheStats.usedNumBlocks / maxNumBlocks``.

Engines announce no incarnation: their restarts are read from their event streams (a seq going
backwards), not from here. A probe that fails raises :class:`ProbeFailed` with a sentence
saying what was asked, what came back and what to check; a worker that is alive but whose load
cannot be read is still routed to (its load is then what the router forwarded to it) and the
reason is kept in :attr:`ProbeResult.load_error`.

Everything read is bounded: at most :data:`MAX_PROBE_BYTES` per answer, under the probe's
timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp

Engine = Literal["native", "vllm", "sglang", "trtllm"]
ENGINES: Final[tuple[Engine, ...]] = ("native", "vllm", "sglang", "trtllm")

MAX_PROBE_BYTES: Final = 8 * 1024 * 1024
"""Largest health or metrics answer read (vLLM's /metrics is ~100-300 KB with its histograms)."""

# metric names (see the module docstring for where each comes from)
VLLM_RUNNING: Final = b"vllm:num_requests_running"
VLLM_WAITING: Final = b"vllm:num_requests_waiting"
VLLM_KV: Final = b"vllm:kv_cache_usage_perc"
VLLM_KV_OLD: Final = b"vllm:gpu_cache_usage_perc"
SGLANG_RUNNING: Final = b"sglang:num_running_reqs"
SGLANG_WAITING: Final = b"sglang:num_queue_reqs"
SGLANG_KV: Final = b"sglang:token_usage"

_GAUGES: Final[dict[str, tuple[bytes, bytes, tuple[bytes, ...]]]] = {
    "vllm": (VLLM_RUNNING, VLLM_WAITING, (VLLM_KV, VLLM_KV_OLD)),
    "sglang": (SGLANG_RUNNING, SGLANG_WAITING, (SGLANG_KV,)),
}
_PRODUCT: Final = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "trtllm-serve"}


class ProbeFailed(Exception):
    """The worker did not answer its health probe; the message says why."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe learned. ``requests``: running + waiting by the engine's own count
    (None: not read); ``kv_usage`` in [0, 1] or None. The native worker also tells its
    incarnation, last published seq, block size and hash algorithm."""

    kv_usage: float | None = None
    requests: int | None = None
    load_error: str | None = None
    incarnation: str | None = None
    published_seq: int | None = None
    tokens_per_block: int | None = None
    hash_algo: str | None = None


# ------------------------------------------------------------------ Prometheus text


def _labels_end(rest: bytes) -> int:
    """Index just past the ``}`` closing the label set that opens ``rest``; -1 if none.
    Label values are quoted and may hold ``}``, spaces and backslash escapes."""
    quoted = False
    i = 1
    n = len(rest)
    while i < n:
        c = rest[i]
        if quoted:
            if c == 0x5C:  # backslash: the next byte is escaped
                i += 1
            elif c == 0x22:
                quoted = False
        elif c == 0x22:
            quoted = True
        elif c == 0x7D:
            return i + 1
        i += 1
    return -1


def _sample_value(rest: bytes) -> float | None:
    """The value of a sample line, given what follows the metric's name on it."""
    if rest[:1] == b"{":
        end = _labels_end(rest)
        if end < 0:
            return None
        rest = rest[end:]
    if rest[:1] not in (b" ", b"\t"):
        return None  # another metric whose name starts with this one, or garbage
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_gauges(text: bytes, names: Collection[bytes]) -> dict[bytes, list[float]]:
    """The finite values of every sample of each metric in ``names`` (one per label set) in a
    Prometheus text exposition; names absent from the text map to an empty list. Only the
    wanted lines are looked at: an engine's page holds thousands of others."""
    body = b"\n" + text
    found: dict[bytes, list[float]] = {}
    for name in names:
        values: list[float] = []
        needle = b"\n" + name
        at = body.find(needle)
        while at >= 0:
            start = at + len(needle)
            eol = body.find(b"\n", start)
            if eol < 0:
                eol = len(body)
            value = _sample_value(body[start:eol])
            if value is not None:
                values.append(value)
            at = body.find(needle, eol)
        found[name] = values
    return found


def prometheus_load(engine: str, text: bytes) -> tuple[int, float]:
    """(running + waiting requests, KV usage) from an engine's Prometheus page; ValueError
    naming what is missing."""
    running, waiting, kv_names = _GAUGES[engine]
    got = read_gauges(text, (running, waiting, *kv_names))
    missing = [n.decode() for n in (running, waiting) if not got[n]]
    kv = next((got[n] for n in kv_names if got[n]), [])
    if not kv:
        missing.append(" or ".join(n.decode() for n in kv_names))
    if missing:
        raise ValueError(
            f"its /metrics has no {', '.join(missing)}: is it {_PRODUCT[engine]}"
            + (" (started with --enable-metrics)?" if engine == "sglang" else "?")
        )
    requests = sum(got[running]) + sum(got[waiting])
    return max(0, round(requests)), min(1.0, max(0.0, max(kv)))


def trtllm_load(doc: Any) -> tuple[int, float] | None:
    """(active + queued requests, KV usage) from trtllm-serve's iteration statistics, the
    last entry's; None for an empty list (no iteration since the last call)."""
    if not isinstance(doc, list):
        raise ValueError("its /metrics is not a JSON list of iteration statistics")
    if not doc:
        return None
    last = doc[-1]
    if not isinstance(last, dict):
        raise ValueError("its /metrics entries are not JSON objects")
    try:
        requests = int(last["numActiveRequests"]) + int(last.get("numQueuedRequests", 0))
        kv = last.get("kvCacheStats") or {}
        total = int(kv.get("maxNumBlocks", 0))
        used = int(kv.get("usedNumBlocks", total - int(kv.get("freeNumBlocks", total))))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"its /metrics entry lacks {exc}") from None
    usage = used / total if total > 0 else 0.0
    return max(0, requests), min(1.0, max(0.0, usage))


# ------------------------------------------------------------------ HTTP


async def _read_capped(resp: aiohttp.ClientResponse, url: str) -> bytes:
    size = resp.content_length
    if size is not None and size > MAX_PROBE_BYTES:
        raise ProbeFailed(f"GET {url} answered {size} bytes, over the {MAX_PROBE_BYTES} read")
    chunks: list[bytes] = []
    total = 0
    async for chunk in resp.content.iter_any():
        total += len(chunk)
        if total > MAX_PROBE_BYTES:
            raise ProbeFailed(f"GET {url} answered over {MAX_PROBE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes]:
    """(status, body) of ``GET url``; :class:`ProbeFailed` saying why when nothing came back."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await _read_capped(resp, url)
    except asyncio.TimeoutError:
        raise ProbeFailed(f"GET {url} did not answer within {timeout_s:g} s") from None
    except aiohttp.ClientConnectorError as exc:
        raise ProbeFailed(f"cannot connect to {url}: {exc.os_error or exc}") from None
    except aiohttp.ClientError as exc:
        raise ProbeFailed(f"GET {url} failed: {type(exc).__name__}: {exc}") from None


def _status_error(engine: str, url: str, status: int) -> ProbeFailed:
    hint = ""
    if status == 404 and engine == "native":
        hint = (
            ": not a router-sim worker (for a vLLM, SGLang or TensorRT-LLM engine, set "
            '"engine" in its fleet entry)'
        )
    elif status == 404:
        hint = f': is it {_PRODUCT[engine]}? (set "engine" in its fleet entry to what it runs)'
    elif status == 503 and engine == "vllm":
        hint = ": vLLM answers 503 once its engine has died"
    elif status == 503 and engine == "sglang":
        hint = ": SGLang answers 503 while it starts up or shuts down"
    return ProbeFailed(f"GET {url} answered {status}{hint}")


async def probe(
    session: aiohttp.ClientSession, engine: str, base: str, timeout_s: float
) -> ProbeResult:
    """Probe the worker at ``base`` (its HTTP address) as ``engine`` serves."""
    if engine == "native":
        return await _probe_native(session, base, timeout_s)
    url = base + "/health"
    status, _ = await _get(session, url, timeout_s)
    if status != 200:
        raise _status_error(engine, url, status)
    url = base + "/metrics"
    try:
        status, body = await _get(session, url, timeout_s)
    except ProbeFailed as exc:
        return ProbeResult(load_error=str(exc))
    if status != 200:
        why = f"GET {url} answered {status}"
        if engine == "sglang" and status == 404:
            why += ": start SGLang with --enable-metrics so that its load can be read"
        return ProbeResult(load_error=why)
    try:
        if engine == "trtllm":
            load = trtllm_load(json.loads(body))
            if load is None:
                return ProbeResult()  # no iteration since the last read: keep the last load
        else:
            load = prometheus_load(engine, body)
    except ValueError as exc:  # json's errors are ValueErrors too
        return ProbeResult(load_error=f"GET {url}: {exc}")
    return ProbeResult(requests=load[0], kv_usage=load[1])


async def _probe_native(session: aiohttp.ClientSession, base: str, timeout_s: float) -> ProbeResult:
    url = base + "/healthz"
    status, body = await _get(session, url, timeout_s)
    if status != 200:
        raise _status_error("native", url, status)
    try:
        health = json.loads(body)
        tpb, algo = health.get("tokens_per_block"), health.get("hash_algo")
        return ProbeResult(
            kv_usage=min(1.0, max(0.0, float(health["load"]["kv_usage"]))),
            incarnation=str(health["incarnation"]),
            published_seq=int(health["last_seq"]),
            tokens_per_block=None if tpb is None else int(tpb),
            hash_algo=None if algo is None else str(algo),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProbeFailed(
            f"GET {url} is not a router-sim worker's health ({type(exc).__name__}: {exc})"
        ) from None


async def served_models(
    session: aiohttp.ClientSession, base: str, timeout_s: float
) -> list[dict[str, Any]]:
    """The model cards of an engine's ``GET /v1/models`` (``id``, ``max_model_len``,
    ``parent`` for a LoRA adapter, as vLLM and SGLang answer); [] when it does not say."""
    try:
        status, body = await _get(session, base + "/v1/models", timeout_s)
        doc = json.loads(body) if status == 200 else {}
    except (ProbeFailed, ValueError):
        return []
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
