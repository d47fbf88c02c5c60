"""The live router's state: the fleet, the index, the load view, and what keeps them current.

:class:`RouterService` ties together a :class:`~router_sim.router.routing.Router` (index + policy),
an
:class:`~router_sim.service.inflight.InFlightLoad` (the load view), an
:class:`~router_sim.service.pump.EventPump` (the workers' event streams) and a health probe
(each worker's ``GET /healthz``, every ``health_interval_s``). Everything here runs on one
asyncio loop; the pump's thread only hands messages over (see :mod:`router_sim.service.pump`).

The probe decides which workers are offered to the policy: a worker that does not answer is
skipped, not forgotten (its index stays until it is seen again). The probe also reads the
worker's *incarnation*: a worker that answers with a new one was restarted, so its old cache is
gone; the service then resubscribes to its stream, which drops the old view and replays the
new stream from its first batch. The subscriber alone cannot always tell a restart from a gap
(a restart whose first frame seen is past the old seq looks like a gap on this wire).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from events.stream.security import CurveClient
from events.stream.subscriber import BatchDelivery, ResyncRequired
from router_sim.router.policies import NoWorkersError, make_policy, without_history
from router_sim.router.routing import Router, RoutingDecision
from router_sim.service.fleet import FleetFile, WorkerEntry
from router_sim.service.inflight import InFlightLoad
from router_sim.service.metrics import IndexView, ServiceMetrics
from router_sim.service.protocol import BadRequest
from router_sim.service.pump import EventPump, PumpItem, WorkerRemoved

log = logging.getLogger(__name__)


class FleetConflict(ValueError):
    """A worker id that is already in the fleet (add) or not in it (remove)."""


@dataclass(slots=True)
class WorkerState:
    """What the service knows of one worker besides its stream and index."""

    entry: WorkerEntry
    up: bool = False
    incarnation: str | None = None
    published_seq: int | None = None
    probe_error: str | None = None
    misconfigured: bool = False


class RouterService:
    """See the module docstring."""

    def __init__(
        self,
        fleet: FleetFile,
        policy: str = "kv_overlap",
        policy_options: dict[str, Any] | None = None,
        *,
        health_interval_s: float = 0.5,
        probe_timeout_s: float = 1.0,
        replay_timeout_ms: int = 1000,
        curve: CurveClient | None = None,
    ) -> None:
        self.fleet = fleet
        self._curve = curve  # CURVE client keys for every worker's event stream
        self.loras = dict(fleet.loras)
        self.load = InFlightLoad(fleet.tokens_per_block)
        self.router = Router(
            fleet.tokens_per_block,
            make_policy(policy, **without_history(policy, policy_options or {})),
            self.load,
            fleet.hash_algo,
            clock=lambda: time.monotonic() * 1000.0,
        )
        self.workers: dict[int, WorkerState] = {}
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._replay_timeout_ms = replay_timeout_ms
        self._pump: EventPump | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        idx = self.router.indexer
        self.metrics = ServiceMetrics(
            IndexView(
                events_applied=lambda: idx.events_applied,
                batches_applied=lambda: self.router.stats.batches_applied,
                resyncs=lambda: self.router.stats.resyncs,
                index_entries=idx.total_entries,
                blocks=lambda: {w: idx.block_count(w) for w in self.workers},
                streams=lambda: self.pump.statuses(),
                eligible=lambda: {w: s.up for w, s in self.workers.items()},
            )
        )

    @property
    def pump(self) -> EventPump:
        if self._pump is None:
            raise RuntimeError("the service is not started")
        return self._pump

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Subscribe to the fleet, probe it once, then keep probing in the background."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.probe_timeout_s),
        )
        self._pump = EventPump(
            asyncio.get_running_loop(),
            self._apply,
            replay_timeout_ms=self._replay_timeout_ms,
            curve=self._curve,
            on_slice=self.metrics.event_apply_seconds.observe,
        )
        self._pump.start()
        self.metrics.watch_gc()
        for entry in self.fleet.workers:
            await self.add_worker(entry, probe=False)
        await self.probe_all()
        self._probe_task = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        self.metrics.unwatch_gc()
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        if self._pump is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._pump.stop)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------- fleet

    async def add_worker(self, entry: WorkerEntry, *, probe: bool = True) -> None:
        """Add a worker at run time (:class:`FleetConflict` if its id is taken)."""
        if entry.id in self.workers:
            raise FleetConflict(f"worker {entry.id} is already in the fleet; remove it first")
        self.workers[entry.id] = WorkerState(entry)
        self.load.add(entry.id)
        self.load.set_eligible(entry.id, False)  # until its first probe answers
        try:
            await self.pump.add_worker(entry.id, entry.events, entry.replay)
        except Exception:
            self.workers.pop(entry.id, None)
            self.load.remove(entry.id)
            raise
        if probe:
            await self.probe(entry.id)

    async def remove_worker(self, worker: int) -> None:
        if worker not in self.workers:
            raise FleetConflict(f"worker {worker} is not in the fleet")
        del self.workers[worker]
        self.load.remove(worker)
        await self.pump.remove_worker(worker)

    def _apply(self, items: list[PumpItem]) -> None:
        router = self.router
        for item in items:
            if isinstance(item, BatchDelivery):
                if item.worker in self.workers:
                    router.apply(item.worker, item.batch)
            elif isinstance(item, ResyncRequired):
                router.reset_worker(item.worker)
            elif isinstance(item, WorkerRemoved):
                router.remove_worker(item.worker)

    # ------------------------------------------------------------- health

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)  # the probe period
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers)))

    async def probe(self, worker: int) -> None:
        state = self.workers.get(worker)
        if state is None or self.session is None:
            return
        url = state.entry.http + "/healthz"
        try:
            timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
            async with self.session.get(url, timeout=timeout) as resp:
                resp.raise_for_status()
                health = await resp.json()
            incarnation = str(health["incarnation"])
            kv_usage = float(health["load"]["kv_usage"])
            published = int(health["last_seq"])
            mismatch = self._mismatch(health)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
            self.mark_down(worker, f"{type(e).__name__}: {e}")
            return
        if self.workers.get(worker) is not state:
            return  # removed (or replaced) while the probe was in flight
        if state.incarnation is not None and incarnation != state.incarnation:
            log.info("worker %d restarted (incarnation %s)", worker, incarnation)
            await self.pump.resubscribe(worker, state.entry.events, state.entry.replay)
        state.incarnation = incarnation
        state.published_seq = published
        if mismatch is not None:
            self.mark_down(worker, mismatch, misconfigured=True)
            return
        state.up = True
        state.misconfigured = False
        state.probe_error = None
        self.load.set_kv_usage(worker, kv_usage)
        self.load.set_eligible(worker, True)

    def _mismatch(self, health: dict[str, Any]) -> str | None:
        """Why a worker's announced block size or hash algorithm differs from the fleet's (its
        blocks would never match a request hashed the fleet's way), or None. Engines that do not
        say are trusted."""
        fleet = self.fleet
        tpb, algo = health.get("tokens_per_block"), health.get("hash_algo")
        if tpb is not None and int(tpb) != fleet.tokens_per_block:
            return f"the worker has {tpb} tokens per block, the fleet {fleet.tokens_per_block}"
        if algo is not None and str(algo) != fleet.hash_algo:
            return f"the worker hashes with {algo}, the fleet with {fleet.hash_algo}"
        return None

    def mark_down(self, worker: int, why: str, *, misconfigured: bool = False) -> None:
        """Stop offering ``worker`` until its health probe answers again (and, when
        ``misconfigured``, agrees with the fleet's block size and hash algorithm)."""
        state = self.workers.get(worker)
        if state is None:
            return
        if state.up or misconfigured != state.misconfigured:
            log.warning("worker %d is %s: %s", worker, _down(misconfigured), why)
        state.up = False
        state.misconfigured = misconfigured
        state.probe_error = why
        self.load.set_eligible(worker, False)

    # ------------------------------------------------------------- routing

    def resolve_lora(self, lora_id: int | None, *names: str | None) -> int | None:
        """The LoRA id of a request: ``lora_id``, or the first name the fleet's ``loras``
        table knows (``lora_name`` must be known; ``model`` may be the base model's name)."""
        lora_name, *others = names
        if lora_name is not None:
            if lora_name not in self.loras:
                raise BadRequest(
                    f"unknown lora_name {lora_name!r}; the fleet knows {sorted(self.loras)}"
                )
            found = self.loras[lora_name]
            if lora_id is not None and lora_id != found:
                raise BadRequest(f"lora_id {lora_id} and lora_name {lora_name!r} disagree")
            return found
        for name in others:
            if name is not None and name in self.loras and lora_id is None:
                return self.loras[name]
        return lora_id

    def decide(
        self, prompt: Sequence[int], lora_id: int | None, salt: str | None
    ) -> RoutingDecision:
        """Route one prompt (raises ``NoWorkersError`` when no worker is eligible, and
        :class:`BadRequest` for token ids the hashing refuses)."""
        try:
            decision = self.router.route(prompt, lora_id=lora_id, cache_salt=salt)
        except NoWorkersError:
            raise
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None
        self.metrics.decided(
            decision.worker,
            decision.decision_us / 1e6,
            decision.chosen_overlap,
            len(decision.block_hashes),
        )
        return decision

    def explain(self, d: RoutingDecision) -> dict[str, Any]:
        """A decision as JSON: the worker, its address, and why (per-candidate figures)."""
        state = self.workers.get(d.worker)
        return {
            "worker": d.worker,
            "http": state.entry.http if state is not None else None,
            "policy": d.policy,
            "reason": d.reason,
            "num_tokens": d.num_tokens,
            "num_blocks": len(d.block_hashes),
            "overlaps": _keyed(d.overlaps),
            "device_overlaps": _keyed(d.device_overlaps),
            "costs": _keyed(d.costs),
            "best_overlap": d.best_overlap,
            "chosen_overlap": d.chosen_overlap,
            "locality_given_up": d.locality_given_up,
            "decision_us": round(d.decision_us, 1),
        }

    def _keying(self, worker: int) -> str | None:
        """How the index keys ``worker``'s blocks: ``tokens`` (requests find them),
        ``engine_hashes`` (its events carry no token ids), ``mixed`` or ``none``; None with an
        index that does not tell."""
        status = getattr(self.router.indexer, "worker_status", None)
        if status is None:
            return None
        keying = getattr(status(worker), "keying", None)
        return None if keying is None else str(keying)

    def worker_report(self, worker: int) -> dict[str, Any]:
        """``GET /workers`` for one worker."""
        state = self.workers[worker]
        st = self.pump.statuses().get(worker)
        stream = None if st is None else st.state
        last_seq = None if st is None else st.last_seq
        lag = None
        if state.published_seq is not None and last_seq is not None:
            lag = max(0, state.published_seq - last_seq)
        return {
            "id": worker,
            **state.entry.model_dump(),
            "state": "misconfigured" if state.misconfigured else _state(state.up, stream, last_seq),
            "up": state.up,
            "stream": stream,
            "connected": None if st is None else st.connected,
            "blocks_indexed": self.router.indexer.block_count(worker),
            "last_seq": last_seq,
            "published_seq": state.published_seq,
            "lag": lag,
            "gaps": None if st is None else st.gaps,
            "resyncs": None if st is None else st.resyncs,
            "restarts": None if st is None else st.restarts,
            "in_flight": self.load.active(worker),
            "incarnation": state.incarnation,
            "keying": self._keying(worker),
            "anomalies": self.router.indexer.worker_anomalies(worker),
            "probe_error": state.probe_error,
        }


def _down(misconfigured: bool) -> str:
    return "misconfigured" if misconfigured else "down"


def _state(up: bool, stream: str | None, last_seq: int | None) -> str:
    """``down`` (no health answer), ``waiting`` (no batch received yet: the view becomes exact
    at the worker's next batch, which is replayed from its first), else the stream's state:
    ``ok`` (provably complete) or ``degraded`` (events were lost; resync in progress)."""
    if not up:
        return "down"
    if stream is None or last_seq is None:
        return "waiting"
    return stream


def _keyed(values: dict[int, Any]) -> dict[str, Any]:
    return {str(w): v for w, v in sorted(values.items())}
