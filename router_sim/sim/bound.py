"""The compulsory-miss bound: the best prefix hit rate any router could reach on a workload.

Model: one infinite cache per reuse scope, shared by every worker, that keeps everything ever
computed. A request then reuses the longest token prefix it shares with any earlier request of
its scope (or with an earlier request's prompt + answer, since answers are computed and cached
too), and computes the rest; every distinct block of a scope is computed exactly once. Scopes
are respected: two tenants (cache salts) or two LoRA adapters never reuse each other's tokens,
even when their prompts are identical.

Two figures come out:

- token-weighted: reused prompt tokens / all prompt tokens (what the simulator's ``hit_rate``
  measures, so the two compare directly);
- block-level: fully reused blocks / all blocks, a block being ``tokens_per_block`` tokens of a
  prompt (the last one possibly partial, counted as reused only when entirely reused).

Requests given by Mooncake hash ids are evaluated on the ids (ids expand to disjoint tokens, so
the token prefix two prompts share is exactly their shared id prefix, up to the shorter last
block); explicit prompts are evaluated on tokens with a chunked trie whose children are kept
sorted, so the partial overlap inside a chunk is the longest common prefix with a sorted
neighbour.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Final

from kvcache.hashing import root_key
from kvcache.scope import ReuseScope
from kvcache.tokens import token_array, tokens_to_bytes
from router_sim.sim.workloads import Request

_CHUNK: Final = 64  # trie granularity for explicit prompts (any value gives the same result)


@dataclass(frozen=True, slots=True)
class BoundResult:
    """The compulsory-miss bound of a workload and what it is made of."""

    token_hit_rate: float
    block_hit_rate: float
    hit_tokens: int
    total_tokens: int
    hit_blocks: int
    total_blocks: int
    reusable: tuple[int, ...]
    """Per request (workload order): prompt tokens reusable under the infinite cache (capped
    as the token-weighted figure is)."""


def _lcp_bytes(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _TokenTrie:
    """Chunked trie over the token sequences of one scope (keys chained like block keys)."""

    def __init__(self, scope: ReuseScope) -> None:
        self.root: bytes = root_key(scope)
        self.children: dict[bytes, list[bytes]] = {}
        self.nodes: set[bytes] = set()

    def reusable(self, data: bytes) -> int:
        """Longest prefix of ``data`` (4 bytes per token) seen before, in tokens."""
        step = 4 * _CHUNK
        parent = self.root
        pos = 0
        while pos < len(data):
            chunk = data[pos : pos + step]
            key = sha256(parent + chunk).digest()
            if len(chunk) == step and key in self.nodes:
                parent = key
                pos += step
                continue
            siblings = self.children.get(parent, [])
            i = bisect_left(siblings, chunk)
            best = 0
            for j in (i - 1, i):
                if 0 <= j < len(siblings):
                    best = max(best, _lcp_bytes(chunk, siblings[j]))
            return (pos + best) // 4
        return pos // 4

    def insert(self, data: bytes) -> None:
        step = 4 * _CHUNK
        parent = self.root
        for pos in range(0, len(data), step):
            chunk = data[pos : pos + step]
            key = sha256(parent + chunk).digest()
            siblings = self.children.setdefault(parent, [])
            i = bisect_left(siblings, chunk)
            if i == len(siblings) or siblings[i] != chunk:
                insort(siblings, chunk)
            if len(chunk) < step:
                break
            self.nodes.add(key)
            parent = key


class _HashIdTrie:
    """Trie over Mooncake hash-id sequences; remembers the longest length seen per node."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
        self.longest: list[int] = [0]  # node -> most tokens of its block ever seen

    def reusable_then_insert(self, hash_ids: Sequence[int], length: int, per_id: int) -> int:
        ids, longest = self.ids, self.longest
        spans = min(-(-length // per_id), len(hash_ids)) if length > 0 else 0
        node = reused = 0
        matching = True
        for i in range(spans):
            take = per_id if i < spans - 1 else min(per_id, length - i * per_id)
            key = (node, hash_ids[i])
            child = ids.get(key)
            if child is None:  # a block never seen: nothing from here on is reused
                child = ids[key] = len(longest)
                longest.append(take)
                matching = False
            else:
                seen = longest[child]
                if matching:
                    reused += take if take < seen else seen
                    matching = seen >= take
                if take > seen:
                    longest[child] = take
            node = child
        return reused


def reusable_tokens(requests: Sequence[Request]) -> list[int]:
    """Per request, in the given order: prompt tokens an infinite per-scope cache would reuse."""
    tries: dict[ReuseScope, _TokenTrie] = {}
    id_tries: dict[tuple[ReuseScope, int], _HashIdTrie] = {}
    out: list[int] = []
    for req in requests:
        if req.prompt is None and req.hash_ids is not None:
            # Generated answers of id-given requests are unique tokens: they never match.
            id_trie = id_tries.setdefault((req.scope, req.tokens_per_hash_id), _HashIdTrie())
            out.append(
                id_trie.reusable_then_insert(req.hash_ids, req.input_length, req.tokens_per_hash_id)
            )
            continue
        trie = tries.get(req.scope)
        if trie is None:
            trie = tries[req.scope] = _TokenTrie(req.scope)
        prompt = tokens_to_bytes(token_array(req.tokens()))
        out.append(trie.reusable(prompt))
        trie.insert(prompt + tokens_to_bytes(token_array(req.output_tokens())))
    return out


def blocks_reused(reused: int, input_length: int, tokens_per_block: int) -> tuple[int, int]:
    """(fully reused blocks, blocks) of a prompt whose first ``reused`` tokens are reused."""
    total = -(-input_length // tokens_per_block)
    full = reused // tokens_per_block
    if reused >= input_length and input_length % tokens_per_block:
        full += 1  # the partial last block is entirely reused
    return min(full, total), total


def compulsory_bound(
    requests: Sequence[Request], tokens_per_block: int, *, recompute_last_token: bool = True
) -> BoundResult:
    """The compulsory-miss bound of ``requests`` (in arrival order) at ``tokens_per_block``.

    With ``recompute_last_token`` (the default, what engines and ``kvcache`` do: the last
    prompt token is always computed, its logits give the first output token) a request reuses
    at most ``input_length - 1`` tokens in the token-weighted figure. The block-level figure
    counts every block whose content was computed before, as trace statistics do.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    lcp = reusable_tokens(requests)
    cap = 1 if recompute_last_token else 0
    reusable = [min(n, r.input_length - cap) for n, r in zip(lcp, requests, strict=True)]
    hit_tokens = sum(reusable)
    total_tokens = sum(r.input_length for r in requests)
    hit_blocks = total_blocks = 0
    for req, reused in zip(requests, lcp, strict=True):
        full, total = blocks_reused(reused, req.input_length, tokens_per_block)
        hit_blocks += full
        total_blocks += total
    return BoundResult(
        token_hit_rate=hit_tokens / total_tokens if total_tokens else 0.0,
        block_hit_rate=hit_blocks / total_blocks if total_blocks else 0.0,
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        hit_blocks=hit_blocks,
        total_blocks=total_blocks,
        reusable=tuple(reusable),
    )
