"""The replay's prompts made ahead, on a second thread.

Before routing a request the simulator expands its hash ids into a prompt
(:meth:`Request.tokens <router_sim.sim.workloads.Request.tokens>`) and the router hashes the
prompt's full blocks (:meth:`Router.hash_request <router_sim.router.routing.Router.hash_request>`).
Both depend on the request alone, so the native extension ``router_sim.sim._prefetch`` makes the
block keys on a thread of its own (expanding each prompt there to hash it), in arrival order and
a bounded number of requests ahead (it never takes the GIL), while the replay's thread
simulates: on a Mooncake replay the hashing was about a sixth of that thread's work, which a
second core now takes (the replay still expands its own copy of each prompt). What the replay
gets is what the inline path makes, value for value (tests compare both, and whole reports with
and without).

Requests the thread does not make (a given prompt, a hash-id width other than the trace's,
too few hash ids for the length), and every request with :data:`ENABLED` False, are made
inline as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcache.hashing import BlockKey, root_key
from kvcache.scope import ReuseScope
from router_sim.sim.native import KEYS, Prefetch
from router_sim.sim.workloads import PROMPT_TOKEN_BITS, TOKENS_PER_HASH_ID, Request, _layout

__all__ = ["AHEAD", "ENABLED", "Made", "PromptSource", "prompt_source"]

ENABLED = True
"""False: every prompt is made inline on the replay's thread (the reference path)."""

AHEAD = 1024
"""How many requests the thread may run ahead of the replay (each holds its block hashes)."""


Made = tuple[list[int] | None, list[BlockKey] | None]
"""What the thread made for a request: the router's V1 keys of its full blocks (None when not
asked), and the cache's keys of them (None on a big-endian CPU)."""


class PromptSource(Protocol):
    def take(self) -> Made | None: ...

    def close(self) -> None: ...


def _job(
    req: Request, scope: ReuseScope, hashed: bool, root: BlockKey | None
) -> tuple[tuple[int, ...], int, int | None, int | None, bool, BlockKey | None] | None:
    ids = req.hash_ids
    if (
        req.prompt is not None
        or ids is None
        or type(ids) is not tuple
        or req.tokens_per_hash_id != TOKENS_PER_HASH_ID
        or len(ids) * TOKENS_PER_HASH_ID < req.input_length
        or not all(type(h) is int for h in ids)
    ):
        return None
    return (ids, req.input_length, scope.lora_id, scope.salt, hashed, root)


def prompt_source(
    requests: Sequence[Request],
    scopes: Sequence[ReuseScope],
    tokens_per_block: int,
    hashed: bool,
) -> PromptSource | None:
    """A thread working through ``requests`` in order, or None when it cannot run here or
    there is nothing for it to do. For each request under its scope (``scopes``) it makes the
    keys of the prompt's full blocks of ``tokens_per_block`` tokens: with ``hashed``, the V1
    hashes the router keys them by (:meth:`Router.hash_request`); on a little-endian CPU,
    the keys the workers' caches store them under (``kvcache.hashing.blockchain_keys``).
    ``take()`` gives each request's :data:`Made` in turn, or None for a request it did not
    take (made inline); ``close()`` stops the thread."""
    if not ENABLED or not requests:
        return None
    roots: dict[ReuseScope, BlockKey] = {}
    keyed = bool(KEYS)
    jobs = []
    for req, scope in zip(requests, scopes, strict=True):
        root = None
        if keyed:
            root = roots.get(scope)
            if root is None:
                root = roots[scope] = root_key(scope)
        jobs.append(_job(req, scope, hashed, root))
    if all(job is None for job in jobs) or not (hashed or keyed):
        return None
    pos_bits, mask = _layout(TOKENS_PER_HASH_ID)
    source: PromptSource = Prefetch(
        jobs, TOKENS_PER_HASH_ID, PROMPT_TOKEN_BITS - pos_bits, mask, tokens_per_block, AHEAD
    )
    return source
