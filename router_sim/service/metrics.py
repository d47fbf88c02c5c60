"""Prometheus metrics of the router service (``GET /metrics``), through prometheus-client.

Two kinds: what the service observes as it happens (decisions, their latency and overlap,
proxied requests) are client-library counters and histograms updated on the spot; what other
objects already count (events applied by the index, gaps and resyncs seen by the subscriber,
index size) is read from them at scrape time by a custom collector, so no number is kept twice.
Each service owns its registry: two services in one process (tests) never share counters.
Per-worker counters never decrease: the event pump carries a worker's stream counters over
its restarts and over its removal and re-adding (see :mod:`router_sim.service.pump`).

The collector's pauses are measured too (``router_gc_pause_seconds``): a collection holds
every thread of the process, so a request that arrives meanwhile waits for it whole.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from events.stream.subscriber import WorkerStatus

# decision latency: 10 us .. 100 ms (route() of an 8k-token prompt is ~0.1 ms)
_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


@dataclass(frozen=True, slots=True)
class WorkerGauges:
    """One worker's lag and KV usage at scrape time (None: not known)."""

    lag_s: float | None
    lag_seqs: int | None
    kv_usage: float


def _no_gauges() -> dict[int, WorkerGauges]:
    return {}


@dataclass(frozen=True, slots=True)
class IndexView:
    """What the collector reads at scrape time (callables, so it always sees the present)."""

    events_applied: Callable[[], int]
    batches_applied: Callable[[], int]
    resyncs: Callable[[], int]
    index_entries: Callable[[], int]
    blocks: Callable[[], dict[int, int]]
    streams: Callable[[], dict[int, WorkerStatus]]
    eligible: Callable[[], dict[int, bool]]
    gauges: Callable[[], dict[int, WorkerGauges]] = _no_gauges


class _IndexCollector(Collector):
    def __init__(self, view: IndexView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        v = self._view
        yield CounterMetricFamily(
            "router_events_applied", "KV events applied to the index", value=v.events_applied()
        )
        yield CounterMetricFamily(
            "router_batches_applied", "event batches applied to the index", v.batches_applied()
        )
        yield CounterMetricFamily(
            "router_resyncs", "worker views dropped after lost events or restarts", v.resyncs()
        )
        yield GaugeMetricFamily(
            "router_index_entries", "(block, worker) pairs in the index", value=v.index_entries()
        )
        blocks = GaugeMetricFamily("router_index_blocks", "blocks indexed", labels=["worker"])
        for w, n in sorted(v.blocks().items()):
            blocks.add_metric([str(w)], n)
        yield blocks
        per = {
            "received": CounterMetricFamily(
                "router_stream_received", "live batches received", labels=["worker"]
            ),
            "gaps": CounterMetricFamily(
                "router_stream_gaps", "gaps in a worker's seq numbers", labels=["worker"]
            ),
            "replayed": CounterMetricFamily(
                "router_stream_replayed",
                "batches received through gap replays (some may also have come live)",
                labels=["worker"],
            ),
            "recovered": CounterMetricFamily(
                "router_stream_recovered",
                "batches lost live that a replay delivered",
                labels=["worker"],
            ),
            "resyncs": CounterMetricFamily(
                "router_stream_resyncs", "unrecoverable losses", labels=["worker"]
            ),
            "restarts": CounterMetricFamily(
                "router_stream_restarts", "publisher restarts detected", labels=["worker"]
            ),
            "decode_errors": CounterMetricFamily(
                "router_stream_decode_errors", "undecodable frames", labels=["worker"]
            ),
        }
        ok = GaugeMetricFamily(
            "router_stream_ok", "1 when the worker's view is provably complete", labels=["worker"]
        )
        for w, st in sorted(v.streams().items()):
            for name, fam in per.items():
                fam.add_metric([str(w)], getattr(st, name))
            ok.add_metric([str(w)], 1.0 if st.state == "ok" else 0.0)
        yield from per.values()
        yield ok
        yield GaugeMetricFamily(
            "router_gc_frozen_objects",
            "objects the garbage collector no longer traverses (gc.freeze after startup)",
            value=gc.get_freeze_count(),
        )
        up = GaugeMetricFamily(
            "router_worker_up", "1 when the worker answers its health probe", labels=["worker"]
        )
        for w, flag in sorted(v.eligible().items()):
            up.add_metric([str(w)], 1.0 if flag else 0.0)
        yield up
        lag_s = GaugeMetricFamily(
            "router_event_lag_seconds",
            "seconds from the publishing of a worker's last applied batch to its application",
            labels=["worker"],
        )
        lag_seqs = GaugeMetricFamily(
            "router_event_lag_seqs",
            "batches a worker published that are not applied yet (workers that tell their "
            "last seq: native)",
            labels=["worker"],
        )
        kv = GaugeMetricFamily(
            "router_worker_kv_usage", "the KV usage a worker reports, in [0, 1]", labels=["worker"]
        )
        for w, g in sorted(v.gauges().items()):
            if g.lag_s is not None:
                lag_s.add_metric([str(w)], g.lag_s)
            if g.lag_seqs is not None:
                lag_seqs.add_metric([str(w)], float(g.lag_seqs))
            kv.add_metric([str(w)], g.kv_usage)
        yield lag_s
        yield lag_seqs
        yield kv


class ServiceMetrics:
    """The service's metrics and the registry that exposes them."""

    def __init__(self, view: IndexView) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("router_decisions", "routing decisions", ["worker"], registry=r)
        self.decision_seconds = Histogram(
            "router_decision_seconds",
            "time to hash a prompt, match it and choose a worker",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overlap_fraction = Histogram(
            "router_overlap_fraction",
            "share of the prompt's blocks the chosen worker holds, per decision",
            buckets=_FRACTION_BUCKETS,
            registry=r,
        )
        self.overlap_blocks = Counter(
            "router_overlap_blocks", "prompt blocks the chosen worker held, summed", registry=r
        )
        self.proxied = Counter(
            "router_proxy_requests", "completions forwarded", ["worker", "outcome"], registry=r
        )
        self.inflight = Gauge(
            "router_inflight_requests", "forwarded requests not finished", ["worker"], registry=r
        )
        self.bad_requests = Counter(
            "router_bad_requests", "requests refused with a 4xx", registry=r
        )
        self.event_apply_seconds = Histogram(
            "router_event_apply_seconds",
            "time the event loop spent applying one slice of received events (requests wait "
            "meanwhile)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gc_pause_seconds = Histogram(
            "router_gc_pause_seconds",
            "time one garbage collection held the process, by generation",
            ["generation"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._gc_started = 0.0
        r.register(_IndexCollector(view))
        # labels() takes a lock and builds a key on every call: one child per worker, once
        self._decisions_of: dict[int, Counter] = {}

    def decided(self, worker: int, seconds: float, chosen: int, num_blocks: int) -> None:
        child = self._decisions_of.get(worker)
        if child is None:
            child = self._decisions_of[worker] = self.decisions.labels(str(worker))
        child.inc()
        self.decision_seconds.observe(seconds)
        self.overlap_blocks.inc(chosen)
        self.overlap_fraction.observe(chosen / num_blocks if num_blocks else 0.0)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            pause = time.perf_counter() - self._gc_started
            self.gc_pause_seconds.labels(str(info["generation"])).observe(pause)

    def watch_gc(self) -> None:
        """Time every garbage collection of the process from now on (until
        :meth:`unwatch_gc`)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def exposition(self) -> bytes:
        """The text format for ``GET /metrics``."""
        return generate_latest(self.registry)
