"""Kept for imports written before the publisher moved: it is :mod:`events.stream.publisher`."""

from events.stream.publisher import (
    PublisherError,
    PublisherHealth,
    PublisherStats,
    ZmqEventPublisher,
)

__all__ = ["PublisherError", "PublisherHealth", "PublisherStats", "ZmqEventPublisher"]
