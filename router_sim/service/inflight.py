"""The router service's load view: what it forwarded and has not seen finish.

A :class:`~router_sim.router.load.LoadSource` fed by the proxy, not by the workers: each request the
router forwards counts as active on its worker, its uncached prompt tokens as pending prefill
until the first token comes back, then its blocks as decode blocks until the answer ends.
``kv_usage`` comes from the worker itself (its health or metrics endpoint), and so may the
number of requests it holds (:meth:`InFlightLoad.set_reported`: an engine's own count of its
running and waiting requests, which includes what other routers sent it): a worker's
``active_requests`` is the larger of the two counts.

This is why replicas of the router differ: each knows only the requests it forwarded itself.
Two replicas with the same index and no requests in flight see the same load, and so decide
alike.

Only workers that are *eligible* (in the fleet and answering their health probe) are offered
to the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from router_sim.router.load import WorkerLoad


@dataclass(slots=True)
class _Book:
    active: int = 0
    pending_prefill: int = 0
    decode_blocks: int = 0
    kv_usage: float = 0.0
    eligible: bool = True
    reported: int | None = None
    shown: WorkerLoad | None = None
    """The last load :meth:`InFlightLoad.load` made of this book (kept while the figures are
    the same: every routing decision reads every candidate's load)."""


@dataclass(eq=False, slots=True)
class Ticket:
    """One forwarded request's contribution to its worker's load."""

    worker: int
    prefill_tokens: int
    blocks: int
    decoding: bool = False
    done: bool = False


class InFlightLoad:
    """See the module docstring. Used from the service's event loop only."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._books: dict[int, _Book] = {}
        self._only: frozenset[int] | None = None

    # ------------------------------------------------------------ LoadSource

    def workers(self) -> list[int]:
        only = self._only
        return [w for w, b in self._books.items() if b.eligible and (only is None or w in only)]

    def load(self, worker: int) -> WorkerLoad:
        b = self._books.get(worker)
        if b is None:
            return WorkerLoad()
        active = b.active if b.reported is None else max(b.active, b.reported)
        shown = b.shown
        if (
            shown is None
            or shown.active_requests != active
            or shown.pending_prefill_tokens != b.pending_prefill
            or shown.kv_usage != b.kv_usage
            or shown.decode_blocks != b.decode_blocks
        ):
            shown = b.shown = WorkerLoad(active, b.pending_prefill, b.kv_usage, b.decode_blocks)
        return shown

    def only(self, workers: frozenset[int] | None) -> None:
        """Offer only ``workers`` (the ones serving a request's model) until called with
        None: set around one routing decision, on the loop, so no other request sees it."""
        self._only = workers

    # ------------------------------------------------------------ fleet

    def add(self, worker: int) -> None:
        self._books.setdefault(worker, _Book())

    def remove(self, worker: int) -> None:
        self._books.pop(worker, None)

    def set_eligible(self, worker: int, eligible: bool) -> None:
        b = self._books.get(worker)
        if b is not None:
            b.eligible = eligible

    def set_kv_usage(self, worker: int, kv_usage: float) -> None:
        b = self._books.get(worker)
        if b is not None:
            b.kv_usage = min(1.0, max(0.0, kv_usage))

    def set_reported(self, worker: int, requests: int | None) -> None:
        """The worker's own count of the requests it holds (None: not known)."""
        b = self._books.get(worker)
        if b is not None:
            b.reported = None if requests is None else max(0, requests)

    def reported(self, worker: int) -> int | None:
        b = self._books.get(worker)
        return None if b is None else b.reported

    def active(self, worker: int) -> int:
        b = self._books.get(worker)
        return 0 if b is None else b.active

    # ------------------------------------------------------------ requests

    def begin(self, worker: int, prompt_tokens: int, cached_tokens: int) -> Ticket:
        """A request was forwarded to ``worker``; ``cached_tokens`` the index's overlap."""
        tpb = self.tokens_per_block
        t = Ticket(worker, max(0, prompt_tokens - cached_tokens), -(-prompt_tokens // tpb))
        b = self._books.setdefault(worker, _Book())
        b.active += 1
        b.pending_prefill += t.prefill_tokens
        return t

    def first_token(self, t: Ticket) -> None:
        """The worker answered the first token: the prompt is prefilled, decoding started."""
        if t.decoding or t.done:
            return
        t.decoding = True
        b = self._books.get(t.worker)
        if b is not None:
            b.pending_prefill = max(0, b.pending_prefill - t.prefill_tokens)
            b.decode_blocks += t.blocks

    def end(self, t: Ticket) -> None:
        """The request finished (or failed): it no longer loads its worker."""
        if t.done:
            return
        t.done = True
        b = self._books.get(t.worker)
        if b is None:
            return  # the worker was removed meanwhile
        b.active = max(0, b.active - 1)
        if t.decoding:
            b.decode_blocks = max(0, b.decode_blocks - t.blocks)
        else:
            b.pending_prefill = max(0, b.pending_prefill - t.prefill_tokens)
