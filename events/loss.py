"""The loss marker: how events the event manager dropped stay visible on every path.

When :class:`~events.manager.KVCacheEventManager`'s bounded buffer overflows, the oldest events
are gone, and what is drained next no longer adds up to the cache: a router applying it
would keep blocks whose removal was dropped and miss blocks whose storing was. So the first
item :meth:`~events.manager.KVCacheEventManager.get_latest_events` hands out after a loss is a
*loss marker*: a :class:`~events.wire.model.KVCacheEvent` whose ``data`` is
:class:`EventsLost` (the ids of the events dropped). It is not an event and has no wire form:

- :meth:`events.stream.publisher.ZmqEventPublisher.publish` turns a leading marker into a
  burned seq (``skip()``) before the batch, which subscribers see as a gap that no replay
  fills; they recover by snapshot or report the worker degraded, never a silently wrong view;
- :func:`events.wire.codec.encode_batch` refuses it (``TypeError: not an event payload``), so
  a caller with its own transport cannot send the rest as a complete history either.

Callers that take the loss themselves (``take_dropped()`` before draining, as
``publish_drained`` does, or ``end_step()``) get the count instead of a marker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from events.wire.model import EventData, KVCacheEvent


@dataclass(frozen=True, slots=True)
class EventsLost:
    """The data of a loss marker: events ``first_event_id .. first_event_id + count - 1``
    were dropped by the event manager's full buffer. Not an event payload."""

    first_event_id: int
    count: int


def loss_marker(
    first_event_id: int,
    count: int,
    window_size: int = 0,
    hash_algo: str = "v1_block_key",
    dp_rank: int | None = None,
) -> KVCacheEvent:
    """The marker standing for ``count`` dropped events from ``first_event_id`` (its own
    ``event_id``, so ids stay in order in a drained list)."""
    if count < 1:
        raise ValueError(f"a loss marker stands for >= 1 dropped events, got {count}")
    # deliberately outside EventData: every consumer that does not know the marker refuses
    # it (the codec raises) instead of taking it for an event
    data = cast(EventData, EventsLost(first_event_id, count))
    return KVCacheEvent(first_event_id, data, window_size, hash_algo, dp_rank)


def lost_events(event: KVCacheEvent) -> int:
    """How many dropped events ``event`` stands for: 0 unless it is a loss marker."""
    data: object = event.data
    return data.count if type(data) is EventsLost else 0


def leading_loss(events: Sequence[KVCacheEvent]) -> int:
    """How many dropped events the marker at the head of ``events`` stands for (0: none)."""
    return lost_events(events[0]) if events else 0
