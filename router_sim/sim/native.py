"""The one import of the simulator's native extension, ``router_sim.sim._prefetch``: its prompt
writer (``expand_array``, for :func:`router_sim.sim.workloads.expand_hash_ids`) and its prompt
thread (``Prefetch``, for :mod:`router_sim.sim.prefetch`), which share one C statement of the
prompt formula."""

from __future__ import annotations

from router_sim.sim._prefetch import KEYS, Prefetch, expand_array

__all__ = ["KEYS", "Prefetch", "expand_array"]
