"""What a routing policy may know about a worker besides its cache: load and timing.

Both the simulator and a live deployment provide worker load through :class:`LoadSource`
(a deployment would fill it from the workers' metrics endpoints, the simulator from its model
of each worker). :class:`TimingModel` is the shared shape of a prefill/decode latency model:
``router_sim.sim.timing_model.PolynomialTiming`` is the default implementation, the simulator's
workers and the ``predicted_ttft`` policy both speak this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A snapshot of one worker's load.

    ``active_requests``: requests admitted and not finished (queued, prefilling or decoding).
    ``pending_prefill_tokens``: prompt tokens admitted whose KV is not computed yet (the
    prefill queue, cached prefixes excluded). ``kv_usage``: fraction in [0, 1] of the device
    tier's pages held by live sequences. ``decode_blocks``: KV blocks held by requests that are
    decoding (the memory-bandwidth side of the load).
    """

    active_requests: int = 0
    pending_prefill_tokens: int = 0
    kv_usage: float = 0.0
    decode_blocks: int = 0

    def __post_init__(self) -> None:
        if self.active_requests < 0 or self.pending_prefill_tokens < 0 or self.decode_blocks < 0:
            raise ValueError(
                f"WorkerLoad counts must be >= 0, got active_requests={self.active_requests}, "
                f"pending_prefill_tokens={self.pending_prefill_tokens}, "
                f"decode_blocks={self.decode_blocks}"
            )
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"WorkerLoad.kv_usage must be in [0, 1], got {self.kv_usage}")


IDLE: WorkerLoad = WorkerLoad()


@runtime_checkable
class LoadSource(Protocol):
    """The workers a router may choose from and the current load of each."""

    def workers(self) -> list[int]:
        """Worker ids currently eligible for routing (order does not matter)."""
        ...

    def load(self, worker: int) -> WorkerLoad:
        """The latest known load of ``worker``."""
        ...


class StaticLoadSource:
    """A :class:`LoadSource` over a mutable table: for tests, scripts and simple deployments
    that push load snapshots in from elsewhere."""

    def __init__(self, loads: dict[int, WorkerLoad] | None = None) -> None:
        self._loads: dict[int, WorkerLoad] = dict(loads or {})

    def workers(self) -> list[int]:
        return list(self._loads)

    def load(self, worker: int) -> WorkerLoad:
        return self._loads.get(worker, IDLE)

    def set(self, worker: int, load: WorkerLoad | None = None) -> None:
        """Add ``worker`` or replace its load (idle when ``load`` is None)."""
        self._loads[worker] = IDLE if load is None else load

    def remove(self, worker: int) -> None:
        """Stop offering ``worker`` for routing."""
        self._loads.pop(worker, None)


@runtime_checkable
class TimingModel(Protocol):
    """Latency of one engine iteration, in milliseconds of simulated or predicted time."""

    def prefill_ms(self, num_tokens: int) -> float:
        """Time to prefill ``num_tokens`` uncached prompt tokens in one batch (0 for 0)."""
        ...

    def decode_ms(self, kv_usage: float) -> float:
        """Time of one decode iteration when ``kv_usage`` (fraction of device KV pages in use
        by decoding requests) is in use."""
        ...
