"""The router service's state: the router, its event pump, its load view, the workers' health.

:class:`RouterService` owns one :class:`~router_sim.router.routing.Router`, fed by an
:class:`~router_sim.service.pump.EventPump` (events) and an
:class:`~router_sim.service.inflight.InFlightLoad` (load), and probes every worker's HTTP API
through the endpoints its engine serves (:mod:`router_sim.service.probes`): only workers that
answer are offered to the policy; a worker that does not answer is skipped, not forgotten (its
index stays until it is seen again). Engines' own load figures (requests running and waiting,
KV usage) join what the router forwarded itself.

Restarts: this project's worker tells its *incarnation* in its health answer; a new one means
a restart, and the service resubscribes to its stream, which drops the old view and replays
the new stream from its first batch. Engines tell no incarnation: their restart is seen on the
event stream itself (a seq going backwards, see :mod:`events.stream.sequencer`), and the
subscriber drops the old view the same way. Either way, one log line says so.

Text and chat prompts are tokenized with the model's tokenizer (:mod:`.tokenizer`) before they
are hashed; :meth:`RouterService.model_view` says which tokenizer, context length and
workers serve the model a request names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp import web

from events.stream.security import CurveClient
from events.stream.subscriber import BatchDelivery, ResyncRequired
from router_sim.router.indexer import engine_clear_scope
from router_sim.router.policies import NoWorkersError, make_policy, without_history
from router_sim.router.routing import Router, RoutingDecision
from router_sim.service import probes
from router_sim.service.fleet import FleetFile, WorkerEntry
from router_sim.service.inflight import InFlightLoad
from router_sim.service.metrics import IndexView, ServiceMetrics, WorkerGauges
from router_sim.service.probes import ProbeFailed
from router_sim.service.protocol import BadRequest, NotFound
from router_sim.service.pump import EventPump, PumpItem, WorkerRemoved
from router_sim.service.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

TOKENIZER_THREADS: Final = 2
"""Threads that tokenize long prompts (see :func:`router_sim.service.proxy.off_loop`)."""


class FleetConflict(ValueError):
    """A worker id that is already in the fleet (add) or not in it (remove)."""


@dataclass(slots=True)
class WorkerState:
    """What the service knows of one worker besides its stream and index."""

    entry: WorkerEntry
    up: bool = False
    ever_up: bool = False
    incarnation: str | None = None
    published_seq: int | None = None
    probe_error: str | None = None
    load_error: str | None = None
    misconfigured: bool = False
    models: dict[str, dict[str, Any]] | None = None
    """The model cards the worker serves (its ``GET /v1/models``), by id; None: not asked yet."""
    lag_s: float | None = None
    """Seconds between the publishing of the last batch applied and its application."""
    restarts_seen: int = 0


@dataclass(frozen=True, slots=True)
class ModelView:
    """What routing a request for one model needs: its tokenizer, context length, the
    workers serving it (None: any), and how an adapter's blocks are keyed."""

    name: str | None
    tokenizer: PromptTokenizer | None
    max_model_len: int | None
    workers: frozenset[int] | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class _Models:
    """The fleet file's per-model settings with ``--tokenizer`` as the default tokenizer."""

    tokenizers: dict[str, PromptTokenizer] = field(default_factory=dict)
    default: PromptTokenizer | None = None
    max_len: dict[str, int] = field(default_factory=dict)


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
        tokenizer: PromptTokenizer | None = None,
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
        self._models = _Models(default=tokenizer)
        self.tokenizer_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZER_THREADS, thread_name_prefix="router-tokenize"
        )
        for name, model in fleet.models.items():
            if model.tokenizer is not None:
                self._models.tokenizers[name] = PromptTokenizer.load(model.tokenizer)
            if model.max_model_len is not None:
                self._models.max_len[name] = model.max_model_len
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
                gauges=self._gauges,
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
        self.tokenizer_threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- fleet

    async def add_worker(self, entry: WorkerEntry, *, probe: bool = True) -> None:
        """Add a worker at run time (:class:`FleetConflict` if its id is taken)."""
        if entry.id in self.workers:
            raise FleetConflict(f"worker {entry.id} is already in the fleet; remove it first")
        self.workers[entry.id] = WorkerState(entry)
        # what its AllBlocksCleared empties, as its engine means it
        self.router.indexer.set_clear_scope(entry.id, engine_clear_scope(entry.engine))
        self.load.add(entry.id)
        self.load.set_eligible(entry.id, False)  # until its first probe answers
        try:
            await self.pump.add_worker(entry.id, entry.events, entry.replay)
        except Exception:
            self.workers.pop(entry.id, None)
            self.load.remove(entry.id)
            raise
        st = self.pump.statuses().get(entry.id)
        self.workers[entry.id].restarts_seen = 0 if st is None else st.restarts
        log.info("worker %d added (%s, %s)", entry.id, entry.engine, entry.http)
        if probe:
            await self.probe(entry.id)

    async def remove_worker(self, worker: int) -> None:
        if worker not in self.workers:
            raise FleetConflict(f"worker {worker} is not in the fleet")
        del self.workers[worker]
        self.load.remove(worker)
        await self.pump.remove_worker(worker)
        log.info("worker %d removed", worker)

    def _apply(self, items: list[PumpItem]) -> None:
        router = self.router
        workers = self.workers
        for item in items:
            if isinstance(item, BatchDelivery):
                state = workers.get(item.worker)
                if state is not None:
                    router.apply(item.worker, item.batch)
                    state.lag_s = max(0.0, time.time() - item.batch.ts)
            elif isinstance(item, ResyncRequired):
                router.reset_worker(item.worker)
                self._log_resync(item)
            elif isinstance(item, WorkerRemoved):
                router.remove_worker(item.worker)

    def _log_resync(self, item: ResyncRequired) -> None:
        state = self.workers.get(item.worker)
        st = self.pump.statuses().get(item.worker)
        if state is not None and st is not None and st.restarts > state.restarts_seen:
            state.restarts_seen = st.restarts
            log.warning(
                "worker %d restarted (%s): its cached blocks are forgotten and its new event "
                "stream is read from its first batch",
                item.worker,
                item.reason,
            )
        else:
            log.warning("worker %d: its view is dropped and rebuilt (%s)", item.worker, item.reason)

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
        entry = state.entry
        try:
            got = await probes.probe(self.session, entry.engine, entry.http, self.probe_timeout_s)
        except ProbeFailed as exc:
            self.mark_down(worker, str(exc))
            return
        if self.workers.get(worker) is not state:
            return  # removed (or replaced) while the probe was in flight
        if got.incarnation is not None:
            if state.incarnation is not None and got.incarnation != state.incarnation:
                # the log line comes with the resync this causes (see _log_resync)
                await self.pump.resubscribe(worker, entry.events, entry.replay)
            state.incarnation = got.incarnation
        state.published_seq = got.published_seq
        mismatch = self._mismatch(got)
        if mismatch is not None:
            self.mark_down(worker, mismatch, misconfigured=True)
            return
        if not state.up and (state.models is None or not state.ever_up):
            cards = await probes.served_models(self.session, entry.http, self.probe_timeout_s)
            if self.workers.get(worker) is not state:
                return
            state.models = {str(c["id"]): c for c in cards}
        self._load_error(worker, state, got.load_error)
        if got.kv_usage is not None:
            self.load.set_kv_usage(worker, got.kv_usage)
        if got.requests is not None or got.load_error is not None:
            self.load.set_reported(worker, got.requests)
        if not state.up:
            if state.ever_up:
                log.info("worker %d is back up (was: %s)", worker, state.probe_error)
            else:
                log.info("worker %d is up (%s at %s)", worker, entry.engine, entry.http)
        state.up = state.ever_up = True
        state.misconfigured = False
        state.probe_error = None
        self.load.set_eligible(worker, True)

    def _load_error(self, worker: int, state: WorkerState, why: str | None) -> None:
        if why != state.load_error:
            if why is None:
                log.info("worker %d: its load is read again", worker)
            else:
                log.warning(
                    "worker %d: its load cannot be read (%s); routing counts only what this "
                    "router sent it",
                    worker,
                    why,
                )
        state.load_error = why

    def _mismatch(self, got: probes.ProbeResult) -> str | None:
        """Why a worker's announced block size or hash algorithm differs from the fleet's (its
        blocks would never match a request hashed the fleet's way), or None. Engines that do not
        say are trusted."""
        fleet = self.fleet
        if got.tokens_per_block is not None and got.tokens_per_block != fleet.tokens_per_block:
            return (
                f"the worker has {got.tokens_per_block} tokens per block, the fleet "
                f"{fleet.tokens_per_block}"
            )
        if got.hash_algo is not None and got.hash_algo != fleet.hash_algo:
            return f"the worker hashes with {got.hash_algo}, the fleet with {fleet.hash_algo}"
        return None

    def mark_down(self, worker: int, why: str, *, misconfigured: bool = False) -> None:
        """Stop offering ``worker`` until its health probe answers again (and, when
        ``misconfigured``, agrees with the fleet's block size and hash algorithm)."""
        state = self.workers.get(worker)
        if state is None:
            return
        if state.up or misconfigured != state.misconfigured or why != state.probe_error:
            log.warning("worker %d is %s: %s", worker, _down(misconfigured), why)
        state.up = False
        state.misconfigured = misconfigured
        state.probe_error = why
        self.load.set_eligible(worker, False)

    # ------------------------------------------------------------- models

    def served_models(self) -> dict[str, dict[str, Any]]:
        """Every model the fleet serves, by id: what the workers' ``/v1/models`` list (the
        fleet file's models and adapter names too), with the workers serving each."""
        out: dict[str, dict[str, Any]] = {}
        for w, state in sorted(self.workers.items()):
            names = dict(state.models or {})
            if state.entry.model is not None:
                names.setdefault(state.entry.model, {"id": state.entry.model})
            for name, card in names.items():
                seen = out.setdefault(name, {"card": card, "workers": set()})
                seen["workers"].add(w)
        for name in self.fleet.models:
            out.setdefault(name, {"card": {"id": name}, "workers": None})
        for name in self.loras:
            out.setdefault(name, {"card": {"id": name}, "workers": None})
        return out

    def model_view(self, name: str | None) -> ModelView:
        """How to route a request naming ``name`` (:class:`NotFound` with the list of the
        served models when the fleet does not serve it)."""
        m = self._models
        if name in self.loras:
            return ModelView(name, m.default, None)
        served = self.served_models()
        if name is None:  # the fleet's one base model, if it has one, without a filter
            bases = [n for n, f in served.items() if _is_base(f["card"]) and n not in self.loras]
            if len(bases) != 1:
                return ModelView(None, m.default, None)
            return dataclasses.replace(self.model_view(bases[0]), name=None, workers=None)
        found = served.get(name)
        if found is None:
            if not served:
                return ModelView(name, m.default, None)  # nothing is known: let the worker say
            raise NotFound(
                f"the model {name!r} is not served by this fleet; it serves {sorted(served)}"
            )
        card = found["card"]
        parent = card.get("parent")
        base = parent if isinstance(parent, str) else name
        tokenizer = m.tokenizers.get(name) or m.tokenizers.get(base) or m.default
        max_len = m.max_len.get(name) or m.max_len.get(base)
        if max_len is None:
            lens = [c["card"].get("max_model_len") for c in (found, served.get(base) or found)]
            known = [int(x) for x in lens if isinstance(x, int) and x > 0]
            max_len = min(known) if known else None
        workers = found["workers"]
        return ModelView(
            name,
            tokenizer,
            max_len,
            None if workers is None else frozenset(workers),
            lora_name=name if isinstance(parent, str) else None,
        )

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
        self,
        prompt: Sequence[int],
        lora_id: int | None,
        salt: str | None,
        *,
        workers: frozenset[int] | None = None,
        lora_name: str | None = None,
    ) -> RoutingDecision:
        """Route one prompt among ``workers`` (None: all; raises ``NoWorkersError`` when no
        worker is eligible, and :class:`BadRequest` for token ids the hashing refuses)."""
        try:
            if workers is not None:
                self.load.only(workers)
            decision = self.router.route(
                prompt, lora_id=lora_id, cache_salt=salt, lora_name=lora_name
            )
        except NoWorkersError:
            raise
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None
        finally:
            if workers is not None:
                self.load.only(None)
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
            # per candidate, the KV-cache group that cut its overlap (hybrid models)
            "limited_by": _keyed(d.limited_by),
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

    def _lag_seqs(self, state: WorkerState, last_seq: int | None) -> int | None:
        if state.published_seq is None or last_seq is None:
            return None
        return max(0, state.published_seq - last_seq)

    def _gauges(self) -> dict[int, WorkerGauges]:
        statuses = self.pump.statuses()
        out: dict[int, WorkerGauges] = {}
        for w, state in self.workers.items():
            st = statuses.get(w)
            seqs = self._lag_seqs(state, None if st is None else st.last_seq)
            out[w] = WorkerGauges(state.lag_s, seqs, self.load.load(w).kv_usage)
        return out

    def worker_report(self, worker: int) -> dict[str, Any]:
        """``GET /workers`` for one worker."""
        state = self.workers[worker]
        st = self.pump.statuses().get(worker)
        stream = None if st is None else st.state
        last_seq = None if st is None else st.last_seq
        load = self.load.load(worker)
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
            "lag": self._lag_seqs(state, last_seq),
            "lag_seconds": None if state.lag_s is None else round(state.lag_s, 6),
            "gaps": None if st is None else st.gaps,
            "resyncs": None if st is None else st.resyncs,
            "restarts": None if st is None else st.restarts,
            "in_flight": self.load.active(worker),
            "load": {
                "active_requests": load.active_requests,
                "reported_requests": self.load.reported(worker),
                "kv_usage": load.kv_usage,
            },
            "models": sorted(state.models or ()),
            "incarnation": state.incarnation,
            "keying": self._keying(worker),
            "anomalies": self.router.indexer.worker_anomalies(worker),
            "probe_error": state.probe_error,
            "load_error": state.load_error,
        }


SERVICE: web.AppKey[RouterService] = web.AppKey("service", RouterService)
"""Where the aiohttp application keeps its service."""


def _is_base(card: dict[str, Any]) -> bool:
    return not isinstance(card.get("parent"), str)  # an adapter names its base model


def _down(misconfigured: bool) -> str:
    return "misconfigured" if misconfigured else "down"


def _state(up: bool, stream: str | None, last_seq: int | None) -> str:
    """``down`` (no health answer), ``waiting`` (no batch received yet, and the worker's
    replay has not shown its history complete: while the replay asked on joining runs, or
    without a replay socket; the view becomes exact at the worker's next batch), else the
    stream's state: ``ok`` (provably complete, an empty history included) or ``degraded``
    (events were lost; resync in progress)."""
    if not up:
        return "down"
    if stream is None or (last_seq is None and stream != "ok"):
        return "waiting"
    return stream


def _keyed(values: dict[int, Any]) -> dict[str, Any]:
    return {str(w): v for w, v in sorted(values.items())}
