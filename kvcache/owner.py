"""One owning thread per cache manager, checked at every entry point that reads or changes
the tree, the pools or a sequence.

Why not a lock: the manager runs inside an engine's scheduler loop, one call per request and
per step; a lock there costs on every call and only hides a design error (two schedulers
sharing one cache). Two threads interleaving used to corrupt the tree and the free lists for
good, surfacing later as untyped errors far from the cause. The check is one
``threading.get_ident()`` compared with the owner's: the first thread that uses the manager
owns it (so a manager built in one thread and handed to the engine thread just works), and
:meth:`ThreadOwner.hand_over` lets the owner pass it on explicitly. Counters read for metrics
(``kv_usage``, ``num_available_pages``, ``stats``) are not checked: a stale number is harmless.
"""

from __future__ import annotations

import threading
from typing import Final

from kvcache.errors import WrongThreadError

_NOBODY: Final = -1
_get_ident: Final = threading.get_ident  # bound once: the check runs on every call


class ThreadOwner:
    """The thread allowed to use one manager and its sequences."""

    __slots__ = ("_ident", "_lock")

    def __init__(self) -> None:
        self._ident = _NOBODY
        self._lock = threading.Lock()  # only taken while nobody owns the manager

    def check(self, what: str) -> None:
        """Raise :class:`WrongThreadError` unless the calling thread owns the manager (the
        first caller becomes the owner)."""
        ident = _get_ident()
        if ident == self._ident:
            return
        with self._lock:
            if self._ident == _NOBODY:
                self._ident = ident
                return
            owner = self._ident
        raise WrongThreadError(
            f"{what}: this KVCacheManager belongs to thread {owner}, called from thread "
            f"{ident}; drive a manager and its sequences from one thread (hand_over() passes "
            "it on)"
        )

    def hand_over(self) -> None:
        """Called by the owner: the next thread that uses the manager becomes its owner."""
        self.check("hand_over")
        with self._lock:
            self._ident = _NOBODY
