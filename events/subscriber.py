"""Kept for imports written before the subscriber moved: it is :mod:`events.stream.subscriber`."""

from events.stream.subscriber import (
    BatchDelivery,
    ResyncRequired,
    SubscriberError,
    WorkerStatus,
    ZmqEventSubscriber,
)

__all__ = [
    "BatchDelivery",
    "ResyncRequired",
    "SubscriberError",
    "WorkerStatus",
    "ZmqEventSubscriber",
]
