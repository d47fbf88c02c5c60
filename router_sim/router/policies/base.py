"""What every routing policy sees and returns, and the helpers they share.

A policy is a small object with a ``choose(request) -> PolicyChoice`` method. The router
builds the :class:`RouteRequest` (the request's block hashes, what the index says each worker
holds, each candidate's load, and the current time, injected) and the policy picks one of the
candidate workers. Policies read no clock and no global random state: time comes in the
request and randomness from a ``random.Random(seed)`` of their own.

Exact ties are not broken with that randomness but with :func:`tie_rank`, a function of the
request's content (:func:`content_key` of its token ids), the policy's seed and the worker ids
(rendezvous hashing): two router replicas that see the same index and loads break every tie
alike, whatever other requests each of them routed before, while different prompts still
spread over the tied workers.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

import xxhash

from events.wire.model import BlockHash
from router_sim.router.indexer import MatchDetail
from router_sim.router.load import WorkerLoad
from router_sim.router.policies.kernels import BoundedLoad as BoundedLoad  # re-exported
from router_sim.router.policies.kernels import credited_blocks as credited_blocks  # re-exported
from router_sim.router.policies.kernels import load_rank as load_rank  # re-exported
from router_sim.router.policies.kernels import lowest_cost as lowest_cost  # re-exported


class RoutingError(RuntimeError):
    """A routing decision could not be made."""


class NoWorkersError(RoutingError):
    """The load source offered no worker to route to."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as a policy sees it.

    ``block_hashes``: the hashes of the request's full blocks, first block first.
    ``num_tokens``: prompt length (the last partial block is not in ``block_hashes``).
    ``matches``: per worker what the event-fed index says it holds of the chain (absent: none).
    ``loads``: the candidate workers and their load. ``now_ms``: the injected current time.
    ``content_key``: :func:`content_key` of the prompt's token ids, given by the router for
    tie-breaks (None: they use the last block hash). ``prompt``: the prompt's token ids, given
    instead of ``content_key`` so that the key is only made for a tie (most decisions have
    none); a given ``content_key`` wins.
    """

    block_hashes: Sequence[BlockHash]
    num_tokens: int
    tokens_per_block: int
    matches: Mapping[int, MatchDetail]
    loads: Mapping[int, WorkerLoad]
    now_ms: float = 0.0
    content_key: int | None = None
    prompt: Sequence[int] | bytes | bytearray | memoryview | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks the prompt occupies, a trailing partial block included."""
        return -(-self.num_tokens // self.tokens_per_block)

    def tie_key(self, seed: int = 0) -> int:
        """A 64-bit key of this request's content for :func:`tie_rank`, mixed with ``seed``:
        :attr:`content_key` when the router gave one, else the last full block's hash (a
        chain hash: it covers every full block) and the prompt's length. The same on every
        replica; no clock, no per-router state."""
        key = self.content_key
        if key is None and self.prompt is not None:
            key = content_key(self.prompt)
        if key is None:
            last = self.block_hashes[-1] if self.block_hashes else 0
            if isinstance(last, str):  # engine hashes as text: Python's str hash is per process
                last = xxhash.xxh64_intdigest(last.encode())
            key = mix64(last ^ _GOLDEN * (self.num_tokens + 1))
        return mix64(key ^ mix64(seed + _GOLDEN))


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    """A policy's pick and why: ``costs`` (lower is better; empty when the policy does not
    score workers) and ``predicted_overlap`` (the cached blocks the policy credited each
    worker with, from whatever source it trusts)."""

    worker: int
    reason: str
    costs: dict[int, float] = field(default_factory=dict)
    predicted_overlap: dict[int, float] = field(default_factory=dict)


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses a worker for a request."""

    name: str

    def choose(self, request: RouteRequest) -> PolicyChoice:
        """Pick one of ``request.loads``' workers. Raises :class:`NoWorkersError` if empty."""
        ...


def load_key(worker: int, load: WorkerLoad) -> tuple[int, int, int, int]:
    """Sort key of 'least loaded first', ties broken by worker id for determinism."""
    return (load.active_requests, load.pending_prefill_tokens, load.decode_blocks, worker)


def candidates(request: RouteRequest) -> list[int]:
    """The request's candidate workers in a stable order; raises if there are none."""
    if not request.loads:
        raise NoWorkersError("no worker to route to: the load source offered an empty list")
    return sorted(request.loads)


CONTENT_TAIL: Final = 32
"""Token ids at the end of a prompt that :func:`content_key` reads (with the length)."""


def content_key(tokens: Sequence[int] | bytes | bytearray | memoryview) -> int:
    """A 64-bit key of a prompt's token ids for tie-breaks: xxh64 of its last
    :data:`CONTENT_TAIL` ids (little-endian int32s) seeded with its length. The ids alone,
    not the reuse scope or the engine's hashes: prompts whose blocks an engine names
    differently (an adapter by name or by id) tie alike, and it costs the same for any prompt
    length. Packed input (bytes, ``array('i')``) is native int32s, as the router hashes it."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = memoryview(tokens).cast("B")
        n = raw.nbytes // 4
        ids: array[int] = array("i")
        ids.frombytes(raw[4 * max(0, n - CONTENT_TAIL) : 4 * n])
        return _tail_key(ids, n)
    return _tail_key(tokens[-CONTENT_TAIL:], len(tokens))


def _tail_key(tail: Sequence[int], length: int) -> int:
    if _LITTLE and isinstance(tail, array) and tail.typecode == "i":
        data = tail.tobytes()  # already little-endian int32s: no per-id packing
    else:
        data = struct.pack(f"<{len(tail)}i", *tail)
    return xxhash.xxh64_intdigest(data, seed=length)


_LITTLE: Final = sys.byteorder == "little"


_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood, OOPSLA 2014; its published constants):
    a bijection on 64-bit ints whose output bits each depend on every input bit."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def tie_rank(key: int) -> Callable[[int], int]:
    """Rendezvous (highest-random-weight) order of the workers for a request of ``key``
    (Thaler and Ravishankar, 1998): the tied worker of lowest ``rank(worker)`` wins. Each
    worker's rank depends on the key and its own id only, so removing a worker moves only the
    ties it won, and the pick is uniform over the tied workers across requests."""
    return lambda worker: mix64(key ^ mix64(worker + _GOLDEN))


def softmax_sample(
    costs: Mapping[int, float], temperature: float, uniform: float
) -> tuple[int, dict[int, float]]:
    """Sample a worker with probability proportional to exp(-normalized cost / temperature).

    Costs are normalized by the largest one so that ``temperature`` means the same thing for
    short and long prompts. ``uniform`` is one draw in [0, 1) from the caller's seeded RNG.
    Returns the worker and the probabilities (for explanations and tests).
    """
    workers = sorted(costs)
    top = max(abs(c) for c in costs.values()) or 1.0
    logits = [-costs[w] / top / temperature for w in workers]
    shift = max(logits)
    weights = [math.exp(x - shift) for x in logits]
    total = sum(weights)
    probs = {w: wt / total for w, wt in zip(workers, weights, strict=True)}
    acc = 0.0
    for w in workers:
        acc += probs[w]
        if uniform < acc:
            return w, probs
    return workers[-1], probs
