"""Typed errors of the cache manager."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error raised by kvcache."""


class OutOfPagesError(KVCacheError):
    """No free or evictable page was left on the device tier.

    Raised before anything changes: every cached block and every live sequence stay intact.
    """


class ClosedCacheError(KVCacheError):
    """A ``KVCache`` was used after ``close()``."""


class CacheStateError(KVCacheError):
    """An operation that the sequence's current state does not allow (for example committing
    after ``stop_committing()``, or committing while suspended)."""


class WrongThreadError(KVCacheError):
    """A manager or one of its sequences was used from a thread other than its owner's
    (see :mod:`kvcache.owner`); nothing was changed."""
